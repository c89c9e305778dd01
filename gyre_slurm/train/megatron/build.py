"""Build one layout's Megatron model, DDP wrapper and optimizer (Megatron's own classes).

- `Layout`: TP x PP x EP and the training precision of a world.
- `transformer_config`: a `TransformerConfig` for a `ModelShape` (RMSNorm, SwiGLU, RoPE,
  GQA; q/k/v biases for qwen2; per-head q/k norms for qwen3; for qwen3_moe a top-k
  softmax router over SequentialMLP experts, dropless, routed over EP with all-to-all,
  no load-balancing loss, so the loss is the torch backend's). Expert tensor
  parallelism is 1; Megatron needs sequence parallelism when TP and EP are both > 1,
  so it is on for MoE models whenever TP > 1.
- `build`: GPTModel (bf16: wrapped in `Float16Module`, which returns fp32 logits) ->
  `DistributedDataParallel` (gradients accumulate in its contiguous buffers, fp32 with
  bf16 parameters) -> `get_megatron_optimizer` (AdamW: fp32 master weights and moments
  for bf16; with `distributed_optimizer`, master weights and moments sharded over the
  data-parallel ranks, gradients reduce-scattered, parameters all-gathered after the
  step). A MoE model gets a chained optimizer: dense and expert parameters, the expert
  ones sharded over the expert-data-parallel group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gyre_slurm.models.shape import ModelShape

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    precision: str = "fp32"
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.ep) < 1:
            raise ValueError(f"tensor_parallel {self.tp}, pipeline_parallel {self.pp} and "
                             f"expert_parallel {self.ep} must be >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of "
                             f"{', '.join(PRECISIONS)}")

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    def check(self, shape: ModelShape, world_size: int) -> None:
        """ValueError unless `world_size` ranks hold this layout of `shape`."""
        shape.check_layout(self.tp, self.pp, self.ep)
        if world_size % (self.tp * self.pp):
            raise ValueError(f"a world of {world_size} ranks cannot hold tensor_parallel "
                             f"{self.tp} x pipeline_parallel {self.pp} (world size must be a "
                             "multiple of TP * PP)")
        if world_size % (self.ep * self.pp):
            raise ValueError(f"a world of {world_size} ranks cannot hold expert_parallel "
                             f"{self.ep} x pipeline_parallel {self.pp} (world size must be a "
                             "multiple of EP * PP)")

    def sequence_parallel(self, shape: ModelShape) -> bool:
        return shape.is_moe and self.tp > 1


def transformer_config(shape: ModelShape, layout: Layout, *, cpu: bool):
    from megatron.core.transformer import TransformerConfig

    s, dtype = shape, layout.dtype
    moe = dict(num_moe_experts=s.num_experts, moe_router_topk=s.moe_top_k,
               moe_ffn_hidden_size=s.moe_ffn_hidden_size,
               moe_router_pre_softmax=not s.norm_topk_prob,
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
               moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
               moe_router_dtype="fp32", moe_permute_fusion=False,
               expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=1,
               ) if s.is_moe else {}
    config = TransformerConfig(
        num_layers=s.num_layers, hidden_size=s.hidden_size,
        num_attention_heads=s.num_heads, num_query_groups=s.num_kv_heads,
        kv_channels=s.head_dim, ffn_hidden_size=s.ffn_hidden_size or s.moe_ffn_hidden_size,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        sequence_parallel=layout.sequence_parallel(s),
        normalization="RMSNorm", layernorm_epsilon=s.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=s.qkv_bias, qk_layernorm=s.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=cpu,
        bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
        bf16=layout.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        attention_softmax_in_fp32=True, calculate_per_token_loss=True, **moe)
    # Tree-packed micro-batches differ in length: the pipeline stages exchange shapes.
    # Set after construction: the config refuses it whenever the MoE dispatcher is
    # "allgather", its default even for dense models, where no dispatcher runs.
    config.variable_seq_lengths = layout.pp > 1
    return config


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as a Megatron norm module that also works under sequence
    parallelism. Megatron's `WrappedTorchNorm` (the local spec's norm) refuses sequence
    parallelism only because it does not mark its weight: each TP rank then sees part of
    the sequence, so `finalize_model_grads` must sum the weight's gradient over TP,
    which it does for weights with `sequence_parallel` set (TE's and apex's norms set
    it the same way). Without Transformer Engine this is the only way to run MoE with
    TP > 1 (Megatron requires sequence parallelism there)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class HeadRMSNorm(torch.nn.RMSNorm):
    """The per-head q/k RMS norm (qwen3): it sees whole sequences of this TP rank's
    heads, so its gradient is summed over TP by name (`q_layernorm`/`k_layernorm`) in
    `finalize_model_grads`, never as a sequence-parallel one."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
        super().__init__(hidden_size, eps=eps)


def layer_spec(shape: ModelShape, num_layers: int):
    """Megatron's local GPT layer spec with `RMSNorm` / `HeadRMSNorm` as the norms and the
    tree-capable core attention (`tree.with_tree_attention`), as
    a block of `num_layers` layers (one pipeline stage) with a final `RMSNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from gyre_slurm.train.megatron.tree import with_tree_attention

    spec = with_tree_attention(get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None, moe_grouped_gemm=False,
        qk_layernorm=shape.qk_norm, normalization="RMSNorm"))
    sub = spec.submodules
    attn = sub.self_attention
    if shape.qk_norm:
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(
            attn.submodules, q_layernorm=HeadRMSNorm, k_layernorm=HeadRMSNorm))
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(
        sub, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm, self_attention=attn))
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=RMSNorm)


def build_core(shape: ModelShape, layout: Layout, *, device: torch.device):
    """The bare GPTModel of this rank's stage (parameters in the layout's dtype)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(shape, layout, cpu=device.type == "cpu")
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(shape, shape.num_layers // layout.pp),
        vocab_size=shape.padded_vocab_size, max_sequence_length=shape.max_positions,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        parallel_output=False, share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope", rotary_base=int(shape.rope_theta))
    return model.to(device=device, dtype=layout.dtype)


class _NoneForMissing(dict):
    def __missing__(self, key):
        return None


def _fix_distopt_step_load() -> None:
    """Megatron 0.19.2's DistributedOptimizer cannot load its own checkpoint with torch's
    AdamW (no Transformer Engine or Apex, which keep the step in the param groups):
    `load_state_dict` first sets each state's "step" tensor from the param groups, then
    `_set_main_param_and_optimizer_states` copies every tensor of that state from the
    loaded param state, which (rightly) holds no "step": KeyError 'step'. A missing key
    is now skipped, as the method already skips a non-tensor one; the step stays the
    one loaded from the param groups. Idempotent."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "gyre_fix", False):
        return

    def set_states(self, model_param, tensors):
        return original(self, model_param, _NoneForMissing(tensors))

    set_states.gyre_fix = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def wrap(core, layout: Layout, *, lr: float, grad_clip: float):
    """(ddp model, optimizer) around `core`, whose weights must already be loaded: DDP
    copies the parameters into its buffer and the optimizer its master weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    if layout.distributed_optimizer:
        _fix_distopt_step_load()
    config = core.config
    module = Float16Module(config, core) if layout.bf16 else core
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=layout.distributed_optimizer,
            check_for_nan_in_grad=False, bucket_size=None),
        module=module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, adam_beta1=0.9,
                        adam_beta2=0.999, adam_eps=1e-8, clip_grad=grad_clip,
                        bf16=layout.bf16, params_dtype=layout.dtype,
                        use_distributed_optimizer=layout.distributed_optimizer),
        [ddp], config_overrides={}, use_gloo_process_groups=False)
    return ddp, optimizer

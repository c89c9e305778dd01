"""How much accelerator memory each role needs, per rank and per node (pure arithmetic on a
`ModelShape` and a layout; no torch).

Training (Megatron, `train/megatron/build.py`), per rank, for the busiest pipeline stage:

- weights: this rank's parameters in the training dtype (2 bytes bf16, 4 fp32). Dense
  parameters are split over TP x PP (norms, the router and q/k norms are replicated over
  TP); the vocabulary (input embedding on the first stage, output layer on the last) over
  TP; experts over EP x PP, each expert whole (expert TP is 1).
- gradients: Megatron's DDP accumulates them in fp32 buffers (`grad_reduce_in_fp32`):
  4 bytes per parameter of the rank.
- optimizer: AdamW's two moments in fp32 (8 bytes), plus fp32 master weights (4 bytes)
  when the parameters are bf16. With the distributed optimizer these are sharded over the
  data-parallel ranks (dense parameters) and the expert-data-parallel ranks (experts).
  fp32 without it: 4 + 4 + 8 = 16 bytes per parameter on every replica.
- activations: an estimate for one micro-batch of `microbatch_tokens` tokens, no
  recomputation, a fused attention: 34 x tokens x hidden bytes per layer in 16 bits
  (Korthikanti et al. 2022, "Reducing Activation Recomputation", without the s^2 term of
  unfused attention), divided by TP, times 2 in fp32; with PP, 1F1B keeps up to PP
  micro-batches of a stage alive. The CPU backend's local attention also stores
  heads x seq^2 scores per layer: not counted.
- logits: the last stage gathers full-vocabulary fp32 logits (`parallel_output=False`)
  and the loss takes a log-softmax and its gradient: 3 x tokens x padded vocab x 4 bytes.

Rollout (vLLM), per GPU: the weights in bf16 split over the server's TP, and the KV cache
a token takes: 2 (K and V) x layers x KV heads x head_dim x 2 bytes, the KV heads split
over TP (replicated once TP exceeds them); the tokens that fit in `gpu_memory_utilization`
of the GPU after the weights (vLLM also reserves activation and CUDA-graph memory: a few
GB, not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_slurm.models.shape import ModelShape

GIB = 1 << 30


def expert_parallel_sizes(world_size: int, *, num_experts: int, tp: int = 1,
                          pp: int = 1) -> list[int]:
    """The expert-parallel sizes a world of `world_size` ranks allows for a model of
    `num_experts` experts (TP x PP replicas; EP groups of each stage's ranks, experts
    split evenly, expert TP 1), smallest first (train/layout.py re-exports it)."""
    if world_size % (tp * pp):
        return []
    stage = world_size // pp
    return [ep for ep in range(1, stage + 1) if stage % ep == 0 and num_experts % ep == 0]


@dataclass(frozen=True, kw_only=True)
class TrainLayout:
    """A training world: TP x PP x EP over `world_size` ranks."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    precision: str = "bf16"
    distributed_optimizer: bool = True
    microbatch_tokens: int = 4096

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.ep * self.pp)

    def check(self, shape: ModelShape) -> None:
        shape.check_layout(self.tp, self.pp, self.ep)
        if self.world_size % (self.tp * self.pp) or self.world_size % (self.ep * self.pp):
            raise ValueError(f"{self.world_size} ranks do not hold TP {self.tp} x PP "
                             f"{self.pp} (nor EP {self.ep} x PP {self.pp}): the world size "
                             "must be a multiple of both")


def stage_params(shape: ModelShape, layout: TrainLayout, *, first: bool,
                 last: bool) -> dict[str, int]:
    """Parameters of one rank of a stage: {"dense": ..., "expert": ...}."""
    h, d, tp = shape.hidden_size, shape.head_dim, layout.tp
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    attn = (h * (q + 2 * kv) + q * h) // tp
    attn += (q + 2 * kv) // tp if shape.qkv_bias else 0
    attn += 2 * d if shape.qk_norm else 0  # replicated
    layer = attn + 2 * h  # the two norms, replicated
    if shape.is_moe:
        layer += shape.num_experts * h  # the router, replicated
        expert = shape.num_experts // layout.ep * 3 * h * shape.moe_ffn_hidden_size
    else:
        layer += 3 * h * shape.ffn_hidden_size // tp
        expert = 0
    layers = shape.num_layers // layout.pp
    vocab = shape.padded_vocab_size * h // tp
    dense = layers * layer + (vocab if first else 0) + (vocab + h if last else 0)
    return {"dense": dense, "expert": layers * expert}


def train_rank_bytes(shape: ModelShape, layout: TrainLayout) -> dict[str, int]:
    """Bytes of the busiest rank (the first or last stage): weights, grads, optimizer,
    activations, logits and total."""
    layout.check(shape)
    stages = [(True, False), (False, True)] if layout.pp > 1 else [(True, True)]
    best: dict[str, int] = {}
    for first, last in stages:
        n = stage_params(shape, layout, first=first, last=last)
        out = _state_bytes(n, layout)
        out.update(_activation_bytes(shape, layout, last=last))
        out["total"] = sum(out.values())
        out["params"] = n["dense"] + n["expert"]
        if out["total"] > best.get("total", -1):
            best = out
    return best


def _state_bytes(n: dict[str, int], layout: TrainLayout) -> dict[str, int]:
    bf16 = layout.precision == "bf16"
    params = n["dense"] + n["expert"]
    per_param_optimizer = 12 if bf16 else 8  # (fp32 master +) two fp32 moments
    if layout.distributed_optimizer:
        optimizer = per_param_optimizer * (-(-n["dense"] // layout.dp)
                                           + -(-n["expert"] // layout.expert_dp))
    else:
        optimizer = per_param_optimizer * params
    return {"weights": (2 if bf16 else 4) * params, "grads": 4 * params,
            "optimizer": optimizer}


def _activation_bytes(shape: ModelShape, layout: TrainLayout, *, last: bool) -> dict[str, int]:
    tokens = layout.microbatch_tokens
    scale = 1 if layout.precision == "bf16" else 2
    per_layer = 34 * tokens * shape.hidden_size * scale // layout.tp
    in_flight = min(layout.pp, 2) if layout.pp > 1 else 1
    layers = shape.num_layers // layout.pp
    logits = 3 * tokens * shape.padded_vocab_size * 4 if last else 0
    return {"activations": per_layer * layers * in_flight, "logits": logits}


def kv_bytes_per_token(shape: ModelShape, tp: int) -> int:
    """KV-cache bytes one token takes on one GPU of a TP-`tp` server (bf16)."""
    kv_heads = max(1, -(-shape.num_kv_heads // tp))
    return 2 * shape.num_layers * kv_heads * shape.head_dim * 2


def rollout_gpu_bytes(shape: ModelShape, *, tp: int, gpu_bytes: int | None = None,
                      gpu_memory_utilization: float = 0.9) -> dict[str, int]:
    """Per GPU of a vLLM server: bf16 weights, KV bytes per token, and (given the GPU's
    memory) the KV-cache tokens that fit."""
    weights = 2 * shape.num_params()["total"] // tp
    out = {"weights": weights, "kv_per_token": kv_bytes_per_token(shape, tp)}
    if gpu_bytes:
        room = int(gpu_bytes * gpu_memory_utilization) - weights
        out["kv_tokens"] = max(0, room) // out["kv_per_token"]
    return out

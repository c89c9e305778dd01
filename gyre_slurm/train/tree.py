"""Tree-packed micro-batches in torch: tensors, the tree attention, and the loss.

A `TreeBatch` (`gyre_slurm.traj.treepack`) becomes `TreeInputs`: one sequence [1, N]
with per-token positions, and the tree mask "q attends k iff k <= q < subtree_end[k]".
Three kernels compute the same attention (`tree_attention`):

- on a GPU, FlexAttention (`torch.nn.attention.flex_attention`, compiled) with a
  block-sparse `BlockMask` made from that rule: blocks outside every query's ancestry
  (other runs, other branches) are skipped, and nothing of size N x N is built;
- elsewhere (CPU), path by path: each trajectory's queries from its first own node on
  (the nodes no earlier trajectory holds; every node is owned by exactly one) attend
  its whole path through scaled_dot_product_attention's causal kernel, on keys and
  values gathered along the path. Every node's projections and MLP are still computed
  once; attention costs what rows would (no padding), without an N x N mask.
  FlexAttention has no backward on CPU in torch 2.13 ("FlexAttention does not support
  backward on CPU", eager and compiled);
- "mask": SDPA with the rule as a dense boolean [N, N] mask, the plain reference
  (N^2 memory and SDPA's unfused path on CPU; tools/bench_tree.py --kernels times it
  against the others: docs/tree-training.md).

`tree_kernel()` says which one a device gets. The Hugging Face model (torch trainer)
runs with the attention implementation registered here (`ATTN_IMPLEMENTATION`): called
with `gyre_tree=TreeInputs` it computes `tree_attention`; without, transformers' SDPA
path with its causal mask, as rows always were. Megatron's core attention calls
`tree_attention` too (`train/megatron/tree.py`).

The loss: the logits at `parent[target]` predict each entry's token, and the entries
go through `loss.policy_loss_tokens` as a flat list of trained tokens with their
trajectory as sequence id (so sequence-level variants see each trajectory's tokens),
summed (see the shared-token rule in `treepack`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gyre_slurm.train.loss import DEFAULT_SETTINGS, LossSettings, policy_loss_tokens
from gyre_slurm.train.signals import microbatch_signals
from gyre_slurm.traj.treepack import TreeBatch

ATTN_IMPLEMENTATION = "gyre_tree"
FLEX_BLOCK_SIZE = 128


def tree_kernel(device: torch.device | str) -> str:
    """"flex" on CUDA devices, "paths" elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "paths"


@dataclass(eq=False)
class TreeInputs:
    token_ids: torch.Tensor  # long [1, N]
    position_ids: torch.Tensor  # long [1, N]
    subtree_end: torch.Tensor  # long [N]
    src: torch.Tensor  # long [E]: the packed position whose logits predict the entry
    target_ids: torch.Tensor  # long [E]: the entry's token
    logprobs: torch.Tensor  # float32 [E]
    advantages: torch.Tensor  # float32 [E]
    versions: torch.Tensor  # long [E]
    seq_ids: torch.Tensor  # long [E]
    paths: list[tuple[torch.Tensor, int]]  # per trajectory owning nodes: (its packed
    #   indices, its first own position along them)
    kernel: str  # "flex" | "paths"
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[1])

    @property
    def num_entries(self) -> int:
        return int(self.src.shape[0])

    def owned(self) -> torch.Tensor:
        """The packed indices the paths own, in `paths` order (each node exactly once)."""
        if "owned" not in self._cache:
            self._cache["owned"] = torch.cat([idx[own:] for idx, own in self.paths])
        return self._cache["owned"]

    def dense_mask(self) -> torch.Tensor:
        """The tree rule as a boolean [N, N] mask (True: attend); N^2 bytes, for the
        "mask" kernel (a reference: small batches and benchmarks)."""
        if "dense" not in self._cache:
            n = self.num_tokens
            qi = torch.arange(n, device=self.subtree_end.device)[:, None]
            ki = qi.T
            self._cache["dense"] = (ki <= qi) & (qi < self.subtree_end[None, :])
        return self._cache["dense"]

    def block_mask(self):
        """The FlexAttention BlockMask of the tree rule (built once per batch)."""
        if "block" not in self._cache:
            self._cache["block"] = tree_block_mask(self.subtree_end)
        return self._cache["block"]

    def hf_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the Hugging Face model's forward for this batch (its
        attention implementation must be `ATTN_IMPLEMENTATION`)."""
        return {"input_ids": self.token_ids, "position_ids": self.position_ids,
                "gyre_tree": self, "use_cache": False}


def to_inputs(batch: TreeBatch, device: torch.device | str = "cpu", *,
              kernel: str | None = None) -> TreeInputs:
    if (batch.parent[batch.target] < 0).any():
        raise ValueError("a trained token without a predecessor (the first token of a "
                         "run's tree) has no prediction")

    def t(a: np.ndarray, dtype=torch.long) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    cu = batch.cu_paths
    paths = [(t(batch.path_index[cu[j]:cu[j + 1]]), int(batch.own_start[j]))
             for j in range(batch.num_trajectories)
             if batch.own_start[j] < cu[j + 1] - cu[j]]

    return TreeInputs(
        token_ids=t(batch.token_ids)[None], position_ids=t(batch.position_ids)[None],
        subtree_end=t(batch.subtree_end), src=t(batch.parent[batch.target]),
        target_ids=t(batch.token_ids[batch.target]),
        logprobs=t(batch.logprobs, torch.float32),
        advantages=t(batch.advantages, torch.float32), versions=t(batch.versions),
        seq_ids=t(batch.seq_ids), paths=paths, kernel=kernel or tree_kernel(device))


def tree_block_mask(subtree_end: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        return (k <= q) & (q < subtree_end[k])

    n = int(subtree_end.shape[0])
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n,
                             device=subtree_end.device, BLOCK_SIZE=FLEX_BLOCK_SIZE,
                             _compile=subtree_end.is_cuda)


_compiled_flex = None


def _flex(q, k, v, *, block_mask, scale):
    """FlexAttention, compiled on CUDA (the fused kernel); eager elsewhere (forward only,
    for checks: it materialises the scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block_mask, scale=scale,
              enable_gqa=q.shape[1] != k.shape[1])


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: TreeInputs, *,
                   scale: float | None = None, kernel: str | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + tree mask) v for q [B, H, N, D], k/v [B, Hkv, N, D]
    (grouped-query attention when Hkv < H); returns [B, H, N, D]."""
    kernel = kernel or tree.kernel
    gqa = q.shape[1] != k.shape[1]
    if kernel == "flex":
        return _flex(q, k, v, block_mask=tree.block_mask(), scale=scale)
    if kernel == "mask":
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=tree.dense_mask(), scale=scale, enable_gqa=gqa)
    if kernel != "paths":
        raise ValueError(f"tree attention kernel {kernel!r}: choose flex, paths or mask")
    pieces = []
    for idx, own in tree.paths:
        out = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True, scale=scale,
            enable_gqa=gqa)
        pieces.append(out[:, :, own:])
    owned = torch.cat(pieces, dim=2)
    return torch.zeros_like(q).index_copy(2, tree.owned(), owned)


def entry_logprobs(logits: torch.Tensor, tree: TreeInputs) -> torch.Tensor:
    """[E] logprob of each entry's token under the logits of its predecessor; `logits`
    [1, N, V] or [N, V] (float32 math, float64 kept)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = logits.reshape(-1, logits.shape[-1])[tree.src].to(dtype)
    picked = rows.gather(-1, tree.target_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(rows, dim=-1)


def tree_policy_loss(logits: torch.Tensor, tree: TreeInputs, *, num_step_tokens: int,
                     settings: LossSettings = DEFAULT_SETTINGS
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """The step-normalised loss of a tree-packed micro-batch: `loss.policy_loss_tokens`
    over its entries (each trajectory a sequence), the same as the trajectories'
    rows give, each node computed once."""
    return policy_loss_tokens(entry_logprobs(logits, tree), tree.logprobs, tree.advantages,
                              torch.ones_like(tree.logprobs, dtype=torch.bool),
                              num_step_tokens=num_step_tokens, settings=settings,
                              seq_ids=tree.seq_ids)


@torch.no_grad()
def entry_entropy(logits: torch.Tensor, tree: TreeInputs) -> torch.Tensor:
    """[E] entropy of the distribution that predicted each entry's token."""
    rows = logits.reshape(-1, logits.shape[-1])[tree.src].double()
    return torch.logsumexp(rows, -1) - (torch.softmax(rows, -1) * rows).sum(-1)


def tree_loss_and_signals(logits: torch.Tensor, tree: TreeInputs, *, settings: LossSettings,
                          num_step_tokens: int,
                          trainer_version: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """`signals.loss_and_signals` for a tree-packed micro-batch: the loss and the same
    sums (mismatch, entropy, lags), over its entries."""
    logp = entry_logprobs(logits, tree)
    mask = torch.ones_like(tree.logprobs, dtype=torch.bool)
    loss, stats = policy_loss_tokens(logp, tree.logprobs, tree.advantages, mask,
                                     num_step_tokens=num_step_tokens, settings=settings,
                                     seq_ids=tree.seq_ids)
    signals = microbatch_signals(logp=logp, old_logprobs=tree.logprobs, loss_mask=mask,
                                 lags=trainer_version - tree.versions,
                                 entropy=entry_entropy(logits, tree), loss_stats=stats)
    return loss, signals


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
    """transformers' attention function for `ATTN_IMPLEMENTATION`: the tree attention
    given `gyre_tree`, else its SDPA path (q/k/v [B, heads, S, d]; returns [B, S,
    heads, d] and no weights, as transformers' functions do)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tree = kwargs.pop("gyre_tree", None)
    if tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError("tree attention has no dropout (attention_dropout must be 0)")
    out = tree_attention(query, key, value, tree, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _causal_or_tree_mask(*args, **kwargs):
    """The mask transformers builds for `ATTN_IMPLEMENTATION`: none. Rows (right-padded,
    no padding mask, as the trainer always fed them) are causal through SDPA's
    is_causal; tree batches carry their own mask."""
    return None


def register_hf_attention() -> str:
    """Register `ATTN_IMPLEMENTATION` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _causal_or_tree_mask)
    return ATTN_IMPLEMENTATION

"""Tree-packed micro-batches in Megatron-core: the core attention and the rotary positions.

The Megatron trainer passes a tree-packed sequence to `GPTModel` with a `TreeInputs`
(`gyre_slurm.train.tree`) as its `attention_mask`; Megatron hands the mask unchanged to
each layer's core attention. `TreeDotProductAttention` is Megatron's local
`DotProductAttention` (the local layer spec's core attention) that, given a
`TreeInputs`, computes the tree attention with `train.tree.tree_attention` (FlexAttention
with a block mask on a GPU, SDPA's causal kernel path by path on CPU; grouped-query heads
as they come) and otherwise behaves exactly as Megatron's (rows: causal). It has no
parameters, so checkpoints and weight conversion are unchanged. The same substitution
of the core attention in the layer spec is how one brings an arbitrary-mask kernel to
Megatron: its own DotProductAttention, and Transformer Engine's "arbitrary" mask type,
take a dense [b, 1, N, N] mask, which at 100k tokens is 10 GB per micro-batch.

Rotary positions: `GPTModel` computes RoPE for positions 0..S-1 of the sequence;
`TreePositions` makes its rotary module return the embedding of each token's own
position (its depth in its tree) while a tree batch runs.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from gyre_slurm.train.megatron import cpu_shim

cpu_shim.import_megatron()  # on CPU: before anything imports Megatron (see there)
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402

from gyre_slurm.train.loss import rows_from_trajectories  # noqa: E402
from gyre_slurm.train.tree import TreeInputs, to_inputs, tree_attention  # noqa: E402
from gyre_slurm.traj import treepack  # noqa: E402


class TreeDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if not isinstance(attention_mask, TreeInputs):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("tree attention takes no attention bias or packed-sequence "
                             "parameters (the tree mask separates sequences)")
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = tree_attention(q, k, v, attention_mask, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def with_tree_attention(layer_spec):
    """The local layer spec (a ModuleSpec of TransformerLayer) with the tree-capable core
    attention; the spec is changed in place and returned."""
    attention = layer_spec.submodules.self_attention
    if attention.submodules.core_attention is not DotProductAttention:
        raise TypeError(f"tree attention replaces Megatron's local DotProductAttention; "
                        f"this spec has {attention.submodules.core_attention!r}")
    attention.submodules.core_attention = TreeDotProductAttention
    return layer_spec


class TreePositions:
    """Per-token rotary positions for a GPTModel (built with RoPE)."""

    def __init__(self, model):
        self.positions: torch.Tensor | None = None
        rope = getattr(model, "rotary_pos_emb", None)
        if rope is None:
            raise TypeError("tree positions need a GPTModel built with rotary embeddings")
        inner = rope.forward

        def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
            pos = self.positions
            if pos is None:
                return inner(max_seq_len, offset, packed_seq, cp_group)
            emb = inner(int(pos.max()) + 1, offset, packed_seq, cp_group)  # [P, 1, 1, d]
            return emb[pos.reshape(-1)]

        rope.forward = forward

    @contextmanager
    def use(self, position_ids: torch.Tensor):
        """While inside, the model's RoPE follows `position_ids` [1, N]."""
        if position_ids.shape[0] != 1:
            raise ValueError("tree batches hold one packed sequence (batch size 1)")
        self.positions = position_ids
        try:
            yield
        finally:
            self.positions = None


def schedule_batches(trajs: list, packing: str, *, pipelined: bool, pad_id: int,
                     device) -> tuple[list[dict], int, int]:
    """Megatron micro-batches of a replica's shard: (batches, seq_length,
    micro_batch_size). Rows: right-padded rows, one per micro-batch when pipelining,
    else all in one (each with its computed and padding token counts, `fed`, `pad`).
    Tree: one packed sequence of all the runs ({"tree": TreeInputs}), or one per run when
    pipelining (lengths differ: the config's `variable_seq_lengths`)."""
    trajs = [t.to_json() if hasattr(t, "to_json") else t for t in trajs]
    if packing == "tree":
        groups = list(treepack.group_runs(trajs).values()) if pipelined else \
            [list(range(len(trajs)))]
        batches = [{"tree": to_inputs(treepack.pack_trees([trajs[i] for i in g]), device)}
                   for g in groups]
        return batches, max(b["tree"].num_tokens for b in batches), 1
    rows = rows_from_trajectories(trajs, pad_id=pad_id, device=device)
    n = rows["token_ids"].shape[0]
    size = 1 if pipelined else n
    batches = []
    for i in range(0, n, size):
        b = {k: v[i:i + size] for k, v in rows.items()}
        b["fed"] = b["token_ids"].numel()
        b["pad"] = b["fed"] - sum(len(t["token_ids"]) for t in trajs[i:i + size])
        batches.append(b)
    return batches, rows["token_ids"].shape[1], size


def pad_tree(tree: TreeInputs, extra: int, *, pad_id: int) -> TreeInputs:
    """`tree` with `extra` padding tokens appended (sequence parallelism needs a length
    divisible by TP): isolated nodes at position 0, each attending only itself
    (`subtree_end` = its own index + 1); no path owns them (the paths kernel leaves
    their attention zero), no entry reads their logits and no real token attends to
    them, so they change nothing but the work."""
    if extra <= 0:
        return tree
    n, device = tree.num_tokens, tree.token_ids.device
    fill = torch.full((1, extra), pad_id, dtype=tree.token_ids.dtype, device=device)
    return dataclasses.replace(
        tree, token_ids=torch.cat([tree.token_ids, fill], dim=1),
        position_ids=torch.cat([tree.position_ids, torch.zeros_like(fill)], dim=1),
        subtree_end=torch.cat([tree.subtree_end,
                               torch.arange(n + 1, n + extra + 1, device=device)]),
        _cache={})

"""Packing trajectories into micro-batches by a token budget, and deduplication stats.

Packing is padding-free (varlen attention): a micro-batch concatenates whole
trajectories, at most `max_tokens` tokens in all, and says where each starts
(`cu_seqlens`, as flash-attention's varlen kernels take it) with positions restarting
at 0 per trajectory. Per token it carries the loss mask, the sampling logprob, the policy
version and the trajectory's advantage, all aligned with `token_ids`. Trajectories are
placed first-fit decreasing by length (ties: input order); one longer than the budget is
an error, never cut (a cut would train tokens without their prefix).

Dedup stats compare the processor with a naive per-call split, which would feed every
call's prompt + output as its own sequence and train every output token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from gyre_slurm.errors import UserError
from gyre_slurm.traj.delta import CallDelta
from gyre_slurm.traj.select import Trajectory
from gyre_slurm.traj.tree import PrefixTree


@dataclass(frozen=True, eq=False)
class MicroBatch:
    token_ids: np.ndarray  # int32 [num_tokens]
    loss_mask: np.ndarray  # uint8
    logprobs: np.ndarray  # float32
    versions: np.ndarray  # int64, -1 where mask is 0
    advantages: np.ndarray  # float32, the trajectory's advantage on each of its tokens
    position_ids: np.ndarray  # int64, restarting at 0 per trajectory
    cu_seqlens: np.ndarray  # int64 [num_trajectories + 1]
    run_ids: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _batch(trajs: Sequence[Trajectory]) -> MicroBatch:
    lens = np.array([len(t) for t in trajs], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lens)
    return MicroBatch(
        np.concatenate([t.token_ids for t in trajs]),
        np.concatenate([t.loss_mask for t in trajs]),
        np.concatenate([t.logprobs for t in trajs]),
        np.concatenate([t.versions for t in trajs]),
        np.repeat(np.array([t.advantage for t in trajs], dtype=np.float32), lens),
        positions, cu, tuple(t.run_id for t in trajs))


def pack(trajs: Sequence[Trajectory], *, max_tokens: int) -> list[MicroBatch]:
    """Micro-batches of at most `max_tokens` tokens (first-fit decreasing)."""
    if max_tokens < 1:
        raise UserError("the micro-batch token budget must be >= 1")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(trajs)), key=lambda i: -len(trajs[i])):
        n = len(trajs[i])
        if n > max_tokens:
            raise UserError(f"run {trajs[i].run_id!r}: a trajectory of {n} tokens does not "
                            f"fit the micro-batch budget of {max_tokens} tokens")
        j = next((j for j, r in enumerate(room) if r >= n), len(bins))
        if j == len(bins):
            bins.append([])
            room.append(max_tokens)
        bins[j].append(i)
        room[j] -= n
    return [_batch([trajs[i] for i in sorted(b)]) for b in bins]


@dataclass(frozen=True)
class DedupStats:
    num_calls: int = 0
    naive_tokens: int = 0  # sum over calls of prompt + output tokens
    naive_trained: int = 0  # sum over calls of output tokens
    tree_tokens: int = 0  # distinct tokens (tree nodes)
    trainable_tokens: int = 0  # distinct trainable tokens
    traj_tokens: int = 0  # tokens fed, over the selected trajectories
    trained_tokens: int = 0  # tokens with loss mask 1

    def __add__(self, other: DedupStats) -> DedupStats:
        return DedupStats(*(getattr(self, f.name) + getattr(other, f.name)
                            for f in fields(self)))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["fed_vs_naive"] = round(self.traj_tokens / self.naive_tokens, 6) \
            if self.naive_tokens else None
        out["trained_vs_naive"] = round(self.trained_tokens / self.naive_trained, 6) \
            if self.naive_trained else None
        out["coverage"] = round(self.trained_tokens / self.trainable_tokens, 6) \
            if self.trainable_tokens else None
        return out


def dedup_stats(deltas: Sequence[CallDelta], tree: PrefixTree,
                trajs: Sequence[Trajectory]) -> DedupStats:
    return DedupStats(
        num_calls=len(deltas),
        naive_tokens=sum(d.seq_len for d in deltas),
        naive_trained=sum(len(d.output_ids) for d in deltas),
        tree_tokens=tree.num_tokens,
        trainable_tokens=tree.num_trainable,
        traj_tokens=sum(len(t) for t in trajs),
        trained_tokens=sum(t.num_trained for t in trajs),
    )


def packing_stats(batches: Sequence[MicroBatch], *, max_tokens: int) -> dict[str, Any]:
    used = sum(b.num_tokens for b in batches)
    return {"num_micro_batches": len(batches), "max_tokens": max_tokens,
            "num_tokens": used,
            "fill": round(used / (max_tokens * len(batches)), 6) if batches else None}

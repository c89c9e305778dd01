"""Choosing at most K root-to-leaf paths of a run's tree, and turning them into
trajectories under the shared-prefix rule.

Selection is greedy max-coverage: each round takes the leaf whose path holds the most
trainable tokens not yet covered by an earlier pick (ties: the leaf created first, i.e.
by the earliest call), and stops after K picks or when no leaf adds a trainable token.
Gains are one pass over the edges in topological order per round: O(K x edges).
Greedy max-coverage is within 1 - 1/e of the best K paths; with K >= the number of
leaves it covers every trainable token.

Shared-prefix rule: a trainable token has loss weight in exactly one selected trajectory,
the first pick whose path holds it; in every other trajectory it is context (mask 0).
Trajectory fields: `token_ids` (the path), `loss_mask` (1 where this trajectory trains
the token), `logprobs` (sampling logprob where mask is 1, else 0.0), `versions` (policy
version where mask is 1, else -1), `policy_version` (the minimum over the mask-1 tokens)
and `advantage` (given by the caller; see `process.group_advantages`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre_slurm.traj.records import f32_list
from gyre_slurm.traj.tree import PrefixTree


@dataclass(frozen=True)
class Selection:
    """Chosen leaves, in pick order, and for each the trainable edges it owns."""

    run_id: str
    leaves: tuple[int, ...]
    owned: tuple[tuple[int, ...], ...]
    num_trainable: int  # in the whole tree
    num_covered: int  # owned by some chosen leaf


@dataclass(frozen=True, eq=False)
class Trajectory:
    run_id: str
    token_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    logprobs: np.ndarray  # float32
    versions: np.ndarray  # int64
    policy_version: int
    advantage: float
    leaf: int  # the tree edge it ends at

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_trained(self) -> int:
        return int(self.loss_mask.sum())

    def to_dict(self) -> dict[str, Any]:
        """`to_json`'s fields with the arrays as they are (numpy): how the coordinator's
        book holds a trajectory until a micro-batch file takes it
        (`gyre_slurm.traj.mbfile`), about 5x less memory than lists of Python numbers
        (`tools/bench_microbatch_io.py`)."""
        return {"run_id": self.run_id, "token_ids": self.token_ids,
                "loss_mask": self.loss_mask, "logprobs": self.logprobs,
                "versions": self.versions, "policy_version": self.policy_version,
                "advantage": self.advantage}

    def to_json(self) -> dict[str, Any]:
        """The trajectory line (docs/runtime.md), with `versions` (the policy version of each
        trained token, -1 elsewhere: the trainer measures staleness with it)."""
        return {
            "run_id": self.run_id, "token_ids": self.token_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(), "logprobs": f32_list(self.logprobs),
            "versions": self.versions.tolist(),
            "policy_version": self.policy_version, "advantage": self.advantage,
        }


def _gains(tree: PrefixTree, order: list[int], weight: np.ndarray) -> np.ndarray:
    gain = np.zeros(tree.num_edges, dtype=np.int64)
    parent = tree.parent.tolist()
    w = weight.tolist()
    g = gain.tolist()
    for e in order[1:]:
        g[e] = g[parent[e]] + w[e]
    return np.asarray(g, dtype=np.int64)


def select_paths(tree: PrefixTree, *, max_paths: int) -> Selection:
    """Greedy max-coverage choice of at most `max_paths` leaves."""
    if max_paths < 1:
        raise ValueError("max_paths must be >= 1")
    weight = np.array([len(t) if lp is not None else 0
                       for t, lp in zip(tree.tokens, tree.logprobs)], dtype=np.int64)
    num_trainable = int(weight.sum())
    order = tree.topo_order()
    leaves = np.array(tree.leaves, dtype=np.int64)
    picked: list[int] = []
    owned: list[tuple[int, ...]] = []
    while len(picked) < max_paths and leaves.size:
        gain = _gains(tree, order, weight)[leaves]
        best = int(np.argmax(gain))  # first maximum: the earliest-created leaf
        if gain[best] <= 0:
            break
        leaf = int(leaves[best])
        mine = tuple(e for e in tree.path(leaf) if weight[e] > 0)
        weight[list(mine)] = 0
        picked.append(leaf)
        owned.append(mine)
    return Selection(tree.run_id, tuple(picked), tuple(owned), num_trainable,
                     num_trainable - int(weight.sum()))


def materialize(tree: PrefixTree, selection: Selection, *,
                advantage: float = 0.0) -> list[Trajectory]:
    """The selected paths as trajectories (token arrays are built here)."""
    out = []
    for leaf, mine in zip(selection.leaves, selection.owned):
        path = tree.path(leaf)
        mine_set = set(mine)
        ids = np.concatenate([tree.tokens[e] for e in path]).astype(np.int32, copy=False)
        mask = np.zeros(len(ids), dtype=np.uint8)
        logprobs = np.zeros(len(ids), dtype=np.float32)
        versions = np.full(len(ids), -1, dtype=np.int64)
        pos = 0
        for e in path:
            n = len(tree.tokens[e])
            if e in mine_set:
                mask[pos:pos + n] = 1
                logprobs[pos:pos + n] = tree.logprobs[e]
                versions[pos:pos + n] = tree.version[e]
            pos += n
        version = int(min(tree.version[e] for e in mine)) if mine else -1
        out.append(Trajectory(tree.run_id, ids, mask, logprobs, versions, version,
                              float(advantage), leaf))
    return out

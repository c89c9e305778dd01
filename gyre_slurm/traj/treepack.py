"""Tree packing: a run's trajectories as one sequence holding each prefix-tree node once.

The trajectories of one run are root-to-leaf paths of its prefix tree, so they share
prefixes. Rows packing feeds every trajectory whole (the shared prefix is computed once
per trajectory); tree packing rebuilds the union of the paths (a trie over token ids:
equal prefixes are equal nodes) and lays its nodes out once, in depth-first pre-order,
so a node's subtree is the contiguous stretch after it. Per packed token:

- `position_ids`: its depth (its position in every trajectory that holds it);
- `parent`: the packed index of the token before it on its path (-1 at a root), whose
  logits predict it;
- `subtree_end`: one past the last packed index of its subtree. The tree attention
  mask follows: query q may attend key k iff k <= q < subtree_end[k] (k is q or one of
  its ancestors), i.e. each token sees exactly its own trajectory prefix. Runs are laid
  out one after the other and a run's subtrees never leave it, so runs never attend
  across each other; no padding is needed (`cu_runs` holds the run boundaries).

Loss entries (the shared-token rule): the loss is a sum over trajectories of their
trained tokens' terms. Each (trajectory, trained token) pair becomes one entry pointing
at the token's packed node (`target`), with that trajectory's old logprob, advantage,
version and index (`seq_ids`). A node's logits are computed once; every entry at it
adds its own term, so a node trained by two trajectories gets the sum of both terms'
gradients, exactly as the trajectories trained one by one would. Under the processor's
shared-prefix rule a token is trained in exactly one trajectory, so there is one entry
per trained node and its advantage is that trajectory's.

Pure numpy; the trainers turn a `TreeBatch` into tensors (`gyre_slurm.train.tree`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre_slurm.errors import UserError
from gyre_slurm.traj.delta import common_prefix_len as common_prefix

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """Tree-packed runs: N packed tokens, E loss entries."""

    token_ids: np.ndarray  # int64 [N]
    position_ids: np.ndarray  # int64 [N]: depth in its run's tree
    parent: np.ndarray  # int64 [N]: packed index of the predecessor, -1 at a root
    subtree_end: np.ndarray  # int64 [N]: q attends k iff k <= q < subtree_end[k]
    cu_runs: np.ndarray  # int64 [R + 1]: run r holds packed tokens cu_runs[r]:cu_runs[r+1]
    run_ids: tuple[str, ...]  # [R]
    target: np.ndarray  # int64 [E]: packed index of the trained token
    logprobs: np.ndarray  # float32 [E]: sampling logprob (the trajectory's)
    advantages: np.ndarray  # float32 [E]: the trajectory's advantage
    versions: np.ndarray  # int64 [E]: policy version of the token (-1: unknown)
    seq_ids: np.ndarray  # int64 [E]: index of the trajectory in the packed input
    path_index: np.ndarray  # int64 [sum of lengths]: each trajectory's packed indices
    cu_paths: np.ndarray  # int64 [T + 1]: trajectory j is path_index[cu_paths[j]:cu_paths[j+1]]
    own_start: np.ndarray  # int64 [T]: trajectory j's first own node (the first it is the
    #   first trajectory to hold): from there on its path is nodes no earlier one has
    rows_tokens: int  # tokens of the trajectories fed whole (rows packing, no padding)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_entries(self) -> int:
        return len(self.target)

    @property
    def num_trajectories(self) -> int:
        return len(self.own_start)

    @property
    def traj_end(self) -> np.ndarray:
        """[T] packed index of each trajectory's last token."""
        return self.path_index[self.cu_paths[1:] - 1]

    def path(self, j: int) -> np.ndarray:
        return self.path_index[self.cu_paths[j]:self.cu_paths[j + 1]]


@dataclass
class _Edge:
    owner: int  # index (within the run) of a trajectory holding these tokens
    start: int  # depth of the first token
    end: int  # depth one past the last token
    parent: int  # edge index, -1: a root edge
    children: list[int]


def _fields(t: Any) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """(run_id, token_ids, loss_mask, logprobs, versions, advantage) of a trajectory
    dict (docs/runtime.md) or a `select.Trajectory`."""
    if isinstance(t, dict):
        ids = np.asarray(t["token_ids"], dtype=np.int64)
        mask = np.asarray(t["loss_mask"], dtype=np.uint8)
        logp = np.asarray(t["logprobs"], dtype=np.float32)
        ver = np.asarray(t["versions"], dtype=np.int64) if "versions" in t else \
            np.where(mask == 1, int(t.get("policy_version", -1)), -1)
        run_id, adv = str(t["run_id"]), float(t["advantage"])
    else:
        ids = np.asarray(t.token_ids, dtype=np.int64)
        mask, logp = np.asarray(t.loss_mask, np.uint8), np.asarray(t.logprobs, np.float32)
        ver, run_id, adv = np.asarray(t.versions, np.int64), t.run_id, float(t.advantage)
    if not len(ids) == len(mask) == len(logp) == len(ver):
        raise UserError(f"run {run_id!r}: token_ids, loss_mask, logprobs and versions "
                        f"differ in length ({len(ids)}, {len(mask)}, {len(logp)}, "
                        f"{len(ver)})")
    if len(ids) == 0:
        raise UserError(f"run {run_id!r}: a trajectory without tokens")
    if mask[0]:
        raise UserError(f"run {run_id!r}: the first token of a trajectory has no "
                        "prediction: its loss_mask must be 0")
    return run_id, ids, mask, logp, ver, adv


def _trie(paths: Sequence[np.ndarray]) -> tuple[list[_Edge], list[list[int]], list[int]]:
    """The compressed trie of a run's paths: its edges, per path its edges in order, and
    per path how many of its tokens earlier paths hold. Path j shares its longest common
    prefix with an earlier path (the first such on ties) and hangs the rest below it,
    splitting an edge where it branches off."""
    edges: list[_Edge] = []
    on_path: list[list[int]] = []
    shared: list[int] = []
    for j, ids in enumerate(paths):
        best, best_i = 0, -1
        for i in range(j):
            m = common_prefix(ids, paths[i])
            if m > best:
                best, best_i = m, i
        mine: list[int] = []
        if best_i >= 0:
            for e in on_path[best_i]:
                if edges[e].end <= best:
                    mine.append(e)
                    continue
                if edges[e].start < best:
                    mine.append(_split(edges, on_path, e, best))
                break
        if best < len(ids):
            parent = mine[-1] if mine else -1
            edges.append(_Edge(j, best, len(ids), parent, []))
            if parent >= 0:
                edges[parent].children.append(len(edges) - 1)
            mine.append(len(edges) - 1)
        on_path.append(mine)
        shared.append(best)
    return edges, on_path, shared


def _split(edges: list[_Edge], on_path: list[list[int]], e: int, depth: int) -> int:
    """Cut edge e at `depth`: a new head edge takes [start, depth) and e keeps the rest
    below it; every path through e goes through the head first. Returns the head."""
    old = edges[e]
    head = len(edges)
    edges.append(_Edge(old.owner, old.start, depth, old.parent, [e]))
    if old.parent >= 0:
        kids = edges[old.parent].children
        kids[kids.index(e)] = head
    old.start, old.parent = depth, head
    for path in on_path:
        if e in path:
            path.insert(path.index(e), head)
    return head


def _preorder(edges: list[_Edge]) -> list[int]:
    order: list[int] = []
    stack = [e for e in range(len(edges)) if edges[e].parent < 0][::-1]
    while stack:
        e = stack.pop()
        order.append(e)
        stack.extend(edges[e].children[::-1])
    return order


def _layout(edges: list[_Edge], paths: Sequence[np.ndarray], base: int):
    """Packed arrays of one run's trie, its first token at packed index `base`; returns
    (token_ids, position_ids, parent, subtree_end, offset of each edge)."""
    order = _preorder(edges)
    offset = np.zeros(len(edges), dtype=np.int64)
    pos = base
    for e in order:
        offset[e] = pos
        pos += edges[e].end - edges[e].start
    size = np.array([edges[e].end - edges[e].start for e in range(len(edges))], np.int64)
    for e in reversed(order):  # descendants first: subtree sizes in tokens
        size[e] += sum(int(size[c]) for c in edges[e].children)
    ids, positions, parent, end = [], [], [], []
    for e in order:
        ed = edges[e]
        n = ed.end - ed.start
        ids.append(paths[ed.owner][ed.start:ed.end])
        positions.append(np.arange(ed.start, ed.end, dtype=np.int64))
        first = -1 if ed.parent < 0 else \
            int(offset[ed.parent]) + edges[ed.parent].end - edges[ed.parent].start - 1
        parent.append(np.concatenate([[first], offset[e] + np.arange(n - 1, dtype=np.int64)]))
        end.append(np.full(n, offset[e] + size[e], dtype=np.int64))
    cat = np.concatenate
    return cat(ids), cat(positions), cat(parent), cat(end), offset


def group_runs(trajs: Sequence[Any]) -> dict[str, list[int]]:
    """Trajectory indices per run, runs in order of first appearance."""
    runs: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        rid = str(t["run_id"] if isinstance(t, dict) else t.run_id)
        runs.setdefault(rid, []).append(i)
    return runs


def run_tree_tokens(paths: Sequence[np.ndarray]) -> int:
    """Distinct tokens (trie nodes) of one run's paths: what tree packing feeds."""
    total = 0
    for j, ids in enumerate(paths):
        total += len(ids) - max((common_prefix(ids, paths[i]) for i in range(j)), default=0)
    return total


def tree_tokens(trajs: Sequence[Any]) -> int:
    """Packed tokens of `pack_trees(trajs)`, without building it."""
    out = 0
    for idx in group_runs(trajs).values():
        out += run_tree_tokens([np.asarray(_ids(trajs[i]), dtype=np.int64) for i in idx])
    return out


def _ids(t: Any):
    return t["token_ids"] if isinstance(t, dict) else t.token_ids


def pack_trees(trajs: Sequence[Any]) -> TreeBatch:
    """Tree-pack trajectories (dicts or `Trajectory`s): each run's trajectories (by
    run_id, runs in order of first appearance) become one trie laid out once."""
    if not trajs:
        raise UserError("no trajectories to pack")
    fields = [_fields(t) for t in trajs]
    cols: dict[str, list[np.ndarray]] = {k: [] for k in (
        "ids", "pos", "parent", "end", "target", "logp", "adv", "ver", "seq")}
    where_of: list[np.ndarray] = [EMPTY] * len(trajs)
    own_start = np.zeros(len(trajs), dtype=np.int64)
    cu, base = [0], 0
    runs = group_runs(trajs)
    for idx in runs.values():
        paths = [fields[i][1] for i in idx]
        edges, on_path, shared = _trie(paths)
        ids, pos, parent, end, offset = _layout(edges, paths, base)
        for k, v in zip(("ids", "pos", "parent", "end"), (ids, pos, parent, end)):
            cols[k].append(v)
        for j, i in enumerate(idx):
            _, _, mask, logp, ver, adv = fields[i]
            where = np.concatenate([offset[e] + np.arange(edges[e].end - edges[e].start)
                                    for e in on_path[j]])
            trained = np.flatnonzero(mask)
            where_of[i], own_start[i] = where, shared[j]
            cols["target"].append(where[trained])
            cols["logp"].append(logp[trained])
            cols["adv"].append(np.full(len(trained), adv, dtype=np.float32))
            cols["ver"].append(ver[trained])
            cols["seq"].append(np.full(len(trained), i, dtype=np.int64))
        base += len(ids)
        cu.append(base)
    c = {k: np.concatenate(v) for k, v in cols.items()}
    return TreeBatch(
        c["ids"], c["pos"], c["parent"], c["end"], np.array(cu, dtype=np.int64),
        tuple(runs), c["target"].astype(np.int64), c["logp"].astype(np.float32),
        c["adv"].astype(np.float32), c["ver"].astype(np.int64), c["seq"],
        np.concatenate(where_of).astype(np.int64),
        np.concatenate([[0], np.cumsum([len(w) for w in where_of])]).astype(np.int64),
        own_start, sum(len(f[1]) for f in fields))


def ancestors(batch: TreeBatch, q: int) -> np.ndarray:
    """Packed indices token q attends to (itself and its ancestors), by the mask rule."""
    k = np.arange(q + 1)
    return k[batch.subtree_end[k] > q]


PACKINGS = ("tree", "rows")


def check_packing(packing: str) -> str:
    if packing not in PACKINGS:
        raise ValueError(f"packing {packing!r}: choose one of {', '.join(PACKINGS)}")
    return packing


def assign_runs(trajs: Sequence[Any], num_shards: int) -> list[list[int]]:
    """Whole runs to `num_shards` shards, balanced by tree tokens (largest run first to
    the least loaded shard; ties: lowest shard). Deterministic: every rank computes the
    same assignment. Returns trajectory indices per shard, in input order."""
    runs = list(group_runs(trajs).values())
    sizes = [run_tree_tokens([np.asarray(_ids(trajs[i]), dtype=np.int64) for i in idx])
             for idx in runs]
    load = [0] * num_shards
    out: list[list[int]] = [[] for _ in range(num_shards)]
    for r in sorted(range(len(runs)), key=lambda r: (-sizes[r], r)):
        s = min(range(num_shards), key=lambda s: (load[s], s))
        load[s] += sizes[r]
        out[s].extend(runs[r])
    return [sorted(idx) for idx in out]


def shard(trajs: Sequence[Any], *, rank: int, world_size: int, packing: str) -> list:
    """This data-parallel rank's part of a micro-batch: rows, every world_size-th
    trajectory; tree, whole runs (`assign_runs`)."""
    if check_packing(packing) == "rows":
        return list(trajs[rank::world_size])
    return [trajs[i] for i in assign_runs(trajs, world_size)[rank]]

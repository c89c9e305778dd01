"""Prefix tree of a run's call sequences (a radix trie over token ids).

Every call contributes its sequence prompt + output. The tree is a compressed trie:
each edge holds a run of tokens as a numpy slice (a view into the calls' arrays, no copy)
and edges branch where sequences differ. Edge 0 is the root (no tokens).

Every edge is homogeneous: either *context* (logprobs None) or *generated*: each of its
tokens was produced by the policy, by call `gen_call`, under exactly the tree prefix
above it; it then carries the call's sampling logprobs (a view) and `policy_version`.
Only generated tokens are trainable. An output walks the tree from the position of its
prompt: where it meets context it turns that stretch into generated (the same node);
where it meets tokens another call already generated, the first call's logprobs stay
(a difference is noted in `notes`); where it leaves the tree it adds a new edge. A prompt
never changes an edge, so an output re-sent after a rewritten prefix sits at another
node, as context.

Building works from `CallDelta`s: a call's prompt starts at depth `shared_len` on its
parent call's path, so a run costs O(its distinct tokens + edges walked), not calls x
context length. Splitting an edge gives the new id to the head piece; the tail keeps its
id, so (edge, depth) references to a call's end stay valid by walking up parent links.
The builder also keeps, per edge, the latest call whose sequence covers all of it, so
`TreeBuilder.match` can tell the writer which earlier call shares the longest prefix
with a new prompt (see `encode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gyre_slurm.traj.delta import CallDelta, common_prefix_len
from gyre_slurm.traj.records import EMPTY_IDS


@dataclass(frozen=True, eq=False)
class PrefixTree:
    """A built tree; edge e holds tokens[e], hanging below parent[e] at start depth[e]."""

    run_id: str
    tokens: tuple[np.ndarray, ...]
    logprobs: tuple[np.ndarray | None, ...]  # None: context
    version: np.ndarray  # int64 per edge; -1 for context
    gen_call: np.ndarray  # int64 per edge; -1 for context
    parent: np.ndarray  # int64 per edge; -1 for the root
    depth: np.ndarray  # int64 per edge: tokens above its first token
    children: tuple[tuple[int, ...], ...]  # per edge, ordered by first token
    leaves: tuple[int, ...]  # edges without children, in creation (call) order
    call_ends: dict[int, tuple[int, int]]  # call -> (edge holding its end, sequence length)
    notes: tuple[str, ...]

    @property
    def num_edges(self) -> int:
        return len(self.tokens)

    def length(self, edge: int) -> int:
        return len(self.tokens[edge])

    def is_trainable(self, edge: int) -> bool:
        return self.logprobs[edge] is not None

    @property
    def num_tokens(self) -> int:
        """Distinct tokens (tree nodes)."""
        return sum(len(t) for t in self.tokens)

    @property
    def num_trainable(self) -> int:
        return sum(len(t) for t, lp in zip(self.tokens, self.logprobs) if lp is not None)

    def path(self, edge: int) -> list[int]:
        """Edges from the root's first child down to `edge`."""
        out = []
        while edge > 0:
            out.append(edge)
            edge = int(self.parent[edge])
        return out[::-1]

    def path_tokens(self, edge: int) -> np.ndarray:
        parts = [self.tokens[e] for e in self.path(edge)]
        return np.concatenate(parts) if parts else EMPTY_IDS

    def call_sequence(self, call: int) -> np.ndarray:
        """prompt + output of `call`, read back from the tree."""
        edge, length = self.call_ends[call]
        return self.path_tokens(edge)[:length]

    def topo_order(self) -> list[int]:
        """Every edge after its parent (breadth first from the root)."""
        order, i = [0], 0
        while i < len(order):
            order.extend(self.children[order[i]])
            i += 1
        return order

    def contains(self, token_ids: np.ndarray) -> bool:
        """Whether `token_ids` is a path from the root (a prefix of some leaf's path)."""
        edge, pos = 0, 0
        kids = {e: {int(self.tokens[c][0]): c for c in self.children[e]}
                for e in range(self.num_edges)}
        while pos < len(token_ids):
            edge = kids[edge].get(int(token_ids[pos]), -1)
            if edge < 0:
                return False
            seg = self.tokens[edge]
            m = common_prefix_len(token_ids[pos:], seg)
            if m < min(len(seg), len(token_ids) - pos):
                return False
            pos += m
        return True


class TreeBuilder:
    """Grows a run's tree one call at a time (`add`); `finish` freezes it. `match` finds
    how much of a prompt is already in the tree, and which call holds that prefix."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.tok: list[np.ndarray] = [EMPTY_IDS]
        self.lp: list[np.ndarray | None] = [None]
        self.ver: list[int] = [-1]
        self.gen: list[int] = [-1]
        self.par: list[int] = [-1]
        self.dep: list[int] = [0]
        self.kids: list[dict[int, int]] = [{}]
        self.through: list[int] = [-1]  # per edge: the latest call covering all of it
        self.call_ends: dict[int, tuple[int, int]] = {}
        self.notes: list[str] = []

    def _append(self, parent: int, tok: np.ndarray, lp: np.ndarray | None,
                ver: int, gen: int, depth: int) -> int:
        e = len(self.tok)
        self.tok.append(tok)
        self.lp.append(lp)
        self.ver.append(ver)
        self.gen.append(gen)
        self.par.append(parent)
        self.dep.append(depth)
        self.kids.append({})
        self.through.append(-1)
        return e

    def new_leaf(self, parent: int, tok: np.ndarray, lp: np.ndarray | None,
                 ver: int, gen: int) -> int:
        depth = self.dep[parent] + len(self.tok[parent])
        e = self._append(parent, tok, lp, ver, gen, depth)
        self.kids[parent][int(tok[0])] = e
        return e

    def split(self, e: int, k: int) -> int:
        """Cut edge e after k tokens (0 < k < len); the head gets a new id, e the tail."""
        tok, lp, p = self.tok[e], self.lp[e], self.par[e]
        h = self._append(p, tok[:k], None if lp is None else lp[:k],
                         self.ver[e], self.gen[e], self.dep[e])
        self.kids[h][int(tok[k])] = e
        self.kids[p][int(tok[0])] = h
        self.through[h] = self.through[e]
        self.tok[e], self.lp[e] = tok[k:], None if lp is None else lp[k:]
        self.dep[e] += k
        self.par[e] = h
        return h

    def locate(self, edge: int, depth: int) -> tuple[int, int]:
        """(edge, tokens of it consumed) after `depth` tokens on the path to `edge`."""
        if depth == 0:
            return 0, 0
        while self.dep[edge] >= depth:
            edge = self.par[edge]
        return edge, depth - self.dep[edge]

    def mark_generated(self, e: int, o: int, lp: np.ndarray, ver: int, gen: int) -> int:
        """Tokens o..o+len(lp) of edge e were generated by call `gen`; returns the edge
        that now ends exactly there."""
        m = len(lp)
        if self.lp[e] is not None:
            if self.ver[e] != ver or not np.array_equal(self.lp[e][o:o + m], lp):
                self.notes.append(
                    f"call {gen} regenerated {m} tokens of call {self.gen[e]} at depth "
                    f"{self.dep[e] + o} with other logprobs/version; kept call {self.gen[e]}'s")
            return self.split(e, o + m) if o + m < len(self.tok[e]) else e
        if o > 0:
            self.split(e, o)  # e is now the piece starting at o
        if m < len(self.tok[e]):
            e = self.split(e, m)
        self.lp[e], self.ver[e], self.gen[e] = lp, ver, gen
        return e

    def insert(self, e: int, o: int, seq: np.ndarray, lp: np.ndarray | None,
               ver: int, gen: int) -> tuple[int, int]:
        """Walk/extend the tree with `seq` from (e, o); returns the end position."""
        i, n = 0, len(seq)
        while i < n:
            tok = self.tok[e]
            if o == len(tok):
                child = self.kids[e].get(int(seq[i]))
                if child is None:
                    leaf = self.new_leaf(e, seq[i:], None if lp is None else lp[i:], ver, gen)
                    return leaf, n - i
                e, o = child, 0
                continue
            m = common_prefix_len(seq[i:], tok[o:])
            if m == 0:
                e = self.split(e, o)
                continue
            if lp is not None:
                e = self.mark_generated(e, o, lp[i:i + m], ver, gen)
                o = len(self.tok[e])
            elif o + m < len(tok) and i + m < n:
                e, o = self.split(e, o + m), o + m
            else:
                o += m
            i += m
        return e, o

    def add(self, d: CallDelta) -> None:
        e, o = 0, 0
        if d.parent_call >= 0:
            edge, _ = self.call_ends[d.parent_call]
            e, o = self.locate(edge, d.shared_len)
        e, o = self.insert(e, o, d.new_ids, None, -1, -1)
        e, o = self.insert(e, o, d.output_ids, d.output_logprobs, d.policy_version, d.call)
        self.call_ends[d.call] = (e, d.seq_len)
        x = e if o == len(self.tok[e]) else self.par[e]
        while x > 0:
            self.through[x] = d.call
            x = self.par[x]

    def match(self, seq: np.ndarray) -> tuple[int, int]:
        """(length of the longest prefix of `seq` in the tree, the latest call whose
        sequence holds that prefix, or -1 when the length is 0)."""
        e, o, i, n = 0, 0, 0, len(seq)
        while i < n:
            tok = self.tok[e]
            if o == len(tok):
                child = self.kids[e].get(int(seq[i]))
                if child is None:
                    break
                e, o = child, 0
                continue
            m = common_prefix_len(seq[i:], tok[o:])
            i, o = i + m, o + m
            if o < len(tok):
                break
        return i, (self.through[e] if i > 0 else -1)

    def finish(self) -> PrefixTree:
        kids = tuple(tuple(k for _, k in sorted(c.items())) for c in self.kids)
        leaves = tuple(e for e in range(1, len(self.tok)) if not self.kids[e])
        return PrefixTree(
            self.run_id, tuple(self.tok), tuple(self.lp), np.array(self.ver, dtype=np.int64),
            np.array(self.gen, dtype=np.int64), np.array(self.par, dtype=np.int64),
            np.array(self.dep, dtype=np.int64), kids, leaves, dict(self.call_ends),
            tuple(self.notes))


def build_tree(deltas: Sequence[CallDelta]) -> PrefixTree:
    """The prefix tree of one run's calls (in call order; see `delta.check_run`)."""
    if not deltas:
        raise ValueError("a run with no calls has no tree")
    builder = TreeBuilder(deltas[0].run_id)
    for d in deltas:
        builder.add(d)
    return builder.finish()

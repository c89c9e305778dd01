"""Choosing each call's parent for the stored (delta) form.

The encoder keeps, per run, the prefix tree of the run's sequences so far
(`tree.TreeBuilder`: distinct tokens only, as views of the calls' arrays plus copies of
new prompt tokens; no full prompts are kept). A new prompt is walked down that tree; the
parent is the latest call whose sequence holds the longest matched prefix, and
`shared_len` is that prefix's length. So `shared_len` is the longest prefix the prompt
shares with *any* earlier call of the run (a sub-agent returning after many calls, a
fork from an old point, a retry) and the stored new tokens are exactly the prompt tokens
not yet in the tree. Cost per call: O(prompt tokens) numpy compares, in chunks, plus
O(edges on the path) Python steps.

`encode(record, remember=False)` + `remember(delta)` lets a writer add a call to the
tree only once it is stored.
"""

from __future__ import annotations

from collections.abc import Iterable

from gyre_slurm.traj.delta import CallDelta
from gyre_slurm.traj.records import CallRecord
from gyre_slurm.traj.tree import TreeBuilder


class DeltaEncoder:
    """Turns a stream of `CallRecord`s (of any number of runs) into `CallDelta`s."""

    def __init__(self) -> None:
        self._trees: dict[str, TreeBuilder] = {}

    def forget(self, run_id: str) -> None:
        """A run is over: drop its tree (a later call of it would get no parent)."""
        self._trees.pop(run_id, None)

    def encode(self, rec: CallRecord, *, remember: bool = True) -> CallDelta:
        builder = self._trees.get(rec.run_id)
        shared, parent = builder.match(rec.prompt_ids) if builder else (0, -1)
        new_ids = rec.prompt_ids[shared:].copy()  # a copy: the full prompt can be freed
        delta = CallDelta(rec.run_id, rec.call, parent, shared, new_ids, rec.output_ids,
                          rec.output_logprobs, rec.policy_version, rec.t_start, rec.t_end,
                          rec.finish_reason, rec.extra)
        if remember:
            self.remember(delta)
        return delta

    def remember(self, delta: CallDelta) -> None:
        """Add an encoded call to its run's tree (so later calls can refer to it)."""
        builder = self._trees.get(delta.run_id)
        if builder is None:
            builder = self._trees[delta.run_id] = TreeBuilder(delta.run_id)
        builder.add(delta)


def encode_run(calls: Iterable[CallRecord]) -> list[CallDelta]:
    """The stored form of one run's calls, in the given (call) order."""
    encoder = DeltaEncoder()
    return [encoder.encode(rec) for rec in calls]

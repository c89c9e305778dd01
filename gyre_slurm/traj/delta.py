"""The stored form of a call: (parent call, shared length, new tokens) instead of a full
prompt, and the lossless conversion between it and `CallRecord`.

A call's prompt is almost always an earlier sequence of the same run plus a suffix. With
seq(c) = prompt(c) + output(c), a `CallDelta` says

    prompt(c) = seq(parent_call)[:shared_len] + new_ids      (parent_call = -1: no parent)

so a run costs about its distinct tokens, not calls x context length. The parent must be
an earlier call of the same run; `encode.DeltaEncoder` chooses it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre_slurm.traj.records import EMPTY_IDS, CallRecord

FIRST_CHUNK = 256


@dataclass(frozen=True, eq=False)
class CallDelta:
    """One call as stored: its prompt relative to an earlier call of the run."""

    run_id: str
    call: int
    parent_call: int  # -1: the prompt is `new_ids` alone
    shared_len: int
    new_ids: np.ndarray  # int32
    output_ids: np.ndarray  # int32
    output_logprobs: np.ndarray  # float32
    policy_version: int
    t_start: float = 0.0
    t_end: float = 0.0
    finish_reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return self.shared_len + len(self.new_ids)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + len(self.output_ids)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-d arrays; compares in growing chunks
    so that an early mismatch costs little."""
    n = min(len(a), len(b))
    start, chunk = 0, FIRST_CHUNK
    while start < n:
        stop = min(n, start + chunk)
        diff = np.flatnonzero(a[start:stop] != b[start:stop])
        if diff.size:
            return start + int(diff[0])
        start, chunk = stop, chunk * 4
    return n


def check_run(deltas: Sequence[CallDelta]) -> tuple[int, str] | None:
    """(call, reason) for the first inconsistent delta of a run, or None. Each parent
    must be an earlier call of the run, and the shared length at most its sequence."""
    seq_len: dict[int, int] = {}
    for d in deltas:
        if d.parent_call >= 0 or d.shared_len:
            if d.parent_call not in seq_len:
                return d.call, f"parent call {d.parent_call} is not an earlier call of the run"
            if not 0 <= d.shared_len <= seq_len[d.parent_call]:
                return d.call, (f"shared length {d.shared_len} exceeds parent call "
                                f"{d.parent_call}'s {seq_len[d.parent_call]} tokens")
        if len(d.output_ids) != len(d.output_logprobs):
            return d.call, (f"{len(d.output_ids)} output_ids but "
                            f"{len(d.output_logprobs)} output_logprobs")
        seq_len[d.call] = d.seq_len
    return None


def decode_run(deltas: Sequence[CallDelta]) -> Iterator[CallRecord]:
    """Full `CallRecord`s back from a run's deltas (in call order). Keeps a call's full
    sequence only while a later call still refers to it. KeyError on a missing parent
    (use `check_run` first)."""
    refs = Counter(d.parent_call for d in deltas if d.parent_call >= 0)
    seqs: dict[int, np.ndarray] = {}
    for d in deltas:
        base = EMPTY_IDS
        if d.parent_call >= 0:
            base = seqs[d.parent_call][: d.shared_len]
            refs[d.parent_call] -= 1
            if refs[d.parent_call] == 0:
                del seqs[d.parent_call]
        prompt = np.concatenate([base, d.new_ids]).astype(np.int32, copy=False)
        if refs[d.call] > 0:
            seqs[d.call] = np.concatenate([prompt, d.output_ids])
        yield CallRecord(d.run_id, d.call, prompt, d.output_ids, d.output_logprobs,
                         d.policy_version, d.t_start, d.t_end, d.finish_reason, d.extra)

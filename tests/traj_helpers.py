"""Shared builders for the traj tests. Token ids in readable bands: prompt/user tokens
1000s, model outputs 2000s, tool results 3000s. The logprob of output token j of call c
is `lp_of(c, j)`, so a test can tell which call a trained logprob came from."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gyre_slurm.traj.records import CallRecord


def lp_of(call: int, j: int) -> float:
    return float(np.float32(-(call + 1) - j / 64))


def mk_call(call: int, prompt: Sequence[int], output: Sequence[int], *, run_id: str = "r",
            version: int = 1, lps: Sequence[float] | None = None) -> CallRecord:
    if lps is None:
        lps = [lp_of(call, j) for j in range(len(output))]
    return CallRecord(run_id, call, np.array(prompt, dtype=np.int32),
                      np.array(output, dtype=np.int32), np.array(lps, dtype=np.float32),
                      version, float(call), float(call) + 0.5, "stop")


def mk_run(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, run_id: str = "r",
           versions: Sequence[int] | None = None) -> list[CallRecord]:
    """Calls 0..n-1 from (prompt, output) pairs."""
    return [mk_call(i, p, o, run_id=run_id, version=versions[i] if versions else 1)
            for i, (p, o) in enumerate(pairs)]


def oracle_trainable(calls: Sequence[CallRecord]) -> dict[tuple[int, ...], tuple[float, int]]:
    """Brute force: every node (as its full token prefix) some call generated, with the
    first generating call's (logprob, version)."""
    out: dict[tuple[int, ...], tuple[float, int]] = {}
    for rec in calls:
        prefix = rec.prompt_ids.tolist()
        for tok, lp in zip(rec.output_ids.tolist(), rec.output_logprobs.tolist()):
            prefix.append(tok)
            out.setdefault(tuple(prefix), (lp, rec.policy_version))
    return out


def trained_nodes(trajs) -> list[tuple[int, ...]]:
    """Every mask-1 position of the trajectories, as its full token prefix."""
    nodes = []
    for t in trajs:
        ids = t.token_ids.tolist()
        nodes += [tuple(ids[:i + 1]) for i in np.flatnonzero(t.loss_mask).tolist()]
    return nodes

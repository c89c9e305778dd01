"""Lending: the elastic policy's spare rollout cells train in a step's tail.

Between the start of a step's last runs and the next batch being allowed (its step's
policy trained), no run waits to start, and the runs still in flight leave rollout cells
spare while training has a backlog. Elastic lends such cells to training, every one
spare at that moment together (their runs migrate to free slots on the other rollout
cells), and takes them back as soon as runs are queued again: the base layout the
outlook chooses holds for whole steps, lending moves cells within them. The outlook
credits every plan with the lending to come (`Outlook._lend`), so a base layout is not
chosen for a training side that the tails' lending gives anyway.

Lending is only where a model replica is one cell: a lent cell that is not a whole
replica adds no training throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.rule import free_slots, releasable_cells
from gyre_slurm.sched.types import CellObs, Decision, Observation


@dataclass
class TailLending:
    most: int  # cells lent at once, at most (scheduler.lend_cells)
    lent: dict[int, float] = field(default_factory=dict)  # cell lent -> when
    window: int = 0  # runs a staleness window holds (`WorkloadPrior.window`); 0: unknown

    def cells(self, obs: Observation) -> int:
        """Cells lent at once in a tail, at most: `most`, and half the cells; none on
        fewer than four. On a few cells, lending more moved the balance past what the
        steps needed (the property test's 4-cell workloads ran up to 6% behind the best
        fixed split with 3 lent), and on three a lent cell is half the rollout side (a
        3-cell job with 4 runs a step went from 1.001 to 1.030 of the best fixed split
        by one lend of 300 s that its outlook expected to gain 384 s).

        None either where a staleness window's runs fit in the slots of every cell but
        a training replica and one more: the rollout side never needs its last cells
        back for a new batch, so a cell lent is a release the base plan should make
        (and pay once). With the credit, jobs of a few runs a step on 6-8 cells took
        cells back for rollout, then lent them out idle one by one, 7 handoffs where
        2 did (2-4 runs a step: up to 7.6% slower than without lending)."""
        if obs.min_train_cells != 1 or len(obs.cells) < 4:
            return 0
        if 0 < self.window <= (len(obs.cells) - obs.min_train_cells - 1) * obs.cell_capacity:
            return 0
        return min(self.most, len(obs.cells) // 2)

    def returns(self, obs: Observation) -> list[Decision]:
        """Back to rollout, every lent cell, once runs are queued (the next batch is
        allowed): a drain is cancelled, a training cell reclaimed (a loading one once it
        has arrived)."""
        cells = {c.cell_id: c for c in obs.cells}
        self.lent = {i: t for i, t in self.lent.items()
                     if i in cells and cells[i].heading is Role.TRAIN}
        if obs.runs_queued <= 0 or not self.lent:
            return []
        back = [cells[i] for i in sorted(self.lent)  # one loading: once it has arrived
                if cells[i].role in (Role.DRAINING, Role.TRAIN)]
        if not back:
            return []
        moving = sum(1 for c in back if c.role is not Role.DRAINING)
        expected = {"plan": "return", "cells": len(back), "runs_queued": obs.runs_queued,
                    "slots": len(back) * obs.cell_capacity,
                    "lent_for_s": [round(obs.now_s - self.lent[c.cell_id], 1) for c in back],
                    "handoff_cell_s": round(moving * obs.handoff_to_rollout_s, 1)}
        reason = (f"return {len(back)} lent cell(s) to rollout: {obs.runs_queued} run(s) "
                  f"queued (the next batch is allowed), {len(back) * obs.cell_capacity} "
                  f"slots for them; costs {expected['handoff_cell_s']} cell-s in handoffs")
        for c in back:
            del self.lent[c.cell_id]
        return [Decision(c.cell_id, Role.ROLLOUT,
                         "cancel_drain" if c.role is Role.DRAINING else "reclaim", reason,
                         expected=expected) for c in back]

    def candidate(self, obs: Observation, min_dwell_s: float = 0.0) -> CellObs | None:
        """The first of `candidates`: the least-loaded cell that may be lent now, if
        any (tools/sim_lend.py's rule lends one at a time)."""
        cells = self.candidates(obs, min_dwell_s)
        return cells[0] if cells else None

    def candidates(self, obs: Observation, min_dwell_s: float = 0.0) -> list[CellObs]:
        """The cells to lend now, least loaded first, if any: no run queued (a later
        batch not yet allowed, or the job's last runs all started: then lent for good);
        training has a whole replica and at least one handoff's time of tokens ready; no
        cell in transit; elastic rollout cells that have dwelt `min_dwell_s` in their
        role (as any move must), as many as keep the cells lent within `cells` and the
        runs of all of them within the free slots of the rollout cells that stay (at
        least one stays).

        Lent together because the outlook credits them together: its lending (the
        credit every plan is weighed with, and the gain a lend must show) lends each
        spare cell as soon as it is spare. Lent one at a time, each later cell had to
        show `min_gain` of the horizon by itself, which on many cells one cell never
        does: on terminalbench-122b scaled to 64 cells, 2 of the 4 cells credited were
        lent in each tail (the other two, weighed after them, were expected to gain at
        most 543 s of the 584-606 s asked), and the base layout, chosen for 4, kept too
        few training cells: 1.262 of the bound at seed 0, 2.5% slower than with no
        lending; lent together, 1.238."""
        if obs.runs_queued > 0:
            return []
        train = [c for c in obs.cells if c.role is Role.TRAIN]
        if len(train) < obs.min_train_cells or obs.train_ready_tokens <= 0 or any(
                c.role in (Role.DRAINING, Role.LOADING) for c in obs.cells):
            return []
        if self.backlog_s(obs) < obs.handoff_to_train_s:
            return []
        room = min(self.cells(obs) - len(self.lent),
                   sum(1 for c in obs.cells if c.role is Role.ROLLOUT) - 1)
        chosen: list[CellObs] = []
        runs = 0
        for cell in releasable_cells(obs, min_dwell_s)[:max(0, room)]:
            leaving = {c.cell_id for c in chosen} | {cell.cell_id}
            if runs + cell.active_runs > free_slots(obs, leaving):
                break  # the next are as loaded or more
            chosen.append(cell)
            runs += cell.active_runs
        return chosen

    def backlog_s(self, obs: Observation) -> float:
        """Seconds of training the ready tokens hold for the training cells now."""
        train = sum(1 for c in obs.cells if c.role is Role.TRAIN)
        return obs.train_ready_tokens / max(obs.train_tokens_per_cell_s * max(1, train), 1e-9)

"""The discrete-event simulator: the same policy objects the coordinator runs, on a
modelled cluster. Events: a run finishes, a run reaches its next call (migration), a
handoff phase ends, a micro-batch or optimizer step ends, a rollout stall ends, and
a policy tick every `scheduler.interval_s` (and at every step boundary).

Deterministic for a seed: every random draw comes from generators seeded by
`seed`, and ties are broken by event sequence numbers.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field

import numpy as np

from gyre_slurm.config.schema import GyreConfig, HandoffConfig
from gyre_slurm.sched.cells import Cell, CellTable, Role
from gyre_slurm.sched.ledger import WorkLedger
from gyre_slurm.sched.observe import (HandoffTimes, RunsNow, build_observation,
                                      prior_tokens_per_cell_s, prior_tokens_per_run)
from gyre_slurm.sched.types import Decision, Observation, Policy
from gyre_slurm.sim.limits import MAX_TICKS, TooLargeToSimulate, check_job, time_limit_s
from gyre_slurm.sim.rollout import RUNNING, RolloutCells
from gyre_slurm.sim.training import Microbatch, train_throughput
from gyre_slurm.sim.workload import Workload

FUTURE, QUEUED, DONE = 0, 1, 3
RUN_DONE, MIGRATE, PHASE_DONE, TRAIN_DONE, STALL_END, TICK, TRAIN_KICK, ADMIT = range(8)


class SimDeadlock(RuntimeError):
    """The policy left the cluster in a state where nothing can progress."""


@dataclass
class SimResult:
    policy: str
    makespan_s: float
    busy_fraction: float
    handoffs: int
    handoff_phase_s: dict[str, float]  # mean seconds per phase over all handoffs
    trajectories_per_step: list[int]
    max_staleness: int
    runs_finished: int
    work_done_s: float  # sum of run work completed (== sum of durations + re-prefills)
    migrations: int
    timeline: list[tuple[int, float, float, str]] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    busy_cell_s: dict[str, float] = field(default_factory=dict)  # rollout / train busy

    def cell_time(self) -> dict[str, float]:
        """Where the cell-seconds went: held in rollout (busy: load / capacity), held in
        training (busy: computing; of that, spare: cells beyond the world's whole model
        replicas, which add no throughput), in transit (draining or loading)."""
        held: dict[str, float] = collections.defaultdict(float)
        for _, t0, t1, state in self.timeline:
            held["transit" if "->" in state else state] += t1 - t0
        return {"rollout_s": held["rollout"], "rollout_busy_s": self.busy_cell_s["rollout"],
                "train_s": held["train"], "train_busy_s": self.busy_cell_s["train"],
                "train_spare_s": self.busy_cell_s.get("train_spare", 0.0),
                "transit_s": held["transit"]}

    def summary(self) -> dict:
        return {"makespan_s": round(float(self.makespan_s), 1),
                "busy_fraction": round(float(self.busy_fraction), 4),
                "handoffs": self.handoffs,
                "migrations": self.migrations,
                "max_staleness": self.max_staleness,
                "handoff_phase_s": {k: round(v, 2) for k, v in self.handoff_phase_s.items()}}


class Simulator:
    def __init__(self, cfg: GyreConfig, policy: Policy, workload: Workload, *,
                 policy_handoff: HandoffConfig | None = None):
        """`policy_handoff`: the handoff costs the policy is told (its prior), where they
        differ from the costs the simulation charges (`cfg.handoff`), as in a real run
        whose config holds a prior and whose handoffs take what they take."""
        self.cfg, self.policy, self.w = cfg, policy, workload
        self.policy_handoff = policy_handoff or cfg.handoff
        self.handoff_times = HandoffTimes()  # as the runtime: measured once a cell moved
        self.cap = cfg.cell_capacity
        num_cells = cfg.cluster.num_cells
        check_job(cfg, workload)  # a workload may come from elsewhere than sample_workload
        self.time_limit_s = time_limit_s(cfg)  # what no estimate foresaw (handoff costs)
        layout = policy.initial_layout(num_cells)
        nodes = [f"node{i + 1}" for i in range(cfg.cluster.num_nodes)]
        groups = [tuple(nodes[i * cfg.cluster.cell_nodes:(i + 1) * cfg.cluster.cell_nodes])
                  for i in range(num_cells)]
        self.table = CellTable(Cell(i, groups[i], layout.standalone[i], layout.roles[i])
                               for i in range(num_cells))
        self.rollout = RolloutCells(num_cells=num_cells, capacity=self.cap,
                                    llm_fraction=cfg.workload.llm_time_fraction,
                                    half_load_runs=cfg.rollout.half_load_runs,
                                    num_runs=workload.num_runs)
        self.ledger = WorkLedger(num_steps=workload.num_steps,
                                 groups_per_step=workload.runs_per_step // workload.group_size,
                                 group_size=workload.group_size)
        stale = cfg.training.max_staleness
        if policy.max_staleness is not None:
            stale = min(stale, policy.max_staleness)
        self.staleness = stale
        self.rng = np.random.default_rng([cfg.seed, 1])
        self.now = 0.0
        self.seq = 0
        self.events: list = []
        self.status = np.zeros(workload.num_runs, dtype=np.int8)
        self.start_s = np.zeros(workload.num_runs)
        self.version_at_start = np.zeros(workload.num_runs, dtype=np.int64)
        self.queue: collections.deque[int] = collections.deque()
        self.num_allowed = 0
        self.version = 0
        self.mb: Microbatch | None = None
        self.last_world: frozenset[int] = frozenset()
        self.train_busy_cell_s = np.zeros(num_cells)
        self.train_spare_cell_s = 0.0  # of that, cells beyond the world's whole replicas
        self.handoff_log: list[dict] = []
        self.pending_handoff: dict[int, dict] = {}
        self.timeline_open = {i: (0.0, layout.roles[i].value) for i in range(num_cells)}
        self.timeline: list[tuple[int, float, float, str]] = []
        self.decisions: list[dict] = []
        self.max_staleness_seen = 0
        self.work_done = 0.0
        self.migrations = 0
        self.dirty_cells: set[int] = set()
        self.idle_ticks = 0
        self.kick_pending = False
        self.admit_pending = False
        # What observations say of the config (the priors the runtime's say until it has
        # measured), computed once: a cell's training rate in a smallest world, and a
        # run's trained tokens per step.
        self.cell_tps = prior_tokens_per_cell_s(cfg)
        self.run_tokens: dict[int, float] = {}

    # -- event plumbing --------------------------------------------------------------
    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def run(self) -> SimResult:
        self.allow_batches()
        self.admit()
        self.push(0.0, TICK)
        handlers = {RUN_DONE: self.on_run_done, MIGRATE: self.on_migrate,
                    PHASE_DONE: self.on_phase_done, TRAIN_DONE: self.on_train_done,
                    STALL_END: self.on_stall_end, TICK: self.on_tick,
                    TRAIN_KICK: self.on_train_kick, ADMIT: self.on_admit}
        while self.version < self.w.num_steps:
            t, _, kind, a, b = heapq.heappop(self.events)
            if t > self.time_limit_s:
                raise TooLargeToSimulate(
                    f"the simulated job passed {self.time_limit_s:.3g} s "
                    f"({MAX_TICKS:,} policy ticks at scheduler.interval_s = "
                    f"{self.cfg.scheduler.interval_s:g} s) at step {self.version} of "
                    f"{self.w.num_steps}, the most the simulator takes. Check the costs "
                    f"of the config (handoff, rollout.weight_sync_s, "
                    f"training.optimizer_step_s) and the workload, or raise "
                    f"scheduler.interval_s")
            self.now = t
            handlers[kind](a, b)
            self.flush_dirty()
        return self.result()

    def flush_dirty(self) -> None:
        for cell in self.dirty_cells:
            t = self.rollout.next_finish(cell, self.status)
            if t is not None:
                self.push(t, RUN_DONE, cell, int(self.rollout.epoch[cell]))
        self.dirty_cells.clear()

    # -- rollout ---------------------------------------------------------------------
    def allow_batches(self) -> None:
        upto = min(self.w.num_steps, self.version + self.staleness + 1) * self.w.runs_per_step
        for run in range(self.num_allowed, upto):
            self.status[run] = QUEUED
            self.queue.append(run)
        self.num_allowed = max(self.num_allowed, upto)

    def accepting(self) -> list[int]:
        return [c.cell_id for c in self.table.cells if c.role is Role.ROLLOUT]

    def admit(self) -> None:
        if not self.queue:
            return
        free = [(int(self.rollout.load[c]), c) for c in self.accepting()
                if self.rollout.load[c] < self.cap]
        heapq.heapify(free)
        while self.queue and free:
            load, cell = heapq.heappop(free)
            run = self.queue.popleft()
            self.status[run] = RUNNING
            self.start_s[run] = self.now
            self.version_at_start[run] = self.version
            self.rollout.place(run, cell, self.now, self.w.work_s[run])
            self.work_done += self.w.work_s[run]
            self.dirty_cells.add(cell)
            if load + 1 < self.cap:
                heapq.heappush(free, (load + 1, cell))

    def admit_soon(self) -> None:
        """Admit queued runs once every event of this instant has landed: cells that
        return to rollout together share the queue (least loaded first), not the first
        one back taking it all."""
        if not self.admit_pending:
            self.admit_pending = True
            self.push(self.now, ADMIT)

    def on_admit(self, _a: int, _b: int) -> None:
        self.admit_pending = False
        self.admit()

    def on_run_done(self, cell: int, epoch: int) -> None:
        if epoch != self.rollout.epoch[cell]:
            return
        for run in self.rollout.pop_finished(cell, self.now, self.status):
            self.status[run] = DONE
            step = int(self.w.batch[run])
            self.max_staleness_seen = max(self.max_staleness_seen,
                                          step - int(self.version_at_start[run]))
            if self.ledger.run_finished(step=step, group=int(self.w.group[run]),
                                        tokens=int(self.w.tokens[run])):
                self.kick_train()
        self.dirty_cells.add(cell)
        self.maybe_drained(cell)
        self.admit()

    def on_migrate(self, run: int, cell: int) -> None:
        c = self.table[cell]
        if self.rollout.run_cell[run] != cell or c.role is not Role.DRAINING:
            return
        free = [x for x in self.accepting() if self.rollout.load[x] < self.cap]
        if not free:
            self.push(self.now + self.call_gap(), MIGRATE, run, cell)
            return
        dest = min(free, key=lambda x: (self.rollout.load[x], x))
        left = self.rollout.remove(run, self.now)
        extra = self.cfg.rollout.reprefill_s
        self.rollout.place(run, dest, self.now, left + extra)
        self.work_done += extra
        self.migrations += 1
        self.dirty_cells.update((cell, dest))
        self.maybe_drained(cell)

    def call_gap(self) -> float:
        return float(self.rng.exponential(self.cfg.rollout.call_interval_s))

    def on_stall_end(self, cell: int, _b: int) -> None:
        self.rollout.advance(cell, self.now)
        self.rollout.epoch[cell] += 1
        self.dirty_cells.add(cell)

    # -- handoffs --------------------------------------------------------------------
    def apply(self, decision: Decision) -> None:
        cell = self.table[decision.cell_id]
        self.decisions.append(decision.as_event(self.now))
        if decision.cause == "cancel_drain":
            self.table.cancel_drain(cell.cell_id, now_s=self.now)
            self.pending_handoff.pop(cell.cell_id, None)
            self.mark(cell.cell_id, Role.ROLLOUT.value)
            self.admit()
            return
        self.table.begin_handoff(cell.cell_id, decision.to_role, now_s=self.now)
        self.pending_handoff[cell.cell_id] = {"to": decision.to_role.value, "t0": self.now}
        self.mark(cell.cell_id, f"draining->{decision.to_role.value}")
        if decision.to_role is Role.TRAIN:
            if decision.drain == "migrate":
                for run in np.flatnonzero(self.rollout.run_cell == cell.cell_id):
                    self.push(self.now + self.call_gap(), MIGRATE, int(run), cell.cell_id)
            self.maybe_drained(cell.cell_id)

    def maybe_drained(self, cell_id: int) -> None:
        c = self.table[cell_id]
        if c.role is Role.DRAINING and c.target is Role.TRAIN and self.rollout.load[cell_id] == 0:
            h = self.cfg.handoff
            self.begin_loading(cell_id, {"engine_release_s": h.engine_release_s,
                                         "train_state_load_s": h.train_state_load_s})

    def leave_training(self, cell_id: int) -> None:
        h = self.cfg.handoff
        remaining = [c for c in self.table.ids(Role.TRAIN) if c != cell_id]
        phases = {"weight_load_s": h.weight_load_s, "engine_start_s": h.engine_start_s}
        if remaining:
            phases = {"group_rebuild_s": h.group_rebuild_s, **phases}
        self.begin_loading(cell_id, phases)

    def begin_loading(self, cell_id: int, phases: dict[str, float]) -> None:
        rec = self.pending_handoff[cell_id]
        rec["drain_s"] = self.now - rec["t0"]
        rec.update(phases)
        self.table.begin_loading(cell_id, now_s=self.now)
        self.mark(cell_id, f"loading->{rec['to']}")
        self.push(self.now + sum(phases.values()), PHASE_DONE, cell_id)

    def on_phase_done(self, cell_id: int, _b: int) -> None:
        rec = self.pending_handoff.pop(cell_id)
        self.handoff_log.append(rec)
        # The cell's transit as the runtime measures it; joining training, the world's
        # rebuild too (charged to the whole world as it starts: `Microbatch` pause).
        transit = sum(v for k, v in rec.items() if k.endswith("_s") and k != "drain_s")
        self.handoff_times.add(rec["to"], transit + (self.cfg.handoff.group_rebuild_s
                                                     if rec["to"] == "train" else 0.0))
        cell = self.table.finish_handoff(cell_id, now_s=self.now)
        self.mark(cell_id, cell.role.value)
        if cell.role is Role.ROLLOUT:
            self.rollout.advance(cell_id, self.now)
            self.admit_soon()
        else:
            self.kick_train()

    def mark(self, cell_id: int, label: str) -> None:
        t0, old = self.timeline_open[cell_id]
        if self.now > t0:
            self.timeline.append((cell_id, t0, self.now, old))
        self.timeline_open[cell_id] = (self.now, label)

    # -- training --------------------------------------------------------------------
    def kick_train(self) -> None:
        """Try to start a micro-batch once every event of this instant has landed (so
        cells that join together start training together)."""
        if not self.kick_pending:
            self.kick_pending = True
            self.push(self.now, TRAIN_KICK)

    def on_train_kick(self, _a: int, _b: int) -> None:
        self.kick_pending = False
        self.try_train()

    def try_train(self) -> None:
        if self.mb is not None or self.version >= self.w.num_steps:
            return
        world = frozenset(self.table.ids(Role.TRAIN))
        nodes = len(world) * self.cfg.cluster.cell_nodes
        rate = train_throughput(self.cfg.training, nodes)
        step = self.version
        tokens = min(self.ledger.trainable(step, streaming=self.policy.streaming),
                     int(self.cfg.training.microbatch_tokens))
        if rate <= 0 or tokens <= 0:
            return
        pause = self.cfg.handoff.group_rebuild_s if world != self.last_world and self.last_world else 0.0
        compute = tokens / rate
        self.mb = Microbatch(end_s=self.now + pause + compute, tokens=tokens, world=world,
                             compute_s=compute)
        self.last_world = world
        self.ledger.hand_out(step, tokens)
        self.push(self.mb.end_s, TRAIN_DONE)

    def spare_cells(self, cells: int) -> float:
        """Cells of a training world of `cells` that no whole model replica uses: they
        are held (and counted busy) but add no throughput."""
        nodes, replica = cells * self.cfg.cluster.cell_nodes, self.cfg.training.min_replica_nodes
        return (nodes - nodes // replica * replica) / self.cfg.cluster.cell_nodes

    def on_train_done(self, _a: int, _b: int) -> None:
        mb, self.mb = self.mb, None
        for cell in mb.world:
            self.train_busy_cell_s[cell] += mb.compute_s
        self.train_spare_cell_s += mb.compute_s * self.spare_cells(len(mb.world))
        step = self.version
        if mb.optimizer:
            self.finish_step()
        else:
            self.ledger.train_done(step, mb.tokens)
            if self.ledger.step_trained(step):
                opt = self.cfg.training.optimizer_step_s
                self.mb = Microbatch(end_s=self.now + opt, tokens=0, world=mb.world,
                                     compute_s=opt, optimizer=True)
                self.push(self.mb.end_s, TRAIN_DONE)
        self.release_trainers()
        self.kick_train()

    def release_trainers(self) -> None:
        """Cells draining towards rollout that train no micro-batch now leave, together:
        only the cells staying in training rebuild their world (cells leaving at once
        all arrive at once, not in the order their decisions were applied)."""
        for cell_id in self.table.ids(Role.DRAINING, target=Role.ROLLOUT):
            if self.mb is None or cell_id not in self.mb.world:
                self.leave_training(cell_id)

    def finish_step(self) -> None:
        self.version += 1
        sync = self.cfg.rollout.weight_sync_s
        serving = self.table.ids(Role.ROLLOUT) + self.table.ids(Role.DRAINING, target=Role.TRAIN)
        for cell in serving if sync > 0 else []:
            self.rollout.stall(cell, self.now, self.now + sync)
            self.push(self.now + sync, STALL_END, cell)
            self.dirty_cells.add(cell)
        self.allow_batches()
        self.admit()
        if self.version < self.w.num_steps:
            self.on_tick(0, 1)

    # -- policy ----------------------------------------------------------------------
    def on_tick(self, _a: int, extra: int) -> None:
        obs = self.observe()
        decisions = list(self.policy.decide(obs))
        for d in decisions:
            self.apply(d)
        self.release_trainers()
        self.check_progress(obs, decisions)
        if not extra:
            self.push(self.now + self.cfg.scheduler.interval_s, TICK)

    def check_progress(self, obs: Observation, decisions: list[Decision]) -> None:
        moving = any(c.target is not None for c in obs.cells)
        if decisions or moving or obs.runs_in_flight or self.mb is not None:
            self.idle_ticks = 0
            return
        self.idle_ticks += 1
        # A policy may wait, with nothing moving, for a cell to dwell `min_dwell_s`, then
        # up to `confirm_s` for its next plan and `confirm_s` more for a release to hold
        # (elastic re-plans an unchanged state every `confirm_s`): only idle past all
        # three, and 100 ticks, is a deadlock.
        sched = self.cfg.scheduler
        patience_s = 2 * sched.confirm_s + sched.min_dwell_s + 100 * sched.interval_s
        if self.idle_ticks * sched.interval_s > patience_s:
            roles = {c.cell_id: c.role.value for c in obs.cells}
            raise SimDeadlock(
                f"policy {self.policy.name}: nothing can progress at t={self.now:.0f}s "
                f"(step {self.version}, {obs.runs_queued} runs queued, "
                f"{obs.train_ready_tokens} tokens ready, cells {roles})")

    def observe(self) -> Observation:
        running = (self.status == RUNNING).nonzero()[0]
        step = self.version
        runs = RunsNow(in_flight=int(running.size), queued=len(self.queue),
                       future=self.w.num_runs - self.num_allowed,
                       elapsed_s=self.now - self.start_s[running],
                       steps=self.w.batch[running])
        return build_observation(
            cfg=self.cfg, now_s=self.now, table=self.table,
            cell_runs=dict(enumerate(self.rollout.load.tolist())), runs=runs,
            ledger=self.ledger, version=step, streaming=self.policy.streaming,
            train_tokens_per_cell_s=self.cell_tps, tokens_per_run=self.tokens_per_run(step),
            handoff=self.handoff_times.costs(self.policy_handoff),
            call_interval_s=self.cfg.rollout.call_interval_s)

    def tokens_per_run(self, step: int) -> float:
        """A run's trained tokens at this step (its phase), computed once per step."""
        out = self.run_tokens.get(step)
        if out is None:
            out = self.run_tokens[step] = float(
                prior_tokens_per_run(self.cfg, min(step, self.w.num_steps - 1)))
        return out

    # -- results ---------------------------------------------------------------------
    def result(self) -> SimResult:
        for cell in range(len(self.table)):
            self.rollout.advance(cell, self.now)
            self.mark(cell, "end")
        held = len(self.table) * self.now
        busy = float(self.rollout.busy_cell_s.sum() + self.train_busy_cell_s.sum())
        phases: dict[str, list[float]] = collections.defaultdict(list)
        for rec in self.handoff_log:
            for key, value in rec.items():
                if key.endswith("_s"):
                    phases[key].append(value)
        return SimResult(
            policy=self.policy.name, makespan_s=float(self.now),
            busy_fraction=busy / held if held else 0.0,
            handoffs=len(self.handoff_log),
            handoff_phase_s={k: float(np.mean(v)) for k, v in sorted(phases.items())},
            trajectories_per_step=[int(x) for x in self.ledger.runs_ready],
            max_staleness=self.max_staleness_seen,
            runs_finished=int((self.status == DONE).sum()),
            work_done_s=self.work_done, migrations=self.migrations,
            timeline=self.timeline, decisions=self.decisions,
            busy_cell_s={"rollout": float(self.rollout.busy_cell_s.sum()),
                         "train": float(self.train_busy_cell_s.sum()),
                         "train_spare": float(self.train_spare_cell_s)},
        )

"""The coordinator's ledger of steps, runs and trajectories (pure: no I/O, no clock).

The trajectories themselves live here; the work they stand for (tokens done, ready,
in progress, trained: what the policy observes) is counted by `work`, a
`sched.ledger.WorkLedger`, the one the simulator keeps too.

Step k trains the runs of batch k: `prompts_per_step` tasks x `group_size` runs each.
Batch k may start once the policy has trained at least k - staleness steps. A run ends
`ok` (its calls become trajectories) or `failed`/`timeout` (never trained, says why).
A group's trajectories become trainable when every run of the group has ended: the
advantage of a run is its reward minus the mean reward of the group's ok runs
(group-relative). Streaming: ready trajectories are handed out in arrival order, in
micro-batches by a token budget. Step k is complete when every run of batch k has ended
and every trajectory handed out has been trained; then the optimizer steps.

A run interrupted by a coordinator stop (resume), or by the failure of the rollout server
under one of its calls (a crashed or hung engine, a lost node), restarts as a new attempt:
its run id gets `-a<N>`; the interrupted attempt's partial calls stay in the store, never
trained.

A training member lost mid-step takes its share of the step's accumulated gradient with
it: the step is rewound (`rewind_step`): every micro-batch of it trained so far (and the
one that failed) is trained again, in the same order and under the same stream index, on
the rebuilt world, which restarts from the state of the last optimizer step.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from gyre_slurm.sched.ledger import WorkLedger
from gyre_slurm.traj.treepack import tree_tokens

Microbatch = tuple[int, list[dict]]  # (index in the step's stream, its trajectories)


@dataclass
class RunEntry:
    run_id: str
    step: int
    prompt: int
    member: int
    attempt: int = 0
    state: str = "pending"  # pending | running | ok | failed | timeout
    reward: float = 0.0
    # held until its group is released to training (the step's ready queue and trained
    # batches hold them from then on, until the step is trained): the ledger keeps no
    # run's tokens for the job's life
    trajectories: list[dict] = field(default_factory=list)
    num_trajectories: int = 0  # an ok run's trajectories, and their tokens: kept
    tokens: int = 0


@dataclass
class StepState:
    runs: list[str]
    ready: deque = field(default_factory=deque)  # trajectories (dicts) not yet handed out
    handed_out: int = 0
    trained: int = 0
    trained_tokens: int = 0
    trained_runs: list[str] = field(default_factory=list)
    batches: list = field(default_factory=list)  # (stream index, micro-batch) trained
    redo: deque = field(default_factory=deque)  # (stream index, micro-batch) to train again


def run_id_of(step: int, prompt: int, member: int, attempt: int = 0) -> str:
    rid = f"s{step:04d}-p{prompt:03d}-g{member:02d}"
    return rid if attempt == 0 else f"{rid}-a{attempt}"


class StepBook:
    def __init__(self, *, num_steps: int, prompts_per_step: int, group_size: int, staleness: int):
        self.num_steps, self.staleness = num_steps, staleness
        self.prompts, self.group_size = prompts_per_step, group_size
        self.runs: dict[str, RunEntry] = {}
        self.steps: list[StepState] = []
        for s in range(num_steps):
            ids = []
            for p in range(prompts_per_step):
                for g in range(group_size):
                    rid = run_id_of(s, p, g)
                    self.runs[rid] = RunEntry(rid, s, p, g)
                    ids.append(rid)
            self.steps.append(StepState(ids))
        self.version = 0
        # Runs by state, kept as states change (the status file shows them each second:
        # counting every run of the job each time grew with the job, 27 ms at 200,000
        # runs), and the ok runs of the steps trained (counted once, at step_done)
        self._states = Counter({"pending": len(self.runs)})
        self._trained_before = 0
        self.work = WorkLedger(num_steps=num_steps, groups_per_step=prompts_per_step,
                               group_size=group_size)

    # -- rollout side ----------------------------------------------------------------
    def allowed_steps(self) -> range:
        """Steps whose runs may start: not yet trained, within the staleness bound."""
        return range(self.version, min(self.num_steps, self.version + self.staleness + 1))

    def pending(self) -> list[RunEntry]:
        return [self.runs[r] for s in self.allowed_steps() for r in self.steps[s].runs
                if self.runs[r].state == "pending"]

    def run_counts(self) -> dict[str, int]:
        """Runs by state, where `trained` counts the runs whose trajectories are all
        trained, live: the ok runs of the steps before the current version (on resume,
        every run of the steps a checkpoint holds), and in the step being trained each
        ok run once its last trajectory is (a rewound step's count drops back); `ok`
        counts the ended ok runs not yet trained."""
        counts = Counter(self._states)
        trained = self._trained_before + self.trained_in_step()
        counts["ok"] -= trained
        counts["trained"] += trained
        return {s: counts[s] for s in ("pending", "running", "ok", "failed", "timeout",
                                       "trained")}

    def trained_in_step(self) -> int:
        """The ok runs of the step being trained whose every trajectory is trained."""
        if self.version >= self.num_steps:
            return 0
        step = self.steps[self.version]
        done = Counter(step.trained_runs)
        return sum(1 for rid in step.runs if self.runs[rid].state == "ok"
                   and self.runs[rid].num_trajectories
                   and done[rid] >= self.runs[rid].num_trajectories)

    def future(self) -> int:
        return sum(len(s.runs) for s in self.steps[self.allowed_steps().stop:])

    def mark_trained_before(self, version: int) -> None:
        """Resume: the steps a checkpoint holds are trained; their runs are over."""
        self.version = version
        self.work.trained_before(version)
        for step in self.steps[:version]:
            for rid in step.runs:
                self._set_state(self.runs[rid], "trained")
        self._trained_before = 0  # those steps' runs are counted as "trained" themselves

    def _set_state(self, entry: RunEntry, state: str) -> None:
        self._states[entry.state] -= 1
        self._states[state] += 1
        entry.state = state

    def start(self, run_id: str) -> None:
        assert self.runs[run_id].state == "pending", self.runs[run_id]
        self._set_state(self.runs[run_id], "running")

    def restart(self, run_id: str) -> str:
        """An interrupted run gets a fresh attempt under a new id."""
        old = self.runs.pop(run_id)
        self._states[old.state] -= 1
        self._states["pending"] += 1
        new = RunEntry(run_id_of(old.step, old.prompt, old.member, old.attempt + 1),
                       old.step, old.prompt, old.member, attempt=old.attempt + 1)
        self.runs[new.run_id] = new
        runs = self.steps[old.step].runs
        runs[runs.index(run_id)] = new.run_id
        return new.run_id

    def finish(self, run_id: str, *, status: str, reward: float,
               trajectories: list[dict]) -> list[dict]:
        """Record a run's end; returns the trajectories that became trainable."""
        entry = self.runs[run_id]
        assert entry.state in ("running", "pending"), entry
        self._set_state(entry, status)
        entry.reward = reward
        entry.trajectories = trajectories if status == "ok" else []
        entry.num_trajectories, entry.tokens = len(entry.trajectories), _tokens(entry.trajectories)
        self.work.run_finished(step=entry.step,
                               group=entry.step * self.prompts + entry.prompt,
                               tokens=entry.tokens)
        group = [self.runs[r] for r in self.steps[entry.step].runs
                 if self.runs[r].prompt == entry.prompt]
        if any(r.state in ("pending", "running") for r in group):
            return []
        ok = [r for r in group if r.state == "ok"]
        if not ok:
            return []
        mean = sum(r.reward for r in ok) / len(ok)
        ready = []
        for r in ok:
            for traj in r.trajectories:
                ready.append(dict(traj, advantage=r.reward - mean))
            r.trajectories = []  # the ready queue holds them now
        self.steps[entry.step].ready.extend(ready)
        return ready

    # -- training side ---------------------------------------------------------------
    def next_microbatch(self, *, max_tokens: int, packing: str = "rows") -> list[dict]:
        """Ready trajectories of the step being trained, in arrival order, up to a budget
        of tokens computed (at least one). Rows: trajectory by trajectory, each its
        length. Tree: whole runs (a run's trajectories arrive together), each its
        tree's tokens (`treepack.tree_tokens`), so a run's shared prefixes are computed
        once."""
        if self.version >= self.num_steps:
            return []
        state = self.steps[self.version]
        out, used = [], 0
        while state.ready:
            take = 1
            if packing == "tree":
                rid = state.ready[0]["run_id"]
                while take < len(state.ready) and state.ready[take]["run_id"] == rid:
                    take += 1
                size = tree_tokens([state.ready[i] for i in range(take)])
            else:
                size = len(state.ready[0]["token_ids"])
            if out and used + size > max_tokens:
                break
            out.extend(state.ready.popleft() for _ in range(take))
            used += size
        state.handed_out += len(out)
        self.work.hand_out(self.version, _tokens(out))  # the ledger counts trajectory tokens
        return out

    def next_redo(self) -> Microbatch | None:
        """A micro-batch of a rewound step to train again (its stream index, itself)."""
        if self.version >= self.num_steps or not self.steps[self.version].redo:
            return None
        return self.steps[self.version].redo.popleft()

    def rewind_step(self, unfinished: Microbatch | None = None) -> int:
        """The current step's gradients were lost: every micro-batch trained so far (and
        `unfinished`, one handed out whose training failed) is trained again. Returns
        how many micro-batches will be trained again."""
        if self.version >= self.num_steps:
            return 0  # every step is trained: nothing to do again
        state = self.steps[self.version]
        again = list(state.batches) + list(state.redo) + ([unfinished] if unfinished else [])
        again.sort(key=lambda item: item[0])
        state.redo = deque(again)
        state.batches, state.trained_runs = [], []
        state.trained = state.trained_tokens = 0
        self.work.rewind(self.version)
        return len(again)

    def trained(self, batch: list[dict], *, index: int | None = None) -> None:
        state = self.steps[self.version]
        state.batches.append((index, batch))
        state.trained += len(batch)
        # (count_nonzero: a Python sum over a uint8 array would wrap at 256)
        state.trained_tokens += sum(int(np.count_nonzero(t["loss_mask"])) for t in batch)
        state.trained_runs.extend(t["run_id"] for t in batch)
        self.work.train_done(self.version, _tokens(batch))

    def step_complete(self) -> bool:
        if self.version >= self.num_steps:
            return False
        state = self.steps[self.version]
        # (the ledger's count: the training loop asks every 50 ms while it waits, and
        # looking at every run of the step took 1.9 ms at 20,000 runs)
        ended = self.work.step_runs_left(self.version) == 0
        return (ended and not state.ready and not state.redo
                and state.trained == state.handed_out)

    def step_done(self) -> int:
        """The optimizer stepped: the policy version advances. Returns the new version."""
        self.steps[self.version].batches = []  # never trained again
        self._trained_before += sum(1 for rid in self.steps[self.version].runs
                                    if self.runs[rid].state == "ok")
        self.version += 1
        return self.version

    def done(self) -> bool:
        return self.version >= self.num_steps

    def ready_tokens(self) -> int:
        return int(self.work.ready[self.version]) if self.version < self.num_steps else 0

    def tokens_per_run(self, step: int) -> float | None:
        """The mean tokens of the ended ok runs of `step` (every trajectory's, as the
        ledger counts a run's work); None until one has ended."""
        if not 0 <= step < self.num_steps:
            return None
        toks = [self.runs[r].tokens for r in self.steps[step].runs
                if self.runs[r].num_trajectories]
        return sum(toks) / len(toks) if toks else None


def _tokens(trajectories: list[dict]) -> int:
    """The work a trajectory stands for, as the ledger counts it: its tokens."""
    return sum(len(t["token_ids"]) for t in trajectories)

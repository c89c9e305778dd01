"""The training loop: streaming micro-batches, one optimizer step per batch.

Each micro-batch is the next ready trajectories of the step being trained, in arrival
order, up to `training.microbatch_tokens` computed (tree packing: whole runs, each its
prefix tree's tokens; or, after a member was lost, the step's
micro-batches again: `StepBook.rewind_step`); it is written to its stream file and
trained by the world's members. Once the step's every run has ended and every
trajectory handed out is trained, the optimizer steps, the new weights are published
and loaded by every rollout server (`Handoffs.load_weights_everywhere`; with
`rollout.weight_sync: stream` the ranks send them to the servers, `runtime.wsync`, and
servers a round failed are restarted, or synced again before the next micro-batch
when a lost rank broke the round), the step's
figures go to metrics.jsonl, TensorBoard and the `step` event, and a checkpoint is
taken (every `training.checkpoint_every_steps`). A training command that fails because
a member was lost rebuilds the world and rewinds the step (`Recovery`).
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from shlex import quote
from typing import TYPE_CHECKING

from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.errors import UserError
from gyre_slurm.models import tiny
from gyre_slurm.runtime import checkpoint
from gyre_slurm.runtime.book import Microbatch
from gyre_slurm.runtime.control import CommandError
from gyre_slurm.runtime.handoff import Handoffs
from gyre_slurm.runtime.job import JobState
from gyre_slurm.runtime.recovery import Recovery
from gyre_slurm.runtime.world import TrainWorld
from gyre_slurm.traj.records import token_digest

if TYPE_CHECKING:
    from gyre_slurm.runtime.metrics import MetricsLog
    from gyre_slurm.runtime.wsync import WeightStream


NON_FINITE = "non-finite gradient norm"  # why a step trained nothing
NO_RUN_OK = "no run ended ok"
NO_TOKENS = "no token to train"  # runs ended ok, none with a generated token


class TrainingDiverged(UserError):
    """`faults.max_skipped_steps` optimizer steps in a row had a non-finite gradient
    norm: the job stops (a diverged model would take the rest of it training nothing)."""


class TrainingStalled(UserError):
    """`faults.max_skipped_steps` steps in a row had no run that ended ok (a broken agent
    or environment, a run timeout too short): nothing to train, the job stops."""


class MicrobatchFailed(Exception):
    """Training a micro-batch failed with `error`; `microbatch` is (stream index, batch),
    trained again once the world is rebuilt."""

    def __init__(self, error: CommandError, microbatch: Microbatch):
        super().__init__(str(error))
        self.error, self.microbatch = error, microbatch


class TrainingLoop:
    def __init__(self, *, job: JobState, world: TrainWorld, recovery: Recovery,
                 handoffs: Handoffs, metrics: MetricsLog, wsync: WeightStream | None = None):
        self.job, self.world, self.recovery, self.handoffs = job, world, recovery, handoffs
        self.wsync = wsync  # rollout.weight_sync: stream (None: file)
        self.metrics = metrics  # metrics.jsonl and TensorBoard
        self.train_rate: list[float] = []  # tokens/s per cell of each micro-batch
        self.step_signals: dict[int, dict] = {}  # stream index -> its micro-batch's sums
        self.rewards: list[dict] = []  # per step: mean reward, ok runs
        self.skipped: list[tuple[int, str]] = []  # steps in a row that trained nothing

    def tokens_per_cell_s(self, prior: float) -> float:
        """Measured training speed of one cell (the median of the last 20 micro-batches);
        `prior` (the config's) until a micro-batch has been measured."""
        return statistics.median(self.train_rate[-20:]) if self.train_rate else prior

    async def run(self) -> None:
        book, world = self.job.book, self.world
        while not book.done():
            async with world.lock:
                try:
                    if self.wsync is not None and self.wsync.pending and world.members:
                        await self.streamed(self.wsync.resync_pending())  # a broken round's
                    trained = await self.train_one() if world.members else False
                    if not trained and world.members and book.step_complete():
                        await self.finish_step()
                        await self.checkpoint()
                        self.check_progress()
                        continue
                except MicrobatchFailed as failed:  # a member lost? rebuild and rewind
                    await self.recovery.after_training_error(failed.error, failed.microbatch)
                    continue
                except CommandError as exc:
                    await self.recovery.after_training_error(exc, None)
                    continue
            if not trained:
                await asyncio.sleep(0.05)

    async def train_one(self) -> bool:
        """Train the next micro-batch, if one is ready; whether one was."""
        book, cfg, world = self.job.book, self.job.cfg, self.world
        step = book.version
        again = book.next_redo()  # a rewound step's micro-batch: same file, again
        if again is not None:
            index, batch = again
        else:
            batch = book.next_microbatch(max_tokens=int(cfg.training.microbatch_tokens),
                                         packing=cfg.training.packing)
            if not batch:
                return False
            index = book.steps[step].handed_out
        t0 = time.monotonic()
        try:
            stats = await world.train_microbatch(batch, self.job.rd.stream_file(step, index),
                                                 packing=cfg.training.packing)
        except CommandError as exc:
            raise MicrobatchFailed(exc, (index, batch)) from exc
        lengths = [len(t["token_ids"]) for t in batch]
        tokens = sum(lengths)
        # hashed off the loop (120 ms a 1.4M-token trajectory), before the book counts it
        digests = await asyncio.to_thread(lambda: [token_digest(t["token_ids"]) for t in batch])
        if cfg.trainer.pace:  # emulated accelerators: see TrainerConfig.pace
            pace = cfg.training.node_tokens_per_s
            computed = stats.get("fed_tokens", tokens)  # positions the trainer computed
            hold = computed / (pace * len(world.members)) - (time.monotonic() - t0)
            if hold > 0:
                await asyncio.sleep(hold)
        dt = time.monotonic() - t0
        cells = max(1, len(world.members) // cfg.cluster.cell_nodes)
        self.train_rate.append(tokens / max(dt, 1e-6) / cells)
        book.trained(batch, index=index)
        self.step_signals[index] = stats  # a micro-batch trained again replaces its sums
        # Each trajectory's run, length and token digest: what the micro-batch trained,
        # kept after its file goes (training.keep_microbatch_steps)
        self.job.rd.event("microbatch", step=step, index=index,
                          runs=[t["run_id"] for t in batch], tokens=tokens,
                          lengths=lengths, digests=digests,
                          members=list(world.members), seconds=dt, stats=stats,
                          again=again is not None)
        return True

    async def finish_step(self) -> None:
        """The optimizer steps; the new policy is published and loaded everywhere."""
        from gyre_slurm.runtime.metrics import step_figures
        from gyre_slurm.train.metrics import merge_all

        book, rd = self.job.book, self.job.rd
        step = book.version
        state = book.steps[step]
        t0 = time.monotonic()
        publish = None if self.wsync is not None else tiny.weights_dir(rd.path, step + 1)
        # 0 tokens: the ranks skip the update (AdamW would move the weights on zero
        # gradients, by momentum and weight decay); the version advances all the same
        stats = await self.world.optimizer_step(publish_dir=publish,
                                                num_step_tokens=state.trained_tokens)
        figures = step_figures(book, step, merge_all(self.step_signals.values()),
                               grad_norm=stats.get("grad_norm"))
        # A step that trained nothing: no run of it ended ok, or those that did had no
        # token to train, or its update was dropped (a non-finite gradient norm).
        ok = any(book.runs[r].state == "ok" for r in state.runs)
        why = (NO_RUN_OK if not ok else NO_TOKENS if not state.trained_tokens
               else NON_FINITE if stats.get("skipped") else None)
        if why is not None:
            self.skipped.append((step, why))
            rd.event("step_skipped", step=step, why=why, in_a_row=len(self.skipped),
                     grad_norm=str(stats.get("grad_norm")))
        else:
            self.skipped.clear()
        self.step_signals.clear()
        version = book.step_done()
        self.metrics.write(step=step, version=version, figures=figures)
        keep = self.job.cfg.training.keep_microbatch_steps
        if keep > 0:  # what ranks read is trained and in the events: the files may go
            before = step + 1 - keep
            try:
                removed = await asyncio.to_thread(rd.prune_stream, before_step=before)
            except OSError as exc:  # the files stay; the job goes on (the next step retries)
                rd.event("microbatches_prune_failed", before_step=before,
                         error=f"{type(exc).__name__}: {exc}")
            else:
                if removed:
                    rd.event("microbatches_pruned", before_step=before, files=removed)
        try:
            if self.wsync is not None:  # the ranks send it to every serving server
                await self.streamed(self.wsync.publish(version))
            else:
                await self.handoffs.load_weights_everywhere(version)
        finally:  # the step is done even if a rank was lost while it was sent
            self._step_event(step, state, version, t0, stats, figures)

    def check_progress(self) -> None:
        """Stop the job after `faults.max_skipped_steps` steps in a row trained nothing,
        saying why and how to go on."""
        limit = self.job.cfg.faults.max_skipped_steps
        if not limit or len(self.skipped) < limit:
            return
        steps = [s for s, _ in self.skipped]
        more = (f"; or let the job go on through more such steps (faults.max_skipped_steps, "
                f"{limit} now; 0: never stop)")
        if all(why in (NO_RUN_OK, NO_TOKENS) for _, why in self.skipped):
            book, cfg = self.job.book, self.job.cfg
            ends = collections.Counter(book.runs[r].state for s in steps
                                       for r in book.steps[s].runs)
            counts = ", ".join(f"{n} {state}" for state, n in ends.most_common())
            head = (f"no run of steps {steps[0]}-{steps[-1]} ended ok ({counts})"
                    if all(why == NO_RUN_OK for _, why in self.skipped) else
                    f"the runs of steps {steps[0]}-{steps[-1]} ({counts}) gave no token to "
                    f"train: those that ended ok have no token the model generated (an "
                    f"agent that ends without calling the model?)")
            raise TrainingStalled(
                head + f": {len(steps)} steps in a row had nothing to train"
                + self._commonest_error(steps) + ". Their runs' "
                f"records are in {self.job.rd.runs_file} and the agents' output in "
                f"{self.job.rd.path / 'logs'}; runs end `timeout` after agent.run_timeout_s "
                f"= {cfg.agent.run_timeout_s:g} s" + more)
        first, rd = steps[0], self.job.rd
        if first == 0:  # the weights the run started from, before any update
            cfg = self.job.cfg
            source = (f"model.path {cfg.model.path}" if cfg.model.path
                      else "the tiny model the run made")
            raise TrainingDiverged(
                f"training skipped {len(steps)} optimizer steps in a row (steps 0-"
                f"{steps[-1]}) for a non-finite gradient norm from the first: the weights the "
                f"run started from ({source}; {tiny.weights_dir(rd.path, 0)}) give "
                f"non-finite gradients before any update changed them. Check them for NaN "
                f"or Inf values (a lower learning rate cannot help)" + more)
        # the weights of version `first` gave the first non-finite gradients: a checkpoint
        # of an earlier version (step_N holds version N) is from before the divergence
        before = sorted(p.name for p in rd.checkpoints.glob("step_*")
                        if p.name[5:].isdigit() and int(p.name[5:]) < first)
        if before:
            how = (f"write the name of a checkpoint from before it ({', '.join(before[-3:])} "
                   f"in {rd.checkpoints}) into {rd.checkpoints / 'latest'} and resume with a "
                   f"lower learning rate (gyre run --resume --run-dir "
                   f"{quote(str(rd.path))} --set optimizer.lr=...)")
        else:
            how = ("no checkpoint is from before it: start the run again (another --run-dir) "
                   "with a lower optimizer.lr")
        raise TrainingDiverged(
            f"training skipped {len(steps)} optimizer steps in a row (steps {first}-"
            f"{steps[-1]}) for a non-finite gradient norm: the model has diverged "
            f"by step {first}. To go on, {how}" + more)

    def _commonest_error(self, steps: list[int]) -> str:
        """What most of these steps' failed runs said (their records' `error`, first
        line): a model server's 502 names its cause there (NaN weights: "probability
        tensor contains inf/nan"), which the runs' states alone do not."""
        wanted, errors = set(steps), collections.Counter()
        for rec in read_jsonl(self.job.rd.runs_file):
            if (isinstance(rec, dict) and rec.get("step") in wanted
                    and rec.get("status") != "ok" and rec.get("error")):
                errors[str(rec["error"]).strip().splitlines()[0][:300]] += 1
        if not errors:
            return ""
        text, n = errors.most_common(1)[0]
        return f"; {n} of their runs ended with: {text}"

    def _step_event(self, step, state, version, t0, stats, figures) -> None:
        book, rd = self.job.book, self.job.rd
        rewards = [book.runs[r].reward for r in state.runs if book.runs[r].state == "ok"]
        mean = statistics.fmean(rewards) if rewards else float("nan")
        self.rewards.append({"step": step, "mean_reward": mean, "runs_ok": len(rewards)})
        rd.event("step", step=step, version=version, mean_reward=mean,
                 trajectories=state.trained, tokens=state.trained_tokens,
                 runs_ok=len(rewards), runs=len(state.runs),
                 seconds=time.monotonic() - t0, stats=stats, metrics=figures)

    async def streamed(self, round_) -> None:
        """Await a streamed round; the servers it failed that serve are restarted (a
        half-loaded model must not serve). A rank that broke it raises its error."""
        from gyre_slurm.runtime.wsync import SyncBroken

        try:
            outcome = await round_
        except SyncBroken as exc:
            self._restart(exc.failed)
            raise exc.error from exc
        self._restart(outcome)

    def _restart(self, outcome: dict) -> None:
        for sid, why in self.wsync.drain_failed(outcome):
            self.recovery.request_restart(sid.cell, sid,
                                          reason=f"streamed weight sync failed: {why}")

    async def checkpoint(self) -> None:
        """After every `training.checkpoint_every_steps` steps, and after the last; the
        older ones beyond `training.keep_checkpoints` go, except while steps in a row
        train nothing: the checkpoints from before a divergence are what a resume needs
        (`check_progress` names them)."""
        book, cfg = self.job.book, self.job.cfg
        if book.version % cfg.training.checkpoint_every_steps == 0 or book.done():
            await checkpoint.save(rd=self.job.rd, world=self.world, version=book.version,
                                  config_name=cfg.name, weight_sync=cfg.rollout.weight_sync,
                                  keep=0 if self.skipped else cfg.training.keep_checkpoints)

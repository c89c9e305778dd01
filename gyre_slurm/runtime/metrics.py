"""The training signals of a run, written per step (the coordinator's side).

    RUN_DIR/metrics.jsonl     one line per optimizer step: {"step", "version", "t", and
                              every figure of `gyre_slurm.train.metrics.step_metrics`}
    RUN_DIR/tensorboard/      TensorBoard event files: the same figures as scalars (tag =
                              key, x = step), the lag histogram as a histogram

metrics.jsonl is appended one whole line at a time (`common.fsio.append_jsonl`, like
events.jsonl). A resumed run trains again the steps after its checkpoint: their lines
appear twice and the last one counts (`read_metrics`); the TensorBoard writer opens
with `purge_step` = the resumed version, so TensorBoard drops the first life's events
of those steps. The event files are written by torch's `SummaryWriter` (TensorBoard's
own record format, appended and flushed after every step; a reader tolerates a torn
last record), so `tensorboard --logdir RUN_DIR` (or a parent of many run dirs) shows a
run while it trains.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre_slurm.common.fsio import append_jsonl, read_jsonl
from gyre_slurm.common.values import is_finite_number

if TYPE_CHECKING:
    from gyre_slurm.runtime.book import StepBook

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    def __init__(self, run_dir: Path, *, purge_step: int | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.tb_dir = Path(run_dir) / TENSORBOARD_DIR
        self._purge_step = purge_step
        self._tb = None

    def _writer(self):
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=self._purge_step)
        return self._tb

    def write(self, *, step: int, version: int, figures: dict[str, Any]) -> dict[str, Any]:
        """Append the step's line and its TensorBoard events; returns the line."""
        line = {"step": step, "version": version, "t": time.time(), **figures}
        append_jsonl(self.path, line)
        tb = self._writer()
        for tag, value in figures.items():
            if is_finite_number(value):
                tb.add_scalar(tag, value, global_step=step)
        hist = figures.get("staleness/lag_hist") or {}
        if hist:
            _add_lag_histogram(tb, hist, step)
        tb.flush()
        return line

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _add_lag_histogram(tb, hist: dict[str, int], step: int) -> None:
    """The lag histogram as TensorBoard's raw histogram: one bucket per lag value."""
    lags = sorted(int(k) for k in hist)
    counts = [hist[str(k)] for k in lags]
    total = sum(counts)
    tb.add_histogram_raw(
        "staleness/lag", min=lags[0], max=lags[-1], num=total,
        sum=float(sum(k * n for k, n in zip(lags, counts))),
        sum_squares=float(sum(k * k * n for k, n in zip(lags, counts))),
        bucket_limits=[k + 0.5 for k in lags], bucket_counts=counts, global_step=step)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics lines of a run, one per step (the last one written for a step that
    was trained twice: a resumed run's), in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in read_jsonl(Path(run_dir) / METRICS_FILE):
        if isinstance(line.get("step"), int):
            by_step[line["step"]] = line
    return [by_step[s] for s in sorted(by_step)]


def step_figures(book: StepBook, step: int, sums: dict[str, Any], *,
                 grad_norm: float | None) -> dict[str, Any]:
    """`train.metrics.step_metrics` of step `step` of a `StepBook` (call it before
    `step_done`, which forgets the step's micro-batches): `sums` are its micro-batches'
    merged measurements."""
    from gyre_slurm.train.metrics import step_metrics

    state = book.steps[step]
    trajectories = [t for _, batch in state.batches for t in batch]
    groups: dict[int, list[float]] = {}
    for rid in state.runs:
        run = book.runs[rid]
        if run.state == "ok":
            groups.setdefault(run.prompt, []).append(run.reward)
    return step_metrics(sums=sums, trajectories=trajectories, version=step, groups=groups,
                        grad_norm=grad_norm)

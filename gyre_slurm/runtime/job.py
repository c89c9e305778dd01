"""The state a running job's parts share, typed: `JobState` (held by the coordinator and
handed, with their other dependencies named, to the handoffs and the recovery),
`ServerId` (a rollout server's id: its cell, node and index on the node) and
`JobFailure` (the error that stops the job, set once by whichever part meets it)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.runtime.book import StepBook
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.sched.cells import CellTable

if TYPE_CHECKING:
    from gyre_slurm.engines.client import EngineClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class ServerId:
    """Rollout server `index` of node `node` in cell `cell`; `str()` is the id the
    gateway routes by and events name (`cell2-n5-s0`)."""

    cell: int
    node: int
    index: int

    def __str__(self) -> str:
        return f"cell{self.cell}-n{self.node}-s{self.index}"


class JobFailure:
    """The error that stops the job. The first one set wins; `raised()` (awaited beside
    the coordinator's loops) raises it as soon as it is set."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._set = asyncio.Event()

    def set(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self._set.set()

    async def raised(self) -> None:
        await self._set.wait()
        assert self.error is not None
        raise self.error


@dataclass(kw_only=True, eq=False)
class JobState:
    """What the coordinator, its handoffs and its recovery share while the job runs."""

    cfg: GyreConfig
    rd: RunDir
    book: StepBook
    table: CellTable
    t0: float = field(default_factory=time.time)  # events' `t_run_s` count from here
    # cell -> its rollout servers' engine clients (the gateway routes by str(ServerId))
    engine_clients: dict[int, dict[ServerId, EngineClient]] = field(default_factory=dict)
    busy_cells: set[int] = field(default_factory=set)  # a handoff or restart has them
    lost: set[int] = field(default_factory=set)  # nodes whose agents were lost
    heartbeats: dict[int, float] = field(default_factory=dict)  # node -> last beat
    engine_restarts: dict[ServerId, int] = field(default_factory=dict)
    # servers in a streamed weight-sync round (runtime.wsync): not health-checked, not
    # released, until the round has answered for them
    syncing: set[ServerId] = field(default_factory=set)
    failure: JobFailure = field(default_factory=JobFailure)
    tasks: set[asyncio.Task] = field(default_factory=set)  # cancelled at shutdown

    def now_s(self) -> float:
        """Seconds since the coordinator started (the cell table's clock)."""
        return time.time() - self.t0

    def nodes_of(self, cell: int) -> list[int]:
        n = self.cfg.cluster.cell_nodes
        return list(range(cell * n, (cell + 1) * n))

    def cell_of(self, node: int) -> int:
        return node // self.cfg.cluster.cell_nodes

    def server_ids(self, cell: int) -> list[ServerId]:
        return list(self.engine_clients.get(cell, {}))

    def spawn(self, coro: Coroutine, *, fails_job: bool = False) -> asyncio.Task:
        """Run `coro` in the background until it ends or the job shuts down; with
        `fails_job`, an exception it raises stops the job."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if fails_job:
            task.add_done_callback(self._fail_on_error)
        return task

    def _fail_on_error(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("recovery failed: %r", task.exception())
            self.failure.set(task.exception())

"""The rollout side of the simulator: runs on cells, with load-dependent speed.

Each cell keeps a *virtual clock* V that advances at the speed a run has on that cell
at its current load: rate(n) = 1 / ((1 - f) + f * (n + n_half) / (cap + n_half)),
where f is the share of a run's time spent waiting on the model, `cap` the cell's
capacity and n_half the load at which decode throughput is half its peak. A full cell
runs at rate 1 (the reference load the run durations are given at); a lighter cell runs
faster. A run placed at virtual time V0 with `w` seconds of work left finishes when V
reaches V0 + w, so a change of load touches no run, only the cell's clock
(processor-sharing simulation). Pure: time is passed in.
"""

from __future__ import annotations

import heapq

import numpy as np

from gyre_slurm.sched.waterlevel import rate_by_load

RUNNING = 2


class RolloutCells:
    def __init__(self, *, num_cells: int, capacity: int, llm_fraction: float,
                 half_load_runs: float, num_runs: int):
        self.capacity = capacity
        self.rate_by_load = rate_by_load(capacity=capacity, llm_fraction=llm_fraction,
                                         half_load_runs=half_load_runs)
        self.vclock = np.zeros(num_cells)
        self.t_last = np.zeros(num_cells)
        self.stall_until = np.zeros(num_cells)
        self.load = np.zeros(num_cells, dtype=np.int64)
        self.busy_cell_s = np.zeros(num_cells)  # integral of load / capacity
        self.epoch = np.zeros(num_cells, dtype=np.int64)
        self.heaps: list[list[tuple[float, int]]] = [[] for _ in range(num_cells)]
        self.run_cell = np.full(num_runs, -1, dtype=np.int64)
        self.run_vfinish = np.zeros(num_runs)

    @property
    def rate_max(self) -> float:
        return float(self.rate_by_load[1]) if self.capacity >= 1 else 1.0

    def advance(self, cell: int, now_s: float) -> None:
        start = max(self.t_last[cell], self.stall_until[cell])
        if now_s > start:
            dt = now_s - start
            n = self.load[cell]
            self.vclock[cell] += self.rate_by_load[n] * dt
            self.busy_cell_s[cell] += dt * n / self.capacity
        self.t_last[cell] = max(self.t_last[cell], now_s)

    def stall(self, cell: int, now_s: float, until_s: float) -> None:
        self.advance(cell, now_s)
        self.stall_until[cell] = max(self.stall_until[cell], until_s)
        self.epoch[cell] += 1

    def place(self, run: int, cell: int, now_s: float, work_s: float) -> None:
        self.advance(cell, now_s)
        vfin = self.vclock[cell] + work_s
        self.run_cell[run] = cell
        self.run_vfinish[run] = vfin
        heapq.heappush(self.heaps[cell], (vfin, run))
        self.load[cell] += 1
        self.epoch[cell] += 1

    def remove(self, run: int, now_s: float) -> float:
        """Take a run off its cell (lazily); returns its remaining work."""
        cell = int(self.run_cell[run])
        self.advance(cell, now_s)
        left = max(0.0, self.run_vfinish[run] - self.vclock[cell])
        self.run_cell[run] = -1
        self.load[cell] -= 1
        self.epoch[cell] += 1
        return left

    def next_finish(self, cell: int, status: np.ndarray) -> float | None:
        """Wall time at which the cell's next run finishes at the current load."""
        heap = self.heaps[cell]
        while heap and not self._valid(heap[0], cell, status):
            heapq.heappop(heap)
        if not heap:
            return None
        start = max(self.t_last[cell], self.stall_until[cell])
        rate = self.rate_by_load[self.load[cell]]
        return start + max(0.0, heap[0][0] - self.vclock[cell]) / rate

    def pop_finished(self, cell: int, now_s: float, status: np.ndarray) -> list[int]:
        self.advance(cell, now_s)
        heap, done = self.heaps[cell], []
        limit = self.vclock[cell] + 1e-6
        while heap:
            if not self._valid(heap[0], cell, status):
                heapq.heappop(heap)
            elif heap[0][0] <= limit:
                done.append(heapq.heappop(heap)[1])
            else:
                break
        for run in done:
            self.run_cell[run] = -1
            self.load[cell] -= 1
        if done:
            self.epoch[cell] += 1
        return done

    def _valid(self, entry: tuple[float, int], cell: int, status: np.ndarray) -> bool:
        vfin, run = entry
        return (self.run_cell[run] == cell and status[run] == RUNNING
                and self.run_vfinish[run] == vfin)

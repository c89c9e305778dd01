"""The coordinator's side of the training world: who trains, in which generation.

Every change of membership is a rebuild: the old world's members flush (their
accumulated gradients are summed onto the old rank 0, so a member may leave mid-step),
then every member of the new world joins generation N+1 — a fresh `PrefixStore("genN/")`
on the coordinator's one long-lived TCPStore — and receives weights and optimizer state
from a member that stays (`src_rank`). When no member stays (colocate's phases, a first
world, a resume), the state travels through a file: the last world's rank 0 saves it
to `RUN_DIR/trainer_state/state.pt`, and the next world loads it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gyre_slurm.runtime.control import ControlClient
from gyre_slurm.runtime.fsio import write_json_atomic


class TrainWorld:
    def __init__(self, *, run_dir: Path, store_host: str, store_port: int,
                 agents: dict[int, ControlClient], init_weights: Path,
                 checkpoint: Path | None = None):
        self.run_dir = run_dir
        self.store_host, self.store_port = store_host, store_port
        self.agents = agents
        self.members: list[int] = []  # node indices; rank = position
        self.generation = 0
        self.init_weights = init_weights
        self.handover: Path | None = checkpoint  # state file for a world nobody stays in
        self.lock = asyncio.Lock()  # held per micro-batch / step / rebuild

    @property
    def state_file(self) -> Path:
        return self.run_dir / "trainer_state" / "state.pt"

    async def _all(self, nodes, path: str, payload=None, per_rank=None) -> list[dict]:
        calls = []
        for rank, node in enumerate(nodes):
            body = dict(payload or {})
            if per_rank:
                body.update(per_rank(rank, node))
            calls.append(self.agents[node].post(path, body))
        return list(await asyncio.gather(*calls))

    async def rebuild(self, members: list[int]) -> dict:
        """Change membership (callers hold `lock`). Returns timings per phase."""
        old, new = list(self.members), list(members)
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        staying = [n for n in old if n in new]
        if old:  # gradients so far end up on a member that stays (or the handover file)
            keep = old.index(staying[0]) if staying else 0
            await self._all(old, "/cmd/flush", {"keep_rank": keep})
        if old and not staying:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            await self.agents[old[0]].post("/cmd/save", {"path": str(self.state_file)})
            self.handover = self.state_file
        timings["flush_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        leaving = [n for n in old if n not in new]
        if leaving:
            await self._all(leaving, "/cmd/leave")
        self.members = new
        if new:
            self.generation += 1
            src = new.index(staying[0]) if staying else 0
            checkpoint = None if staying else self.handover
            results = await self._all(new, "/cmd/join", {
                "generation": self.generation, "world_size": len(new),
                "store_host": self.store_host, "store_port": self.store_port,
                "src_rank": src, "init_weights": str(self.init_weights),
                "checkpoint": str(checkpoint) if checkpoint else None,
            }, per_rank=lambda rank, _node: {"rank": rank})
            for res in results:
                for key, value in res.items():
                    if isinstance(value, (int, float)):
                        timings[key] = max(timings.get(key, 0.0), float(value))
        timings["rebuild_s"] = time.monotonic() - t1
        return timings

    async def train_microbatch(self, batch: list[dict], path: Path) -> dict:
        write_json_atomic(path, batch)
        results = await self._all(self.members, "/cmd/train_mb",
                                  {"path": str(path), "num_step_tokens": 1})
        merged: dict[str, float] = {}
        for res in results:
            for key, value in res.items():
                if isinstance(value, (int, float)):
                    merged[key] = merged.get(key, 0.0) + float(value)
        return merged

    async def optimizer_step(self, *, publish_dir: Path, num_step_tokens: int) -> dict:
        results = await self._all(self.members, "/cmd/step", {
            "num_step_tokens": num_step_tokens},
            per_rank=lambda rank, _n: {"publish_dir": str(publish_dir) if rank == 0 else None})
        return results[0]

    async def save(self, path: Path) -> None:
        await self.agents[self.members[0]].post("/cmd/save", {"path": str(path)})

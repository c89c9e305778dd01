"""The coordinator's side of the training world: who trains, in which generation.

Every change of membership is a rebuild: the old world's members flush (their
accumulated gradients are summed onto the old rank 0, so a member may leave mid-step),
then every member of the new world joins generation N+1 — a fresh `PrefixStore("genN/")`
on the coordinator's one long-lived TCPStore — and receives weights and optimizer state
from a member that stays (`src_rank`). When no member stays (colocate's phases, a first
world, a resume), the state travels through a file: the last world's rank 0 saves it
to `RUN_DIR/trainer_state/state.pt`, and the next world loads it.

Ranks: a node holds `ranks_per_node` ranks (node at position i of the members: ranks
i*R .. i*R+R-1). A world holds whole replicas (`replica_nodes` nodes each, TP x PP
ranks): training nodes beyond the last whole replica wait, outside the world, until
more arrive (`nodes` lists them all, `members` those in the world).

A lost member (its node agent died: `drop`) cannot flush: its share of the step's
accumulated gradient is gone, and a collective it was in may have failed half-way (an
optimizer step applied by some members only, or a join that waits for it). So the
survivors drop their state too (`reset_trainer`: at once, even while blocked), and the new
world — the training nodes that are left — starts from the state of the last optimizer
step, read from the checkpoint taken right after it (or the initial weights before the
first step); the coordinator trains the step's micro-batches again (`StepBook.rewind_step`).

Resharding backends (Megatron: a model sharded TP x PP) cannot broadcast their state
into another layout: at every rebuild the old world saves a `dist_checkpointing`
checkpoint together (model, optimizer, version and the gradients accumulated so far),
and every member of the new world loads it resharded to its layout
(`RUN_DIR/trainer_state/gen<N>/`; the previous one is removed once the next world
stands).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from gyre_slurm.runtime.control import ControlClient
from gyre_slurm.train.layout import HandoffPlan, layout, plan_handoff


class TrainWorld:
    def __init__(self, *, run_dir: Path, store_host: str, store_port: int,
                 agents: dict[int, ControlClient], init_weights: Path,
                 checkpoint: Path | None = None, ranks_per_node: int = 1,
                 replica_nodes: int = 1, reshard: bool = False, backend: str = "gloo"):
        self.run_dir = run_dir
        self.store_host, self.store_port = store_host, store_port
        self.agents = agents
        self.ranks_per_node, self.replica_nodes = ranks_per_node, replica_nodes
        self.reshard, self.backend = reshard, backend
        self.nodes: list[int] = []  # every node in the training role
        self.members: list[int] = []  # node indices in the world; first rank = position * R
        self.generation = 0
        self.init_weights = init_weights
        self.handover: Path | None = checkpoint  # state file for a world nobody stays in
        # The members all hold the trainer state: False from the moment a rebuild begins
        # until every member has joined (a joiner has no state until the broadcast).
        self.standing = False
        self.lock = asyncio.Lock()  # held per micro-batch / step / rebuild

    @property
    def state_file(self) -> Path:
        return self.run_dir / "trainer_state" / "state.pt"

    @property
    def state_name(self) -> str:
        """A checkpoint's trainer state: a file, or a dist_checkpointing directory."""
        return "trainer" if self.reshard else "trainer.pt"

    async def _all(self, nodes: list[int], path: str, payload: dict | None = None,
                   per_rank: Callable[[int, int], dict] | None = None) -> list[dict]:
        calls = []
        for rank, node in enumerate(nodes):
            body = dict(payload or {})
            if per_rank:
                body.update(per_rank(rank, node))
            calls.append(self.agents[node].post(path, body))
        return list(await asyncio.gather(*calls))

    async def rebuild(self, nodes: list[int]) -> dict:
        """Change membership (callers hold `lock`). Returns timings per phase."""
        self.nodes = list(nodes)
        whole = len(nodes) // self.replica_nodes * self.replica_nodes
        old, new = list(self.members), list(nodes[:whole])
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        if old == new:
            return timings
        plan = self._plan(old, new)
        self.standing = False
        previous = self.handover
        if old and self.reshard:  # the whole state, resharded by whoever loads it
            path = self.run_dir / "trainer_state" / f"gen{self.generation:06d}"
            path.parent.mkdir(parents=True, exist_ok=True)
            await self._all(old, "/cmd/save", {"path": str(path)})
            self.handover = path
        elif old:  # gradients so far end up on a member that stays (or the handover file)
            keep = plan.keep_old_rank if plan.staying else 0
            await self._all(old, "/cmd/flush", {"keep_rank": keep})
        if old and not plan.staying and not self.reshard:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            await self.agents[old[0]].post("/cmd/save", {"path": str(self.state_file)})
            self.handover = self.state_file
        timings["flush_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        if plan.leaving:
            await self._all([node for node, _ in plan.leaving], "/cmd/leave")
        self.members = new
        if new:
            timings.update(await self._join(new, plan))
            self.standing = True
        timings["rebuild_s"] = time.monotonic() - t1
        if (self.reshard and previous is not None and previous != self.handover
                and previous.parent == self.run_dir / "trainer_state"):
            shutil.rmtree(previous, ignore_errors=True)  # the new world stands without it
        return timings

    def _plan(self, old: list[int], new: list[int]) -> HandoffPlan:
        """`train.layout.plan_handoff` over the members, node by node in their order (a
        member's first rank is its position x ranks_per_node). A resharding trainer keeps
        no member's state across a rebuild: every state goes through the handover."""
        R = self.ranks_per_node
        plan = plan_handoff(layout(old, nodes_per_cell=1, ranks_per_node=R) if old else None,
                            layout(new, nodes_per_cell=1, ranks_per_node=R))
        if self.reshard:
            plan = dataclasses.replace(plan, staying=(), keep_old_rank=None, src_rank=None)
        return plan

    async def _join(self, new: list[int], plan: HandoffPlan) -> dict:
        """Every member joins the next generation; the slowest member's phase timings."""
        self.generation += 1
        checkpoint = None if plan.staying else self.handover
        results = await self._all(new, "/cmd/join", {
            "generation": self.generation, "world_size": len(new) * self.ranks_per_node,
            "store_host": self.store_host, "store_port": self.store_port,
            "backend": self.backend, "src_rank": plan.src_rank if plan.staying else 0,
            "init_weights": str(self.init_weights),
            "checkpoint": str(checkpoint) if checkpoint else None,
        }, per_rank=lambda _pos, node: {"rank": plan.new_ranks[(node, 0)]})
        timings: dict[str, float] = {}
        for res in results:
            for key, value in res.items():
                if isinstance(value, (int, float)):
                    timings[key] = max(timings.get(key, 0.0), float(value))
        return timings

    async def drop(self, lost: list[int], *, restore: Path | None) -> dict:
        """Rebuild without the `lost` nodes (callers hold `lock`). If one of them was a
        member, every survivor leaves and the new world loads `restore` (the state after
        the last optimizer step; None: `init_weights` and a fresh optimizer, before the
        first step). Returns timings, with `restarted: True` when the step's gradients
        were dropped."""
        gone = set(lost)
        rest = [n for n in self.nodes if n not in gone]
        if not gone & set(self.members):
            self.nodes = [n for n in self.nodes if n not in gone]
            return await self.rebuild(rest)
        survivors = [n for n in self.members if n not in gone]  # may wait on the lost one
        await asyncio.gather(*(self.agents[n].post("/cmd/reset_trainer") for n in survivors))
        self.members, self.nodes = [], []
        self.handover = restore
        timings = await self.rebuild(rest)
        timings["restarted"] = True
        return timings

    async def train_microbatch(self, batch: list[dict], path: Path, *,
                               packing: str = "tree") -> dict:
        """Train a micro-batch on every member; their sums, merged exactly
        (`gyre_slurm.train.metrics.merge`: counts and sums add, maxima take the max)."""
        from gyre_slurm.traj import mbfile
        from gyre_slurm.train.metrics import merge_all

        # Off the event loop: at the presets' sizes a micro-batch is gigabytes of tokens,
        # and the loop serves the gateway's calls meanwhile
        await asyncio.to_thread(mbfile.write, path, batch)
        results = await self._all(self.members, "/cmd/train_mb",
                                  {"path": str(path), "num_step_tokens": 1,
                                   "packing": packing})
        return merge_all(results)

    async def optimizer_step(self, *, publish_dir: Path | None, num_step_tokens: int) -> dict:
        # With a `publish_dir`, every rank takes part in publishing (a sharded model is
        # gathered first) and the world's rank 0 writes; None: nothing is written (the
        # policy is streamed: gyre_slurm.runtime.wsync).
        results = await self._all(self.members, "/cmd/step", {
            "num_step_tokens": num_step_tokens,
            "publish_dir": None if publish_dir is None else str(publish_dir)})
        return results[0]

    async def save(self, path: Path, *, node: int | None = None) -> None:
        """A checkpoint of the trainer state (every member takes part when resharding;
        else the world's first member, or `node`, which holds the same state)."""
        if self.reshard:
            await self._all(self.members, "/cmd/save", {"path": str(path)})
        else:
            node = self.members[0] if node is None else node
            writer = self.members.index(node) * self.ranks_per_node
            await self.agents[node].post("/cmd/save", {"path": str(path), "writer": writer})

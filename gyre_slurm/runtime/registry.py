"""The coordinator's side of the control channel (`runtime.control`): node agents
register (`POST /agent/register`: their node index and URL) and send heartbeats
(`POST /agent/heartbeat`). A registered agent gets a `ControlClient`; a heartbeat is
recorded unless its node was declared lost (a lost agent stays lost)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gyre_slurm.errors import UserError
from gyre_slurm.runtime.control import ControlClient, make_app
from gyre_slurm.runtime.job import JobState


class AgentRegistry:
    def __init__(self, *, job: JobState):
        self.job = job
        self.agents: dict[int, ControlClient] = {}  # node -> its agent, once registered
        self.registered = asyncio.Event()  # every node agent has registered
        self.gpus: dict[int, int | None] = {}  # node -> the GPUs its agent sees (None: ?)
        self.runner: web.AppRunner | None = None
        self.url: str | None = None

    async def start(self, host: str) -> str:
        """Serve the control endpoints on `host`; returns their URL."""
        app = make_app(self.job.rd.secret())
        app.router.add_post("/agent/register", self.on_register)
        app.router.add_post("/agent/heartbeat", self.on_heartbeat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, 0)
        await site.start()
        self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def on_register(self, request: web.Request) -> web.Response:
        job = self.job
        body = await request.json()
        node, num_nodes = int(body["node"]), job.cfg.cluster.num_nodes
        if not 0 <= node < num_nodes:
            return web.json_response({"error": f"node {node} is not in this job "
                                      f"(0..{num_nodes - 1})"}, status=400)
        self.agents[node] = ControlClient(body["url"], job.rd.secret(), node=node)
        gpus = body.get("gpus")
        self.gpus[node] = gpus if isinstance(gpus, int) and not isinstance(gpus, bool) else None
        job.heartbeats[node] = time.monotonic()
        job.rd.event("agent_registered", node=node, url=body["url"], pid=body.get("pid"),
                     gpus=body.get("cuda_visible_devices"))
        if len(self.agents) == num_nodes:
            self.registered.set()
        return web.json_response({})

    def check_gpus(self) -> None:
        """Every node sees the `cluster.gpus_per_node` GPUs the config asks for (as its
        agent counted them: `agent.visible_gpus`); else a UserError naming the nodes, before
        a rank or server starts. Without it a node without GPUs failed at the first
        training join, deep in a rank ("Torch not compiled with CUDA enabled")."""
        want = self.job.cfg.cluster.gpus_per_node
        short = {n: g for n, g in sorted(self.gpus.items()) if g is not None and g < want}
        if not want or not short:
            return
        nodes = ", ".join(f"node {n} has {g}" for n, g in list(short.items())[:8])
        more = f" and {len(short) - 8} more" if len(short) > 8 else ""
        raise UserError(
            f"cluster.gpus_per_node = {want}, but {len(short)} of the job's "
            f"{len(self.gpus)} nodes see fewer GPUs ({nodes}{more}; counted from "
            f"CUDA_VISIBLE_DEVICES, or the /dev/nvidiaN devices where it is unset): set "
            f"cluster.gpus_per_node to what a node has (0 runs on CPU), or ask Slurm for "
            f"them (gyre submit --gpus-per-node {want}, or sbatch --gpus-per-node={want})")

    async def on_heartbeat(self, request: web.Request) -> web.Response:
        body = await request.json()
        node = int(body["node"])
        if node not in self.agents:  # only registered agents beat
            return web.json_response({"error": f"node {node} never registered"}, status=400)
        if node not in self.job.lost:  # a lost agent stays lost
            self.job.heartbeats[node] = time.monotonic()
        return web.json_response({})

    async def stop(self) -> None:
        for client in self.agents.values():
            await client.close()
        if self.runner is not None:
            await self.runner.cleanup()

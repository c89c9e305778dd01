"""The coordinator's side of the control channel (`runtime.control`): node agents
register (`POST /agent/register`: their node index and URL) and send heartbeats
(`POST /agent/heartbeat`). A registered agent gets a `ControlClient`; a heartbeat is
recorded unless its node was declared lost (a lost agent stays lost)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gyre_slurm.runtime.control import ControlClient, make_app
from gyre_slurm.runtime.job import JobState


class AgentRegistry:
    def __init__(self, *, job: JobState):
        self.job = job
        self.agents: dict[int, ControlClient] = {}  # node -> its agent, once registered
        self.registered = asyncio.Event()  # every node agent has registered
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
        job.heartbeats[node] = time.monotonic()
        job.rd.event("agent_registered", node=node, url=body["url"], pid=body.get("pid"),
                     gpus=body.get("cuda_visible_devices"))
        if len(self.agents) == num_nodes:
            self.registered.set()
        return web.json_response({})

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

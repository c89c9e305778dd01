"""The node agent: one long-lived process per node, doing what the coordinator says.

    python -m gyre_slurm.runtime.agent --run-dir DIR --node-index I --addr 127.0.10.N \
        --coordinator http://HOST:PORT

It serves authenticated commands (`gyre_slurm.runtime.control`) on its node's address,
registers with the coordinator, and sends a heartbeat every `runtime.heartbeat_s`. It
owns this node's part of a rollout server (an engine process, kept across handoffs and
released / resumed) and of a training rank (a `TrainerWorker` kept in this process, so
a handoff rebuilds process groups without starting Python again). Trainer commands run
one at a time on one thread: collectives are issued in the order they arrive. If the
coordinator stays unreachable for `orphan_s`, the agent stops its engine and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from gyre_slurm.config.schema import load_config
from gyre_slurm.models.tiny import weights_dir
from gyre_slurm.runtime.control import ControlClient, make_app
from gyre_slurm.runtime.rundir import RunDir

log = logging.getLogger(__name__)
ORPHAN_S = 30.0


class NodeAgent:
    def __init__(self, *, run_dir: Path, node_index: int, addr: str, coordinator_url: str):
        self.rd = RunDir(run_dir)
        self.cfg = load_config(self.rd.path / "config.yaml")
        self.node_index, self.addr = node_index, addr
        self.secret = self.rd.secret()
        self.coordinator = ControlClient(coordinator_url, self.secret, timeout_s=10)
        self.engine = None  # gyre_slurm.engines.launcher EngineProcess
        self.engine_client = None
        self.worker = None  # gyre_slurm.train.worker.TrainerWorker, made on first use
        self.trainer_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.stopping = asyncio.Event()
        self.last_contact = time.monotonic()

    # -- server ----------------------------------------------------------------------
    async def serve(self) -> None:
        app = make_app(self.secret)
        app.router.add_post("/cmd/{name}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.addr, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://{self.addr}:{port}"
        # Engines inherit this process's environment, so the GPUs Slurm gave the step
        # (CUDA_VISIBLE_DEVICES) are the engine's; say which they are.
        await self.coordinator.post("/agent/register", {
            "node": self.node_index, "url": url, "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
        log.info("node agent %d serving on %s", self.node_index, url)
        beat = asyncio.create_task(self.heartbeat())
        # Import the trainer's libraries now, off the event loop, so that the first
        # handoff to training does not pay for them.
        asyncio.get_running_loop().run_in_executor(self.trainer_pool, self._worker)
        await self.stopping.wait()
        beat.cancel()
        await self.shutdown_engine()
        await runner.cleanup()
        await self.coordinator.close()

    async def heartbeat(self) -> None:
        while True:
            try:
                await self.coordinator.post("/agent/heartbeat", {"node": self.node_index},
                                            timeout_s=5)
                self.last_contact = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - any failure is a missed beat
                if time.monotonic() - self.last_contact > ORPHAN_S:
                    log.error("coordinator unreachable for %.0fs (%s): exiting", ORPHAN_S, exc)
                    self.stopping.set()
                    return
            await asyncio.sleep(self.cfg.runtime.heartbeat_s)

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        handler = getattr(self, f"cmd_{name}", None)
        if handler is None:
            return web.json_response({"error": f"unknown command {name!r}"}, status=404)
        payload = await request.json() if request.can_read_body else {}
        try:
            result = await handler(**payload)
        except TypeError as exc:
            return web.json_response({"error": f"bad arguments for {name}: {exc}"}, status=400)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator
            log.exception("command %s failed", name)
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)
        return web.json_response(result or {})

    # -- engine ----------------------------------------------------------------------
    async def cmd_start_engine(self, *, version: int) -> dict:
        from gyre_slurm.engines import EngineClient, start_engine

        t0 = time.monotonic()
        if self.engine is None:
            self.engine = await asyncio.to_thread(
                start_engine, model_dir=self.rd.model_dir, host=self.addr,
                weights_dir=weights_dir(self.rd.path, version), version=version,
                secret_file=self.rd.secret_file,
                log_path=self.rd.log(f"engine-node{self.node_index}"))
            self.engine_client = EngineClient(self.engine.base_url, self.secret)
        else:
            await self.engine_client.resume(str(weights_dir(self.rd.path, version)), version)
        return {"base_url": self.engine.base_url, "engine_start_s": time.monotonic() - t0}

    async def cmd_release_engine(self) -> dict:
        t0 = time.monotonic()
        if self.engine_client is not None:
            await self.engine_client.release()
        return {"engine_release_s": time.monotonic() - t0}

    async def cmd_load_weights(self, *, version: int) -> dict:
        t0 = time.monotonic()
        await self.engine_client.load_weights(str(weights_dir(self.rd.path, version)), version)
        return {"weight_load_s": time.monotonic() - t0}

    async def shutdown_engine(self) -> None:
        if self.engine_client is not None:
            await self.engine_client.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop, 10.0)
            self.engine = None

    # -- trainer ---------------------------------------------------------------------
    def _worker(self):
        if self.worker is None:
            from gyre_slurm.train.worker import TrainerWorker

            rt = self.cfg.runtime
            self.worker = TrainerWorker(model_dir=self.rd.model_dir, node_index=self.node_index,
                                        lr=rt.lr, seed=self.cfg.sim.seed)
        return self.worker

    async def _train(self, method: str, *args, **kwargs):
        """Run a TrainerWorker method on the trainer thread (made there on first use)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.trainer_pool, lambda: getattr(self._worker(), method)(*args, **kwargs))

    async def cmd_join(self, *, generation: int, world_size: int, store_host: str,
                       store_port: int, rank: int, src_rank: int,
                       init_weights: str | None = None, checkpoint: str | None = None) -> dict:
        from gyre_slurm.train.dist import WorldSpec

        spec = WorldSpec(generation=generation, world_size=world_size, store_host=store_host,
                         store_port=store_port, backend="gloo")
        times = await self._train("join", spec, rank, src_rank=src_rank,
                                  init_weights=Path(init_weights) if init_weights else None,
                                  checkpoint=Path(checkpoint) if checkpoint else None)
        return {**times, "version": self.worker.version}

    async def cmd_flush(self, *, keep_rank: int = 0) -> dict:
        await self._train("flush", keep_rank=keep_rank)
        return {}

    async def cmd_leave(self) -> dict:
        return await self._train("leave") or {}

    async def cmd_train_mb(self, *, path: str, num_step_tokens: int) -> dict:
        import json

        mb = json.loads(Path(path).read_text())
        return await self._train("train_microbatch", mb, num_step_tokens=num_step_tokens)

    async def cmd_step(self, *, publish_dir: str | None, num_step_tokens: int) -> dict:
        return await self._train("optimizer_step",
                                 publish_dir=Path(publish_dir) if publish_dir else None,
                                 num_step_tokens=num_step_tokens)

    async def cmd_save(self, *, path: str) -> dict:
        await self._train("save_checkpoint", Path(path))
        return {}

    async def cmd_shutdown(self) -> dict:
        asyncio.get_running_loop().call_later(0.05, self.stopping.set)
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gyre node agent")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--node-index", type=int, default=None,
                        help="this node's index in the allocation (default: $SLURM_NODEID)")
    parser.add_argument("--addr", required=True,
                        help="address to bind, or `auto`: this node's hostname resolved")
    parser.add_argument("--coordinator", required=True)
    args = parser.parse_args(argv)
    if args.node_index is None:
        if "SLURM_NODEID" not in os.environ:
            parser.error("--node-index is needed outside a Slurm step")
        args.node_index = int(os.environ["SLURM_NODEID"])
    if args.addr == "auto":
        from gyre_slurm.runtime.launcher import own_address

        args.addr = own_address()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s node{args.node_index} %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    agent = NodeAgent(run_dir=args.run_dir, node_index=args.node_index, addr=args.addr,
                      coordinator_url=args.coordinator)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stopping.set)
        await agent.serve()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

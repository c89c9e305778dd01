"""The node agent: one long-lived process per node, doing what the coordinator says.

    python -m gyre_slurm.runtime.agent --run-dir DIR --node-index I --addr 127.0.10.N \
        --coordinator http://HOST:PORT

It serves authenticated commands (`gyre_slurm.runtime.control`) on its node's address,
registers with the coordinator, and sends a heartbeat every `faults.heartbeat_s`. It
owns this node's part of a rollout server (an engine process, kept across handoffs and
released / resumed) and its training ranks: one long-lived process per local rank
(`train.rankproc`), started at registration and kept across handoffs, so a handoff
rebuilds process groups without starting Python again. Trainer commands go to the
ranks one at a time: collectives are issued in the order they arrive. Ranks are
processes, never threads of the agent, so that a rank blocked in a collective or a
world join with a member that died can be killed at once (`reset_trainer`). If the
coordinator stays unreachable for `orphan_s`, the agent stops its engine and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from gyre_slurm.common.values import is_number
from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import UserError
from gyre_slurm.models.tiny import weights_dir
from gyre_slurm.runtime.control import USER_ERROR_STATUS, ControlClient, make_app
from gyre_slurm.runtime.node_engines import BadEngineCommand, EnginesClosed, NodeEngines
from gyre_slurm.runtime.rundir import RunDir

log = logging.getLogger(__name__)
ORPHAN_S = 30.0
_CUDA_ID = re.compile(r"\d+|(GPU|MIG)-[0-9A-Za-z-]+")


def visible_gpus(env: dict | None = None, dev: Path = Path("/dev")) -> int | None:
    """The NVIDIA GPUs this node's processes can use, without importing torch: the ids
    in CUDA_VISIBLE_DEVICES (CUDA stops at the first it cannot read: `-1`, `NoDevFiles`),
    or the /dev/nvidiaN devices where it is unset; 0 without the driver's /dev/nvidiactl
    (a Slurm gres of no real device sets the variable all the same). None where the node
    may have GPUs of another kind (/dev/kfd: ROCm), which this does not count."""
    env = os.environ if env is None else env
    if not (dev / "nvidiactl").exists():
        return None if (dev / "kfd").exists() else 0
    ids = env.get("CUDA_VISIBLE_DEVICES")
    if ids is None:
        return sum(1 for p in dev.glob("nvidia*") if p.name[6:].isdigit())
    count = 0
    for part in ids.split(","):
        if not _CUDA_ID.fullmatch(part.strip()):
            break
        count += 1
    return count


class NodeAgent:
    def __init__(self, *, run_dir: Path, node_index: int, addr: str, coordinator_url: str,
                 shared_host: bool = False):
        self.rd = RunDir(run_dir)
        self.cfg = load_config(self.rd.path / "config.yaml")
        self.node_index, self.addr = node_index, addr
        self.shared_host = shared_host  # a virtual node of the local launcher
        self.secret = self.rd.secret()
        self.coordinator = ControlClient(coordinator_url, self.secret, timeout_s=10)
        from gyre_slurm.runtime.roles import read_roles

        self.roles = read_roles(self.rd.path)
        self.engines = NodeEngines(node_index=node_index, count=self.cfg.servers_per_node,
                                   start_one=self._start_one, make_client=self._client,
                                   handoff_timeout_s=self.cfg.faults.engine_handoff_timeout_s)
        self.ranks = None  # runtime.ranks.RankProcesses, once started
        self._ranks_started: asyncio.Task | None = None  # their one start, awaited by all
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
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpus": visible_gpus()})
        log.info("node agent %d serving on %s", self.node_index, url)
        beat = asyncio.create_task(self.heartbeat())
        # Start the rank processes (they import the trainer's libraries) now, so that
        # the first handoff to training does not pay for them.
        self._warm_ranks()
        await self.stopping.wait()
        beat.cancel()
        # the engines and the ranks stop together: each takes seconds to exit
        stops = [self.shutdown_engine()]
        if self.ranks is not None:
            stops.append(self.ranks.stop())
        await asyncio.gather(*stops)
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
            await asyncio.sleep(self.cfg.faults.heartbeat_s)

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        handler = getattr(self, f"cmd_{name}", None)
        if handler is None:
            return web.json_response({"error": f"unknown command {name!r}"}, status=404)
        payload = await request.json() if request.can_read_body else {}
        try:
            result = await handler(**payload)
        except (TypeError, BadEngineCommand) as exc:
            return web.json_response({"error": f"bad arguments for {name}: {exc}"}, status=400)
        except EnginesClosed as exc:
            return web.json_response({"error": f"{name}: {exc}"}, status=503)
        except UserError as exc:  # a file of the run dir to fix: the job says so plainly
            log.error("command %s refused: %s", name, exc)
            return web.json_response({"error": str(exc)}, status=USER_ERROR_STATUS)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator
            log.exception("command %s failed", name)
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)
        return web.json_response(result or {})

    # -- engine ----------------------------------------------------------------------
    # A rollout cell runs `servers_per_node` servers on each of its nodes (one per
    # `rollout.tensor_parallel` GPUs; one on CPU). They are kept across handoffs and
    # released (sleep on GPUs, pause on CPU, or stopped with `rollout.release: stop`).
    def _engine_gpus(self, k: int) -> str | None:
        gpus = self.cfg.cluster.gpus_per_node
        if not gpus:
            return None
        per = gpus // self.cfg.servers_per_node
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        ids = visible or [str(i) for i in range(gpus)]
        return ",".join(ids[k * per:(k + 1) * per])

    def _start_one(self, k: int, version: int, cancel=None):
        """Start server k (blocking: called in a thread by `NodeEngines`)."""
        from gyre_slurm.engines import start_engine
        from gyre_slurm.runtime.roles import command_prefix

        role = self.roles["rollout"]
        log_path = self.rd.log(f"engine-node{self.node_index}-s{k}")
        if self.cfg.rollout.engine == "vllm":
            from gyre_slurm.engines.vllm import start_vllm

            gpus = self._engine_gpus(k)
            return start_vllm(
                python=role["python"], prefix=command_prefix(role, run_dir=self.rd.path),
                model_dir=self.rd.model_dir, weights_dir=weights_dir(self.rd.path, version),
                version=version, host=self.addr, secret_file=self.rd.secret_file,
                log_path=log_path,
                serve_dir=self.rd.path / "engines" / f"node{self.node_index}-s{k}",
                tensor_parallel=self.cfg.rollout.tensor_parallel or max(
                    1, self.cfg.cluster.gpus_per_node),
                max_model_len=self.cfg.rollout.max_model_len,
                extra_args=list(self.cfg.rollout.engine_args),
                device="gpu" if self.cfg.cluster.gpus_per_node else "cpu",
                extra_env={"CUDA_VISIBLE_DEVICES": gpus} if gpus else None, cancel=cancel)
        return start_engine(model_dir=self.rd.model_dir, host=self.addr,
                            weights_dir=weights_dir(self.rd.path, version), version=version,
                            secret_file=self.rd.secret_file, log_path=log_path,
                            python=role["python"],
                            prefix=command_prefix(role, run_dir=self.rd.path), cancel=cancel)

    def _client(self, proc):
        from gyre_slurm.engines import make_client

        return make_client(self.cfg.rollout.engine, proc.base_url, self.secret,
                           release_mode=self.cfg.release_mode)

    # Engine commands go through `NodeEngines` (runtime.node_engines): one at a time,
    # a restart only of the server the coordinator means, kill and shutdown first.
    async def cmd_kill_engines(self, *, reason: str) -> dict:
        """Kill this node's engines (hung or dead); the next start_engine starts new ones."""
        return {"exit_codes": await self.engines.kill(reason=reason)}

    @property
    def _streamed(self) -> bool:
        """rollout.weight_sync: stream — an engine starts from the initial weights (the
        one policy on disk) or wakes with what it had, and the coordinator streams it
        the current policy before it serves (`weights_version`: what it holds)."""
        return self.cfg.rollout.weight_sync == "stream"

    async def cmd_start_engine(self, *, version: int) -> dict:
        t0 = time.monotonic()
        start = 0 if self._streamed else version  # streamed: from the initial weights
        replaced, held, spawned = await self.engines.start(
            version=start, weights_path=str(weights_dir(self.rd.path, start)),
            stream=self._streamed)
        return {"base_urls": self.engines.base_urls, "engine_kind": self.cfg.rollout.engine,
                "replaced": replaced, "weights_version": held, "spawned": spawned,
                "engine_start_s": time.monotonic() - t0}

    async def cmd_release_engine(self) -> dict:
        t0 = time.monotonic()
        killed = await self.engines.release(stop=self.cfg.release_mode == "stop")
        return {"engine_release_s": time.monotonic() - t0, "killed": killed}

    async def cmd_restart_engine(self, *, server: int, version: int, backoff_s: float = 0.0,
                                 base_url: str | None = None) -> dict:
        """Replace server `server`'s engine (crashed, or hung: the coordinator's health
        check says which): SIGKILL the old process (a stopped one too), wait `backoff_s`,
        start a new one at `version` (on a new port). `base_url`: the address the
        coordinator knows that server by; when the server was replaced or killed since,
        the answer says so (`restarted` false, `reason`) and nothing is done."""
        t0 = time.monotonic()
        version = 0 if self._streamed else version  # streamed: it gets the rest by stream
        res = await self.engines.restart(server=server, version=version, backoff_s=backoff_s,
                                         base_url=base_url)
        return dict(res, engine_kind=self.cfg.rollout.engine, version=version,
                    engine_start_s=time.monotonic() - t0)

    async def shutdown_engine(self) -> None:
        await self.engines.shutdown()

    # -- trainer ---------------------------------------------------------------------
    def _warm_ranks(self) -> None:
        warm = asyncio.create_task(self._rank_processes())
        warm.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.error(
            "training ranks failed to start: %s", t.exception()))

    async def _rank_processes(self):
        """The node's rank processes, started once (every caller awaits the same start:
        the warm-up at registration and the first command may race)."""
        if self._ranks_started is None:
            self._ranks_started = asyncio.ensure_future(self._start_ranks())
        await asyncio.shield(self._ranks_started)
        return self.ranks

    @property
    def _warm_up(self) -> bool:
        """Whether the ranks warm up as they start (`trainer.warm_up`). auto: not on a
        virtual node of the local launcher: its ranks' warm-ups (about 3.5 s of CPU each,
        transformers' imports) ran beside the engine starts the layout waits for, on the
        same cores; a 3-step tiny run took 31.0 s with them and 25.6 s without (medians
        of 4), its first joins building from cold instead (1.6-4.7 s)."""
        mode = self.cfg.trainer.warm_up
        return mode == "always" or (mode == "auto" and not self.shared_host)

    async def _start_ranks(self) -> None:
        from gyre_slurm.runtime.ranks import RankProcesses, rank_envs
        from gyre_slurm.runtime.roles import PACKAGE_ROOT, command_prefix

        tr, opt, n = self.cfg.trainer, self.cfg.optimizer, self.cfg.ranks_per_node
        role = self.roles["trainer"]
        base = command_prefix(role, run_dir=self.rd.path) + [
            role["python"], "-m", "gyre_slurm.train.rankproc", "--backend", tr.backend,
            "--model-dir", str(self.rd.model_dir), "--node-index", str(self.node_index),
            "--lr", str(opt.lr), "--seed", str(self.cfg.seed),
            "--grad-clip", str(opt.grad_clip), "--tp", str(tr.tensor_parallel),
            "--pp", str(tr.pipeline_parallel), "--ep", str(tr.expert_parallel),
            "--precision", tr.precision,
            "--distributed-optimizer", str(tr.distributed_optimizer).lower(),
            "--warm-up", str(self._warm_up).lower(),
            "--loss", json.dumps(self.cfg.loss.settings)]
        envs = rank_envs(n, gpus=self.cfg.cluster.gpus_per_node)
        for env in envs:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
        ranks = RankProcesses(
            commands=[base + ["--local-rank", str(i)] for i in range(n)], envs=envs,
            log_paths=[self.rd.log(f"trainer-node{self.node_index}-r{i}") for i in range(n)])
        try:
            await ranks.start()
        except BaseException:
            await ranks.stop(timeout_s=5.0)
            raise
        self.ranks = ranks

    async def _train(self, method: str, args: list[dict] | dict) -> list[dict]:
        """Run a trainer method on every local rank; their answers in rank order."""
        n = self.cfg.ranks_per_node
        args = args if isinstance(args, list) else [dict(args) for _ in range(n)]
        ranks = await self._rank_processes()
        return await ranks.call(method, args)

    async def cmd_join(self, *, generation: int, world_size: int, store_host: str,
                       store_port: int, rank: int, src_rank: int, backend: str = "gloo",
                       init_weights: str | None = None, checkpoint: str | None = None) -> dict:
        """`rank`: this node's first rank; its local ranks are rank, rank + 1, ..."""
        spec = {"generation": generation, "world_size": world_size, "store_host": store_host,
                "store_port": store_port, "backend": backend}
        results = await self._train("join", [
            {"spec": spec, "rank": rank + i, "src_rank": src_rank,
             "init_weights": init_weights, "checkpoint": checkpoint}
            for i in range(self.cfg.ranks_per_node)])
        merged = _merge(results, how=max)
        merged["version"] = results[0].get("version", 0)
        return merged

    async def cmd_flush(self, *, keep_rank: int = 0) -> dict:
        await self._train("flush", {"keep_rank": keep_rank})
        return {}

    async def cmd_leave(self) -> dict:
        return _merge(await self._train("leave", {}), how=max)

    async def cmd_train_mb(self, *, path: str, num_step_tokens: int,
                           packing: str = "tree") -> dict:
        """The local ranks' sums, merged (`gyre_slurm.train.metrics.merge`)."""
        from gyre_slurm.train.metrics import merge_all

        results = await self._train("train_mb", {"path": path, "packing": packing,
                                                 "num_step_tokens": num_step_tokens})
        return merge_all(results)

    async def cmd_step(self, *, publish_dir: str | None, num_step_tokens: int) -> dict:
        results = await self._train("step", [
            {"publish_dir": publish_dir, "num_step_tokens": num_step_tokens}
            for _ in range(self.cfg.ranks_per_node)])
        return results[0]

    async def cmd_reset_trainer(self) -> dict:
        """Drop this node's training state (the coordinator restores it from the last
        checkpoint), even while a collective or a world join waits for a member that
        died: the rank processes are killed (a command waiting on them fails at once) and
        new ones are started for the next command."""
        ranks, starting = self.ranks, self._ranks_started
        self.ranks, self._ranks_started = None, None
        if starting is not None and not starting.done():
            starting.cancel()  # a start under way stops what it started
        if ranks is not None:
            for proc in ranks.procs:  # no goodbye: a blocked rank would not hear it
                if proc.returncode is None:
                    proc.kill()
            await ranks.stop(timeout_s=5.0)
        self._warm_ranks()  # ready for the next world
        return {}

    async def cmd_save(self, *, path: str, writer: int | None = None) -> dict:
        """`writer`: the world rank that writes a replicated trainer's state (default 0)."""
        await self._train("save", {"path": path, "writer": writer})
        return {}

    async def cmd_wsync_join(self, *, transfer: dict, rank: int) -> dict:
        """Join a weight-transfer generation (`rank`: this node's first rank)."""
        results = await self._train("wsync_join", [
            {"transfer": transfer, "rank": rank + i, "host": self.addr}
            for i in range(self.cfg.ranks_per_node)])
        return {"ranks": results}

    async def cmd_wsync_send(self, *, generation: int, targets: list[int]) -> dict:
        """Every local rank sends its pieces of the policy to transfer ranks `targets`."""
        results = await self._train("wsync_send", {"generation": generation,
                                                   "targets": targets})
        return {"ranks": results}

    async def cmd_digests(self) -> dict:
        return {"ranks": await self._train("digests", {})}

    async def cmd_shutdown(self) -> dict:
        asyncio.get_running_loop().call_later(0.05, self.stopping.set)
        return {}


def _merge(results: list[dict], *, how) -> dict:
    """Numeric fields of the local ranks' answers combined with `how` (sum, max)."""
    merged: dict = {}
    for res in results:
        for key, value in res.items():
            if is_number(value):
                merged[key] = how(merged[key], value) if key in merged else value
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gyre node agent")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--node-index", type=int, default=None,
                        help="this node's index in the allocation (default: $SLURM_NODEID)")
    parser.add_argument("--addr", required=True,
                        help="address to bind, or `auto`: this node's hostname resolved")
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--shared-host", action="store_true",
                        help="a virtual node: the job's nodes share this host's cores (the "
                             "local launcher)")
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
                      coordinator_url=args.coordinator, shared_host=args.shared_host)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stopping.set)
        await agent.serve()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark of the gateway: many concurrent agent runs, fast stand-in engines.

    tools/gyre-env python tools/bench_gateway.py [--runs 1000] [--calls-per-run 10]
        [--tool-mean-s 3] [--servers 8] [--seconds 60] [--output-tokens 32]
        [--engine-latency-ms 0] [--profile FILE] [--json FILE]

What runs where, as in the coordinator: this process holds the gateway (with its call
store writer) and the agent runs, asyncio tasks in the same event loop, each an
OpenAI-style HTTP client (aiohttp, the chat body an OpenAI client sends) that makes
`--calls-per-run` chat calls with tool time between them (exponential, mean
`--tool-mean-s`; the first call after a uniform delay) and re-sends the whole history
each time (+ the reply + a tool observation of 200-600 characters per turn). A slot that
finishes a run (then `end_run`) starts the next one until `--seconds`; `--runs` slots
keep that many runs held. A second process (pinned to another core when there is one)
serves `--servers` stand-in engines: the engine protocol of
`gyre_slurm.engines.embedded` (POST /generate answers `--output-tokens` fixed output ids
and logprobs after `--engine-latency-ms`, GET /health), so what is measured is the
gateway + call recording + routing, not a model. Servers have capacity
ceil(runs / servers); halfway through, server s0 drains (its runs move at their next
call) and is removed once empty.

Method (per call, paired by the request's unique `seed`, which the gateway passes to the
engine): engine time = wall time of the gateway's `EngineClient.generate` (the HTTP hop
to the stand-in and its answer); handler time = wall time of the gateway's chat handler
(parse, chat template + tokenize, routing, engine call, record append, answer body);
client latency = from the run's `post` to its last response byte.
  overhead      = client latency - engine time  (what the agent waits for beyond the
                  engine: both HTTP legs to the gateway, the gateway's own work, and
                  waiting for the shared event loop)
  gateway code  = handler time - engine time
Memory per run: (RSS with every slot's run held, sampled at the drain) - (RSS after the
gateway and tokenizer are warm, before any run) over `--runs`; it includes each run's
client state (its history), as in the coordinator. Check: the call store read back
(`load_store`) holds exactly the calls answered 200.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import cProfile
import gc
import json
import math
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HOST = "127.0.0.1"
KEY = "bench-key-external-clients"  # the external key: the bench's runs are external
_SLOT = contextvars.ContextVar("bench_slot", default=None)
WORDS = ("the quick brown fox jumps over the lazy dog agent tool call result file test pass "
         "fail error run build repo answer yes no red green blue").split()


# -- the stand-in engines (a second process) ----------------------------------------------

def stand_in_main(ports_file: str, num_servers: int, output_tokens: int,
                  latency_ms: float) -> None:
    from aiohttp import web

    body = json.dumps({"output_ids": [7 + i % 200 for i in range(output_tokens)],
                       "output_logprobs": [-1.5] * output_tokens, "finish_reason": "length",
                       "policy_version": 0}).encode()
    health = json.dumps({"status": "ok", "policy_version": 0, "active": 0}).encode()

    async def generate(request):
        await request.read()
        if latency_ms:
            await asyncio.sleep(latency_ms / 1000)
        return web.Response(body=body, content_type="application/json")

    async def get_health(request):
        return web.Response(body=health, content_type="application/json")

    async def main():
        ports = []
        for _ in range(num_servers):
            app = web.Application(client_max_size=8 << 20)
            app.add_routes([web.post("/generate", generate), web.get("/health", get_health)])
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, HOST, 0)
            await site.start()
            ports.append(runner.addresses[0][1])
        tmp = ports_file + ".tmp"
        Path(tmp).write_text(json.dumps(ports))
        os.replace(tmp, ports_file)
        await asyncio.Event().wait()

    asyncio.run(main())


def start_stand_in(tmp: Path, args) -> tuple[subprocess.Popen, list[int]]:
    ports_file = tmp / "ports.json"
    cmd = [sys.executable, __file__, "--stand-in", str(ports_file), str(args.servers),
           str(args.output_tokens), str(args.engine_latency_ms)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if args.pin:
        os.sched_setaffinity(proc.pid, {args.pin[1]})
    deadline = time.monotonic() + 30
    while not ports_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the stand-in engines did not start")
        time.sleep(0.05)
    return proc, json.loads(ports_file.read_text())


# -- instrumentation (wrappers around the gateway's parts, the gateway unchanged) --------

def timed_engine_client():
    from gyre_slurm.engines import EngineClient

    class TimedEngineClient(EngineClient):
        async def generate(self, prompt_ids, **kw):
            t0 = time.perf_counter()
            try:
                return await super().generate(prompt_ids, **kw)
            finally:
                slot = _SLOT.get()
                if slot is not None:
                    slot["engine_s"] = time.perf_counter() - t0
                    slot["seed"] = kw.get("seed")

    return TimedEngineClient


def instrument_handler(gw, handler_s: dict, engine_s: dict) -> None:
    """Time the chat handler (an instance attribute read when `start` adds the routes)."""
    original = gw._chat

    async def chat(request):
        slot = {}
        _SLOT.set(slot)  # each request runs in its own task: its own context
        t0 = time.perf_counter()
        try:
            return await original(request)
        finally:
            if slot.get("seed") is not None:
                handler_s[slot["seed"]] = time.perf_counter() - t0
                engine_s[slot["seed"]] = slot["engine_s"]

    gw._chat = chat


class LoopWatch:
    """Event-loop lag (a 10 ms ticker's oversleep) and garbage-collector pauses."""

    def __init__(self):
        self.lag_ms: list[float] = []
        self.gc_ms: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._gc_t0 = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_ms[info["generation"]].append((time.perf_counter() - self._gc_t0) * 1e3)

    async def tick(self, deadline: float) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                await asyncio.sleep(0.01)
                self.lag_ms.append((time.perf_counter() - t0) * 1e3 - 10)
        finally:
            gc.callbacks.remove(self._on_gc)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- the runs --------------------------------------------------------------------------

class Stats:
    def __init__(self):
        self.latency_s: dict[int, float] = {}
        self.handler_s: dict[int, float] = {}
        self.engine_s: dict[int, float] = {}
        self.errors: Counter = Counter()
        self.calls_ok = 0
        self.runs_done = 0
        self.migrations: Counter = Counter()
        self.seed = 0

    def to_json(self) -> dict:
        return {"latency_s": self.latency_s, "errors": self.errors, "calls_ok": self.calls_ok,
                "runs_done": self.runs_done, "migrations": [[a, b, n] for (a, b), n
                                                            in self.migrations.items()]}

    def merge(self, d: dict) -> None:
        self.latency_s.update({int(k): v for k, v in d["latency_s"].items()})
        self.errors.update(d["errors"])
        self.calls_ok += d["calls_ok"]
        self.runs_done += d["runs_done"]
        self.migrations.update({(a, b): n for a, b, n in d["migrations"]})


def observation(rng: random.Random) -> str:
    n, size, text = rng.randint(200, 600), 0, []
    while size < n:
        text.append(rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randint(0, 999)))
        size += len(text[-1]) + 1
    return "<returncode>0</returncode>\n<output>\n" + " ".join(text) + "\n</output>"


async def one_slot(slot: int, http, url: str, end_run, st: Stats, args,
                   deadline: float) -> None:
    rng = random.Random(slot)
    await asyncio.sleep(rng.uniform(0, args.tool_mean_s))
    n = 0
    while time.monotonic() < deadline:
        run_id = f"r{slot:05d}-{n}"
        messages = [{"role": "system", "content": "You are a helpful assistant that can "
                     "interact with a computer. Reply with one bash block."},
                    {"role": "user", "content": f"Task {slot}-{n}: " + observation(rng)}]
        server = None
        for k in range(args.calls_per_run):
            st.seed += 1
            seed = st.seed
            body = {"model": "gyre-policy", "messages": messages,
                    "max_tokens": args.output_tokens, "temperature": 1.0, "seed": seed}
            t0 = time.perf_counter()
            try:
                async with http.post(f"{url}/runs/{run_id}/v1/chat/completions",
                                     json=body) as r:
                    raw = await r.read()
                    status = r.status
            except Exception as exc:  # noqa: BLE001 - counted and reported
                st.errors[type(exc).__name__] += 1
                break
            st.latency_s[seed] = time.perf_counter() - t0
            if status != 200:
                st.errors[f"HTTP {status}: {raw[:120]!r}"] += 1
                break
            st.calls_ok += 1
            reply = json.loads(raw)
            got = reply["gyre"]["server"]
            if server is not None and got != server:
                st.migrations[(server, got)] += 1
            server = got
            messages = messages + [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": observation(rng)}]
            if k + 1 < args.calls_per_run:
                pause = rng.expovariate(1 / args.tool_mean_s)
                await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    break
        await end_run(run_id)
        st.runs_done += 1
        n += 1


def session(limit: int = 0):
    import aiohttp

    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"},
                                 connector=aiohttp.TCPConnector(limit=limit))


def client_proc_main(spec_json: str) -> None:
    """Slots [first, last) in their own process; ends runs through the control URL."""
    spec = json.loads(spec_json)
    args = argparse.Namespace(**spec["args"])

    async def main():
        st = Stats()
        st.seed = spec["seed_base"]
        deadline = time.monotonic() + (spec["deadline_wall"] - time.time())
        async with session() as http:
            async def end_run(run_id):
                async with http.post(f"{spec['control_url']}/end/{run_id}") as r:
                    await r.read()
            await asyncio.gather(*(one_slot(i, http, spec["url"], end_run, st, args, deadline)
                                   for i in range(spec["first"], spec["last"])))
        tmp = spec["out"] + ".tmp"
        Path(tmp).write_text(json.dumps(st.to_json()))
        os.replace(tmp, spec["out"])

    asyncio.run(main())


async def control_app(gw) -> tuple:
    from aiohttp import web

    async def end(request):
        gw.end_run(request.match_info["run_id"])
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/end/{run_id}", end)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, HOST, 0).start()
    return runner, f"http://{HOST}:{runner.addresses[0][1]}"


async def run_client_procs(args, url: str, control_url: str, deadline_wall: float,
                           tmp: Path, st: Stats) -> None:
    n = args.client_procs
    bounds = [args.runs * i // n for i in range(n + 1)]
    procs = []
    for i in range(n):
        spec = {"args": {k: getattr(args, k) for k in ("calls_per_run", "tool_mean_s",
                                                       "output_tokens")},
                "url": url, "control_url": control_url, "deadline_wall": deadline_wall,
                "first": bounds[i], "last": bounds[i + 1], "seed_base": (i + 1) * 10**9,
                "out": str(tmp / f"client{i}.json")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client-proc", json.dumps(spec),
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        if args.pin:
            os.sched_setaffinity(proc.pid, {args.pin[1]})
        procs.append((proc, spec["out"]))
    for proc, path in procs:
        if await proc.wait() != 0:
            raise RuntimeError(f"a client process failed (exit {proc.returncode})")
        st.merge(json.loads(Path(path).read_text()))


async def drain_later(gw, at_s: float, out: dict) -> None:
    await asyncio.sleep(at_s)
    out["rss_held_mib"] = rss_mib()
    out["active_at_drain"] = sum(s["external"] for s in gw.server_load().values())
    out["s0_runs_at_drain"] = gw.server_load()["s0"]["external"]
    gw.drain_server("s0")
    t0 = time.monotonic()
    while True:
        load = gw.server_load()["s0"]
        if load["external"] == 0 and load["in_flight"] == 0:
            gw.remove_server("s0")
            out["drain_empty_s"] = time.monotonic() - t0
            return
        await asyncio.sleep(0.05)


async def bench(args, tmp: Path, model_dir: Path, ports: list[int]) -> dict:
    from gyre_slurm.gateway import Gateway
    from gyre_slurm.gateway.runs import ExternalPolicy
    from gyre_slurm.traj.store import CallStoreWriter

    st = Stats()
    writer = CallStoreWriter(tmp / "run", "gateway")
    # The bench's clients are external runs (ids "r..."; "rwarm" to warm up), ended by
    # the bench's control route as the coordinator ends the job's runs.
    policy = ExternalPolicy(key=KEY, prefix="r", max_runs=args.runs + 8,
                            idle_timeout_s=3600, max_run_s=3600)
    gw = Gateway(model_dir=model_dir, call_writer=writer, external=policy,
                 default_max_tokens=args.output_tokens, wait_for_server_s=30)
    instrument_handler(gw, st.handler_s, st.engine_s)
    client_cls = timed_engine_client()
    clients = [client_cls(f"http://{HOST}:{p}", "stand-in") for p in ports]
    port = await gw.start(HOST, 0)
    url = f"http://{HOST}:{port}"
    capacity = math.ceil(args.runs / args.servers)
    for i, c in enumerate(clients):
        gw.add_server(f"s{i}", c, capacity=capacity)
    control, control_url = await control_app(gw)
    out: dict = {}
    async with session() as http:
        for i in range(20):  # warm: tokenizer, connections, code paths
            async with http.post(f"{url}/runs/rwarm/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "seed": -1 - i}) as r:
                assert r.status == 200, await r.text()
        gw.end_run("rwarm")
        if args.gc_freeze:  # as the coordinator does once its services are up
            from gyre_slurm.runtime.gcpolicy import freeze_startup_heap

            freeze_startup_heap()
        out["rss_before_mib"] = rss_mib()
        t0 = time.monotonic()
        deadline = t0 + args.seconds
        drain = asyncio.create_task(drain_later(gw, args.seconds / 2, out))
        watch = LoopWatch()
        ticker = asyncio.create_task(watch.tick(deadline))
        profiler = cProfile.Profile() if args.profile else None
        if profiler:
            profiler.enable()
        if args.client_procs:
            await run_client_procs(args, url, control_url, time.time() + args.seconds, tmp, st)
        else:
            async def end_run(run_id):
                gw.end_run(run_id)
            await asyncio.gather(*(one_slot(i, http, url, end_run, st, args, deadline)
                                   for i in range(args.runs)))
        if profiler:
            profiler.disable()
            profiler.dump_stats(args.profile)
        elapsed = time.monotonic() - t0
        if not drain.done():
            drain.cancel()
        await ticker
    await gw.stop()
    await control.cleanup()
    for c in clients:
        await c.close()
    writer.close()
    out.update(elapsed_s=elapsed, stats=st, watch=watch)
    return out


# -- report ----------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def report(args, out: dict, run_dir: Path) -> dict:
    from gyre_slurm.traj.store import load_store

    st: Stats = out["stats"]
    loaded = load_store(run_dir)
    stored = sum(len(v) for rid, v in loaded.runs.items() if rid != "rwarm")
    paired = [s for s in st.latency_s if s in st.engine_s]
    overhead = [(st.latency_s[s] - st.engine_s[s]) * 1e3 for s in paired]
    code = [(st.handler_s[s] - st.engine_s[s]) * 1e3 for s in paired]
    engine = [st.engine_s[s] * 1e3 for s in paired]
    latency = [st.latency_s[s] * 1e3 for s in paired]
    moved = sum(n for (a, _), n in st.migrations.items() if a == "s0")
    res = {
        "client_procs": args.client_procs, "gc_freeze": args.gc_freeze,
        "runs": args.runs, "calls_per_run": args.calls_per_run, "tool_mean_s": args.tool_mean_s,
        "servers": args.servers, "seconds": args.seconds, "elapsed_s": round(out["elapsed_s"], 1),
        "calls_ok": st.calls_ok, "runs_done": st.runs_done,
        "calls_per_s": round(st.calls_ok / out["elapsed_s"], 1),
        "overhead_ms": {"p50": pct(overhead, 50), "p90": pct(overhead, 90),
                        "p99": pct(overhead, 99), "max": max(overhead, default=float("nan"))},
        "gateway_code_ms": {"p50": pct(code, 50), "p99": pct(code, 99)},
        "engine_hop_ms": {"p50": pct(engine, 50), "p99": pct(engine, 99)},
        "client_latency_ms": {"p50": pct(latency, 50), "p99": pct(latency, 99)},
        "rss_before_mib": round(out["rss_before_mib"], 1),
        "rss_held_mib": round(out.get("rss_held_mib", float("nan")), 1),
        "active_at_drain": out.get("active_at_drain"),
        "kib_per_run": round((out.get("rss_held_mib", float("nan")) - out["rss_before_mib"])
                             * 1024 / max(1, out.get("active_at_drain") or args.runs), 1),
        "drain": {"s0_runs": out.get("s0_runs_at_drain"), "moved": moved,
                  "other_migrations": sum(st.migrations.values()) - moved,
                  "empty_after_s": round(out.get("drain_empty_s", float("nan")), 2)},
        "loop_lag_ms": {"p50": pct(out["watch"].lag_ms, 50), "p99": pct(out["watch"].lag_ms, 99),
                        "max": max(out["watch"].lag_ms, default=float("nan"))},
        "gc_pauses": {f"gen{g}": {"n": len(v), "p99_ms": pct(v, 99),
                                  "max_ms": max(v, default=0.0)}
                      for g, v in out["watch"].gc_ms.items()},
        "errors": dict(st.errors),
        "store": {"calls": stored, "matches": stored == st.calls_ok,
                  "errors": len(loaded.errors), "bytes": (run_dir / "calls" /
                                                          "gateway.seg").stat().st_size},
    }
    return res


def print_report(res: dict) -> None:
    def ms(d):
        return "  ".join(f"{k} {v:.2f}" for k, v in d.items())
    print(f"client procs {res['client_procs']}, gc.freeze {res['gc_freeze']}: "
          f"{res['runs']} runs x {res['calls_per_run']} calls, tool mean {res['tool_mean_s']} s,"
          f" {res['servers']} servers, {res['elapsed_s']} s")
    print(f"  calls ok {res['calls_ok']} ({res['calls_per_s']}/s), runs done {res['runs_done']}")
    print(f"  overhead (client latency - engine) ms: {ms(res['overhead_ms'])}")
    print(f"  gateway code (handler - engine) ms:    {ms(res['gateway_code_ms'])}")
    print(f"  engine hop ms:                         {ms(res['engine_hop_ms'])}")
    print(f"  client latency ms:                     {ms(res['client_latency_ms'])}")
    print(f"  event-loop lag ms:                     {ms(res['loop_lag_ms'])}")
    print(f"  gc pauses: {res['gc_pauses']}")
    print(f"  RSS {res['rss_before_mib']} -> {res['rss_held_mib']} MiB with "
          f"{res['active_at_drain']} runs held: {res['kib_per_run']} KiB/run")
    print(f"  drain s0: {res['drain']}")
    print(f"  store: {res['store']}  errors: {res['errors'] or 'none'}")


def print_profile(path: str, top: int = 25) -> None:
    stats = pstats.Stats(path)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("gyre_slurm", top)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--stand-in":
        stand_in_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        return 0
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--client-proc":
        client_proc_main(sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--calls-per-run", type=int, default=10)
    p.add_argument("--tool-mean-s", type=float, default=3.0)
    p.add_argument("--servers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--engine-latency-ms", type=float, default=0.0)
    p.add_argument("--client-procs", type=int, default=0,
                   help="run the agent runs in this many other processes (pinned with the "
                        "stand-in), so that this process holds only the gateway; 0: in this "
                        "process, as the coordinator runs its built-in agent loop")
    p.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                   help="skip the coordinator's gc.freeze() of its startup heap "
                        "(gyre_slurm.runtime.gcpolicy), to see what it buys")
    p.add_argument("--profile", help="cProfile the gateway process into this file")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin this process and the stand-in to separate cores")
    args = p.parse_args(argv)
    if args.runs < 1 or args.calls_per_run < 1 or args.servers < 2:
        p.error("--runs and --calls-per-run must be >= 1, --servers >= 2 (one drains)")
    cpus = sorted(os.sched_getaffinity(0))
    args.pin = (cpus[0], cpus[1]) if args.pin and len(cpus) > 1 else None
    if args.pin:
        os.sched_setaffinity(0, {args.pin[0]})
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from gyre_slurm.models import tiny

    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        tmp = Path(tmp)
        model_dir = tiny.make_model_dir(tmp / "model")
        proc, ports = start_stand_in(tmp, args)
        try:
            out = asyncio.run(bench(args, tmp, model_dir, ports))
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        res = report(args, out, tmp / "run")
    print_report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.profile:
        print_profile(args.profile)
    return 0


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)

"""Who may call which run, for how long, and what an abandoned call leaves behind: the
gateway in this process in front of one real engine process.

- each run's own key opens its own URL only, and only until the run ends;
- no key opens anything outside a run; the engine's secret opens nothing here, and a run
  key opens nothing on the engine or a control server; a non-UTF-8 Authorization header
  is a 401 everywhere, never a 500;
- runs nobody started are refused, unless external mode is on: then they register,
  time out, end, are freed (memory stays bounded over 1,000 of them), never take a job
  run's id, and neither count as a cell's runs nor reach the job's call store;
- a client that disconnects cancels its generation in the engine, and nothing is
  recorded.
"""

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from engine_helpers import tiny_engines
from gyre_slurm.engines import EngineClient
from gyre_slurm.gateway import Gateway
from gyre_slurm.gateway.runs import ExternalPolicy, RunRegistry
from gyre_slurm.runtime import control
from gyre_slurm.traj.store import CallStoreWriter, load_store

HOST = "127.0.0.1"
HELLO = {"model": "gyre-policy", "messages": [{"role": "user", "content": "hi"}],
         "max_tokens": 2}
EXT_KEY = "gyre-ext-" + "k" * 40


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with tiny_engines(tmp_path_factory.mktemp("gw-access"), max_positions=4096) as e:
        yield dict(e, url=e["urls"][0])


def with_gateway(engine, tmp_path, fn, **kw):
    async def main():
        writer = CallStoreWriter(tmp_path / "job", "gateway")
        ext_writer = CallStoreWriter(tmp_path / "external", "gateway")
        gw = Gateway(model_dir=engine["model_dir"], call_writer=writer,
                     external_writer=ext_writer, wait_for_server_s=5, **kw)
        client = EngineClient(engine["url"], engine["secret"])
        port = await gw.start(HOST, 0)
        try:
            gw.add_server("s0", client, capacity=4)
            return await fn(gw, f"http://{HOST}:{port}")
        finally:
            await gw.stop()
            await client.close()
            writer.close()
            ext_writer.close()
    return asyncio.run(main())


async def post(url, key, body=HELLO, *, method="POST"):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)


async def raw_status(host: str, port: int, path: str, auth: bytes) -> int:
    """The status of a POST whose Authorization header is the raw bytes `auth`."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth
                 + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                 b"Connection: close\r\n\r\n{}")
    await writer.drain()
    head = await asyncio.wait_for(reader.read(64), 10)
    writer.close()
    return int(head.split()[1])


NON_UTF8 = [b"Bearer \xff\xfe\xfd", b"Bearer \xc3(", b"\x80", b"Bearer " + "é".encode("latin-1")]


def test_each_run_key_opens_its_own_url_only_while_the_run_lives(engine, tmp_path):
    async def go(gw, base):
        url = f"{base}/runs/%s/v1/chat/completions"
        ka, kb = gw.open_run("s0000-p000-g00"), gw.open_run("s0000-p000-g01")
        out = {"own": await post(url % "s0000-p000-g00", ka),
               "other": await post(url % "s0000-p000-g01", ka),
               "unopened": await post(url % "s0000-p000-g02", ka),
               "engine-secret": await post(url % "s0000-p000-g00", engine["secret"]),
               "none": await post(url % "s0000-p000-g00", None),
               "models": await post(f"{base}/runs/s0000-p000-g00/v1/models", ka, method="GET"),
               "root-models": await post(f"{base}/v1/models", ka, method="GET"),
               "end-job-run": await post(f"{base}/runs/s0000-p000-g00/end", ka)}
        gw.end_run("s0000-p000-g00")
        out["revoked"] = await post(url % "s0000-p000-g00", ka)
        out["b-still"] = await post(url % "s0000-p000-g01", kb)
        host, port = base[7:].split(":")
        out["non-utf8"] = [await raw_status(host, int(port), "/runs/s0000-p000-g01/v1/"
                                            "chat/completions", a) for a in NON_UTF8]
        out["stats"] = gw.run_stats()
        return out
    out = with_gateway(engine, tmp_path, go)
    assert out["own"][0] == 200 and out["b-still"][0] == 200
    for name in ("other", "unopened", "engine-secret", "none", "revoked", "root-models"):
        assert out[name][0] == 401, (name, out[name])
        assert out[name][1]["error"]["type"] == "authentication_error"
    assert out["models"][0] == 200
    assert out["end-job-run"][0] == 403
    assert out["non-utf8"] == [401] * len(NON_UTF8)
    assert out["stats"]["job_runs"] == 1 and out["stats"]["external_runs"] == 0
    loaded = load_store(tmp_path / "job")
    assert sorted(loaded.runs) == ["s0000-p000-g00", "s0000-p000-g01"]


def test_runs_nobody_started_are_refused_without_external_mode(engine, tmp_path):
    async def go(gw, base):
        gw.open_run("s0000-p000-g00")
        return [await post(f"{base}/runs/{rid}/v1/chat/completions", key) for rid, key in
                [("s0000-p000-g00", EXT_KEY), ("ext-mine", EXT_KEY), ("guess", "x" * 50)]]
    out = with_gateway(engine, tmp_path, go)
    assert [s for s, _ in out] == [401, 401, 401]


def test_external_runs_register_end_time_out_and_are_freed(engine, tmp_path):
    # the idle timeout must outlast the live phase's calls (b stays live from its call
    # to stats-live, across c's generation): 0.6 s did not on a loaded 2-core machine,
    # where b timed out, d-over-cap took its place and d-now was refused as ended
    policy = ExternalPolicy(key=EXT_KEY, prefix="ext-", max_runs=3, idle_timeout_s=3.0,
                            max_run_s=60)

    async def go(gw, base):
        url = f"{base}/runs/%s/v1/chat/completions"
        job_key = gw.open_run("s0000-p000-g00")
        out = {"a": await post(url % "ext-a", EXT_KEY),
               "b": await post(url % "ext-b", EXT_KEY),
               "job-id": await post(url % "s0000-p000-g00", EXT_KEY),
               "unprefixed": await post(url % "mine", EXT_KEY),
               "job-key-on-ext": await post(url % "ext-a", job_key),
               "registered-no-key": await post(url % "ext-a", None),
               "registered-empty-key": await post(url % "ext-a", "")}
        out["load"] = gw.server_load()["s0"]
        out["c"] = await post(url % "ext-c", EXT_KEY)
        out["d-over-cap"] = await post(url % "ext-d", EXT_KEY)
        out["end-a"] = await post(f"{base}/runs/ext-a/end", EXT_KEY)
        out["a-again"] = await post(url % "ext-a", EXT_KEY)
        out["stats-live"] = gw.run_stats()
        # b and c go idle past 3 s: the reaper (every 0.75 s) ends them; wait for it
        # rather than a fixed time (a busy machine may run the reaper late)
        for _ in range(300):
            await asyncio.sleep(0.1)
            if gw.run_stats()["external_runs"] == 0:
                break
        out["stats-idle"] = gw.run_stats()
        out["load-idle"] = gw.server_load()["s0"]
        out["b-after-idle"] = await post(url % "ext-b", EXT_KEY)
        out["d-now"] = await post(url % "ext-d", EXT_KEY)
        return out
    out = with_gateway(engine, tmp_path, go, external=policy)
    assert out["a"][0] == out["b"][0] == out["c"][0] == out["d-now"][0] == 200
    assert out["a"][1]["gyre"]["call"] == 0
    for name in ("job-id", "unprefixed", "job-key-on-ext", "registered-no-key",
                 "registered-empty-key"):
        assert out[name][0] == 401, (name, out[name])
    # external runs hold a place on the server but are not the job's runs
    assert out["load"]["runs"] == 0 and out["load"]["external"] == 2
    assert out["d-over-cap"][0] == 429 and "max_runs" in out["d-over-cap"][1]["error"]["message"]
    assert out["end-a"] == (200, {"run_id": "ext-a", "ended": True, "calls": 1})
    assert out["a-again"][0] == 409 and out["b-after-idle"][0] == 409
    assert out["stats-live"]["external_runs"] == 2
    assert out["stats-idle"] == {"job_runs": 1, "external_runs": 0, "ended_external": 3,
                                 "history_runs": 0}
    assert out["load-idle"]["external"] == 0
    # their calls went to the external store, never the job's
    assert sorted(load_store(tmp_path / "external").runs) == ["ext-a", "ext-b", "ext-c",
                                                              "ext-d"]
    assert not (tmp_path / "job" / "calls").exists() or not load_store(tmp_path / "job").runs


def test_a_call_longer_than_the_idle_timeout_does_not_make_its_run_idle():
    """Idle means no call for `idle_timeout_s`: a run whose one call generates for longer
    (a long answer) is neither marked ending mid-call nor ended; it goes idle from the
    call's end. `max_run_s` still ends a run with a call in flight (after the call)."""
    reg = RunRegistry(ExternalPolicy(key=EXT_KEY, idle_timeout_s=1.0, max_run_s=100.0))
    auth = f"Bearer {EXT_KEY}".encode()
    state = reg.admit("ext-long", auth, now=0.0)
    state.in_flight, state.t_last = 1, 0.0  # as the gateway does when a call starts
    assert reg.expired(now=50.0) == [] and not state.ending
    assert reg.admit("ext-long", auth, now=50.0) is state  # a second call is admitted
    state.in_flight, state.t_last = 0, 50.0  # the call ends at 50 s
    assert reg.expired(now=50.5) == []
    assert reg.expired(now=51.5) == ["ext-long"]
    reg.end("ext-long")
    late = reg.admit("ext-late", auth, now=0.0)
    late.in_flight = 1
    assert reg.expired(now=101.0) == [] and late.ending  # past max_run_s: no new calls
    late.in_flight = 0
    assert "ext-late" in reg.expired(now=101.0)


def test_a_thousand_external_runs_leave_bounded_state():
    """The registry and the router: 1,000 external runs, each registered, ended or timed
    out, leave nothing but a tombstone each (the gateway's history and call counters are
    freed by the same end_run, checked above)."""
    from gyre_slurm.gateway.router import Router

    reg = RunRegistry(ExternalPolicy(key=EXT_KEY, max_runs=8, idle_timeout_s=1.0))
    router, auth = Router(), f"Bearer {EXT_KEY}".encode()

    async def go():
        router.add("s0", object(), capacity=4)
        for i in range(1000):
            state = reg.admit(f"ext-{i}", auth, now=float(i))
            await router.acquire(state.run_id, wait_s=0, external=True)
            router.release(router.servers["s0"])
            for run_id in reg.expired(now=i + 0.5 if i % 2 else i + 2.0):
                reg.end(run_id)
                router.end_run(run_id)
            if i % 2:
                reg.end(state.run_id)
                router.end_run(state.run_id)
    asyncio.run(go())
    assert len([s for s in reg.runs.values() if s.external]) <= 8
    assert len(router.servers["s0"].external) <= 8 and len(router.affinity) <= 8
    assert reg.stats()["ended_external"] >= 990


def test_a_client_that_disconnects_cancels_its_generation_and_records_nothing(engine, tmp_path):
    async def go(gw, base):
        key = gw.open_run("s0000-p000-g00")
        # 16 long generations: they cannot all end early on a stop token
        body = {**HELLO, "max_tokens": 3000, "n": 16, "temperature": 1.0}

        async def call():
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/runs/s0000-p000-g00/v1/chat/completions",
                                     json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.status
        task = asyncio.create_task(call())
        while gw.server_load()["s0"]["in_flight"] == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        task.cancel()  # the client goes away mid-generation
        t0 = time.monotonic()
        while gw.server_load()["s0"]["in_flight"]:
            await asyncio.sleep(0.01)
        freed_s = time.monotonic() - t0
        async with EngineClient(engine["url"], engine["secret"]) as direct:
            for _ in range(200):
                health = await direct.health()
                if health["active"] == 0:
                    break
                await asyncio.sleep(0.05)
        ok = await post(f"{base}/runs/s0000-p000-g00/v1/chat/completions", key)
        return freed_s, health, gw.calls_of("s0000-p000-g00"), ok
    freed_s, health, calls, ok = with_gateway(engine, tmp_path, go)
    assert freed_s < 2.0
    assert health["active"] == 0 and health["cancelled"] >= 1, health
    assert ok[0] == 200 and ok[1]["gyre"]["call"] == 0 and calls == 1  # nothing recorded before
    loaded = load_store(tmp_path / "job")
    assert [d.call for d in loaded.runs["s0000-p000-g00"]] == [0]


def test_engine_and_control_refuse_run_keys_and_non_utf8_headers(engine, tmp_path):
    async def main():
        gwkey = RunRegistry().open("s0000-p000-g00", now=0.0)
        app = control.make_app("job-secret-" + "x" * 30)
        async def beat(request):
            return web.json_response({})
        app.router.add_post("/agent/heartbeat", beat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        cport = runner.addresses[0][1]
        ehost, eport = engine["url"][7:].split(":")
        try:
            out = {"engine-run-key": await post(f"{engine['url']}/release", gwkey, {}),
                   "engine-health-run-key": await post(f"{engine['url']}/health", gwkey,
                                                       method="GET"),
                   "control-run-key": await post(f"http://{HOST}:{cport}/agent/heartbeat",
                                                 gwkey, {"node": 0})}
            out["engine-non-utf8"] = [await raw_status(ehost, int(eport), "/release", a)
                                      for a in NON_UTF8]
            out["control-non-utf8"] = [await raw_status(HOST, cport, "/agent/heartbeat", a)
                                       for a in NON_UTF8]
            async with EngineClient(engine["url"], engine["secret"]) as direct:
                out["engine-ok"] = (await direct.health())["status"]
            return out
        finally:
            await runner.cleanup()
    out = asyncio.run(main())
    assert out["engine-run-key"][0] == out["engine-health-run-key"][0] == 401
    assert out["control-run-key"][0] == 401
    assert out["engine-non-utf8"] == out["control-non-utf8"] == [401] * len(NON_UTF8)
    assert out["engine-ok"] == "ok"  # the engine was not released by any of it

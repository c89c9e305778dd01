"""The gateway in this process, in front of two real engine processes on loopback."""

import asyncio

import aiohttp
import pytest

from gyre_slurm.engines import EngineClient
from gyre_slurm.gateway import Gateway
from gyre_slurm.models import tiny
from gyre_slurm.traj.delta import decode_run
from gyre_slurm.traj.store import CallStoreWriter, load_store
from engine_helpers import tiny_engines

HOST = "127.0.0.1"
HELLO = [{"role": "system", "content": "you are a test"}, {"role": "user", "content": "hi fox"}]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with tiny_engines(tmp_path_factory.mktemp("gw-engines"), count=2) as e:
        yield e


def key_of(gw, run_id):
    """The run's key, opening the run (as the coordinator does when it starts one)."""
    keys = gw.__dict__.setdefault("_test_keys", {})
    if run_id not in gw.runs.runs:
        keys[run_id] = gw.open_run(run_id)
    return keys[run_id]


def run_keys(gw):
    """A client middleware that sends each run's own key (opening the run first)."""
    async def auth(req, handler):
        parts = req.url.path.split("/")
        if len(parts) > 2 and parts[1] == "runs":
            req.headers["Authorization"] = f"Bearer {key_of(gw, parts[2])}"
        return await handler(req)
    return auth


def run_gateway(engines, run_dir, fn, *, servers=("s0", "s1"), wait_s=10.0, timeout_s=40,
                **gw_kw):
    """Start a gateway with `servers` (ids -> the module's engines), run `fn(gw, http,
    base)` with `http` a session that opens each run it calls and sends its key, stop
    everything; `fn`'s result."""
    async def main():
        writer = CallStoreWriter(run_dir, "gateway")
        gw = Gateway(model_dir=engines["model_dir"], call_writer=writer,
                     wait_for_server_s=wait_s, **{"default_max_tokens": 8, **gw_kw})
        clients = [EngineClient(url, engines["secret"]) for url in engines["urls"]]
        port = await gw.start(HOST, 0)
        try:
            for sid, client in zip(servers, clients):
                gw.add_server(sid, client, capacity=4)
            async with aiohttp.ClientSession(middlewares=(run_keys(gw),)) as http:
                return await asyncio.wait_for(fn(gw, http, f"http://{HOST}:{port}"), timeout_s)
        finally:
            await gw.stop()
            for c in clients:
                await c.close()
            writer.close()
    return asyncio.run(main())


async def chat(http, base, run_id, messages=HELLO, **kw):
    body = {"model": "gyre-policy", "messages": messages, "max_tokens": 8, **kw}
    async with http.post(f"{base}/runs/{run_id}/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


def records(run_dir, run_id):
    loaded = load_store(run_dir)
    assert not loaded.errors
    return list(decode_run(loaded.runs[run_id]))


def test_chat_completion_recorded(engines, tmp_path):
    tok = tiny.load_tokenizer(engines["model_dir"])
    stop_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]

    async def go(gw, http, base):
        # the watchdog's evidence of a live engine: the gateway notes each answer
        assert not any(gw.answered_within(s, 3600) for s in ("s0", "s1"))
        first = await chat(http, base, "r1", temperature=0, logprobs=True)
        assert gw.answered_within(gw.router.affinity["r1"], 60)
        follow = HELLO + [{"role": "assistant", "content": first[1]["choices"][0]["message"]
                           ["content"]}, {"role": "user", "content": "and the dog"}]
        second = await chat(http, base, "r1", follow, temperature=0.8, seed=7,
                            max_completion_tokens=5)
        async with EngineClient(engines["urls"][0], engines["secret"]) as direct:
            ref = await direct.generate(tiny.chat_prompt_ids(tok, HELLO), max_tokens=8,
                                        temperature=0, stop_token_ids=stop_ids)
        return first, second, follow, ref, gw.calls_of("r1")
    first, second, follow, ref, ncalls = run_gateway(engines, tmp_path, go)
    assert first[0] == 200 and second[0] == 200
    body = first[1]
    assert body["object"] == "chat.completion" and body["model"] == "gyre-policy"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["prompt_tokens"] == len(tiny.chat_prompt_ids(tok, HELLO))
    recs = records(tmp_path, "r1")
    assert ncalls == 2 and [r.call for r in recs] == [0, 1]
    assert recs[0].prompt_ids.tolist() == tiny.chat_prompt_ids(tok, HELLO)
    # the re-sent answer is its generated tokens (token-exact), the text is the template's
    p0, o0 = recs[0].prompt_ids.tolist(), recs[0].output_ids.tolist()
    assert recs[1].prompt_ids.tolist()[:len(p0) + len(o0)] == p0 + o0
    assert tok.decode(recs[1].prompt_ids.tolist(), skip_special_tokens=True) == \
        tok.decode(tiny.chat_prompt_ids(tok, follow), skip_special_tokens=True)
    assert recs[0].output_ids.tolist() == ref["output_ids"]
    assert recs[0].output_logprobs.tolist() == pytest.approx(ref["output_logprobs"], abs=1e-6)
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(ref["output_logprobs"], abs=1e-6)
    assert choice["message"]["content"] == tok.decode(ref["output_ids"], skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == len(ref["output_ids"])
    assert len(recs[1].output_ids) <= 5 and recs[1].policy_version == 0
    assert recs[0].t_start <= recs[0].t_end <= recs[1].t_start


def test_completions_and_models(engines, tmp_path):
    async def go(gw, http, base):
        url = f"{base}/runs/c1/v1"
        async with http.post(url + "/completions",
                             json={"prompt": [3, 10, 20], "max_tokens": 4, "temperature": 0,
                                   "logprobs": 0}) as r:
            ids = (r.status, await r.json())
        async with http.post(url + "/completions",
                             json={"prompt": "the quick brown", "max_tokens": 3}) as r:
            text = (r.status, await r.json())
        async with http.get(url + "/models") as r:
            models = (r.status, await r.json())
        return ids, text, models
    ids, text, models = run_gateway(engines, tmp_path, go)
    assert ids[0] == 200 and ids[1]["object"] == "text_completion"
    assert len(ids[1]["choices"][0]["logprobs"]["token_logprobs"]) == \
        ids[1]["usage"]["completion_tokens"]
    assert text[0] == 200 and text[1]["usage"]["completion_tokens"] <= 3
    assert models == (200, {"object": "list", "data": [
        {"id": "gyre-policy", "object": "model", "created": models[1]["data"][0]["created"],
         "owned_by": "gyre"}]})
    recs = records(tmp_path, "c1")
    assert recs[0].prompt_ids.tolist() == [3, 10, 20]


def test_affinity_drain_migrate_remove(engines, tmp_path):
    async def go(gw, http, base):
        servers = {}
        for run_id in ("a", "b", "a", "b", "a"):
            status, body = await chat(http, base, run_id, max_tokens=2)
            assert status == 200
            servers.setdefault(run_id, []).append(body["gyre"]["server"])
        before = gw.server_load()
        gw.drain_server("s0")
        load_drained = gw.server_load()
        moved = (await chat(http, base, "a", max_tokens=2))[1]["gyre"]["server"]
        fresh = (await chat(http, base, "c", max_tokens=2))[1]["gyre"]["server"]
        with pytest.raises(RuntimeError, match="not drained"):
            gw.remove_server("s1")
        gw.remove_server("s0")
        gw.end_run("b")
        return servers, before, load_drained, moved, fresh, gw.server_load()
    servers, before, drained, moved, fresh, after = run_gateway(engines, tmp_path, go)
    assert servers == {"a": ["s0"] * 3, "b": ["s1"] * 2}
    idle = {"in_flight": 0, "suspect": False, "external": 0}
    assert before == {"s0": {"runs": 1, "draining": False, **idle},
                      "s1": {"runs": 1, "draining": False, **idle}}
    assert drained["s0"] == {"runs": 1, "draining": True, **idle}
    assert moved == "s1" and fresh == "s1"
    assert after == {"s1": {"runs": 2, "draining": False, **idle}}
    assert [r.call for r in records(tmp_path, "a")] == [0, 1, 2, 3]


def test_a_wait_drain_keeps_its_runs_until_they_end(engines, tmp_path):
    """runs="keep" (the `wait` drain of a move to training): the runs a draining server
    holds keep calling it, turn after turn, while new runs go elsewhere; the server is
    left once they have ended. Draining it again with "move" (a fault) moves them at
    their next call."""
    async def go(gw, http, base):
        server = {}
        for run_id in ("a", "b"):
            server[run_id] = (await chat(http, base, run_id, max_tokens=2))[1]["gyre"]["server"]
        gw.drain_server("s0", runs="keep")
        kept = [(await chat(http, base, "a", max_tokens=2))[1]["gyre"]["server"]
                for _ in range(3)]
        fresh = (await chat(http, base, "c", max_tokens=2))[1]["gyre"]["server"]
        draining = gw.server_load()["s0"]
        gw.drain_server("s0")  # e.g. its engine failed a check
        moved = (await chat(http, base, "a", max_tokens=2))[1]["gyre"]["server"]
        left = gw.server_load()["s0"]
        return server, kept, fresh, draining, moved, left
    server, kept, fresh, draining, moved, left = run_gateway(engines, tmp_path, go)
    assert server == {"a": "s0", "b": "s1"}
    assert kept == ["s0"] * 3 and fresh == "s1"
    assert draining["draining"] and draining["runs"] == 1, draining
    assert moved == "s1" and left["runs"] == 0, left
    assert [r.call for r in records(tmp_path, "a")] == [0, 1, 2, 3, 4]


def test_a_wait_drained_server_is_left_when_its_runs_end(engines, tmp_path):
    """The runtime's `wait` drain ends when no run is left on the server
    (runtime/handoff.py `_busy`): `end_run` is what leaves it, and a reopened server
    drops "keep" (a later plain drain moves its runs)."""
    async def go(gw, http, base):
        await chat(http, base, "a", max_tokens=2)
        gw.drain_server("s0", runs="keep")
        held = gw.server_load()["s0"]["runs"]
        gw.end_run("a")
        ended = gw.server_load()["s0"]["runs"]
        gw.reopen_server("s0")
        await chat(http, base, "b", max_tokens=2)
        gw.drain_server("s0")
        with pytest.raises(RuntimeError, match="no rollout server"):
            await gw.router.acquire("b", wait_s=0.1)
        return held, ended
    held, ended = run_gateway(engines, tmp_path, go, servers=("s0",))
    assert (held, ended) == (1, 0)


def test_a_migrate_drain_moves_runs_only_to_free_slots(engines, tmp_path):
    """runs="free" (the `migrate` drain): a run moves at its next call only where a
    server has a free slot; with every other server full it stays on the draining one
    (as the simulator has it) and moves at a later call once a slot is free. A plain
    drain ("move", a fault) still overfills: the run must leave a failed server."""
    async def go(gw, http, base):
        names = ["a"] + [f"f{i}" for i in range(7)]  # both servers filled, a on s0
        for run_id in names:
            await chat(http, base, run_id, max_tokens=2)
        where = {r: gw.router.affinity[r] for r in names}
        full = [gw.server_load()[s]["runs"] for s in ("s0", "s1")]
        gw.drain_server("s0", runs="free")
        free_then = gw.free_slots()
        stayed = (await chat(http, base, "a", max_tokens=2))[1]["gyre"]["server"]
        gw.end_run(next(r for r in names if where[r] == "s1"))
        free_after = gw.free_slots()
        moved = (await chat(http, base, "a", max_tokens=2))[1]["gyre"]["server"]
        gw.drain_server("s1")  # a fault on s1, none open: the run has no server now
        with pytest.raises(RuntimeError, match="no rollout server"):
            await gw.router.acquire("a", wait_s=0.1)
        with pytest.raises(ValueError, match="runs must be one of"):
            gw.drain_server("s0", runs="later")
        return where, full, free_then, stayed, free_after, moved
    where, full, free_then, stayed, free_after, moved = run_gateway(
        engines, tmp_path, go, servers=("s0", "s1"))
    assert where["a"] == "s0" and full == [4, 4], where
    assert free_then == 0 and stayed == "s0"
    assert free_after == 1 and moved == "s1"


def test_remove_refused_while_in_flight(engines, tmp_path):
    async def go(gw, http, base):
        call = asyncio.create_task(chat(http, base, "long", max_tokens=300, temperature=1.0))
        while gw.server_load()["s0"]["in_flight"] == 0:
            await asyncio.sleep(0.005)
        gw.drain_server("s0")
        with pytest.raises(RuntimeError, match="in flight"):
            gw.remove_server("s0")
        status = (await call)[0]
        gw.remove_server("s0")
        return status, gw.server_load()
    status, load = run_gateway(engines, tmp_path, go, servers=("s0",))
    assert status == 200 and load == {}


def test_a_reopened_server_takes_runs_again_and_unmoved_runs_keep_it(engines, tmp_path):
    """A cancelled drain (runtime/handoff.py): the server routes again at once, a call
    that waited for a server gets it, and a run that had not moved keeps its affinity."""
    async def go(gw, http, base):
        first = (await chat(http, base, "r", max_tokens=2))[1]["gyre"]["server"]
        gw.drain_server("s0")
        waiting = asyncio.create_task(chat(http, base, "w", max_tokens=2))
        await asyncio.sleep(0.2)
        waited = not waiting.done()
        gw.reopen_server("s0")
        late = await waiting
        again = (await chat(http, base, "r", max_tokens=2))[1]["gyre"]["server"]
        return first, waited, late, again, gw.server_load()
    first, waited, late, again, load = run_gateway(engines, tmp_path, go, servers=("s0",),
                                                   wait_s=2.0)
    assert first == "s0" and waited and again == "s0"
    assert late[0] == 200 and late[1]["gyre"]["server"] == "s0", late
    assert load["s0"]["draining"] is False and load["s0"]["runs"] == 2, load


def test_no_server_503_then_waiting_call_gets_added_server(engines, tmp_path):
    async def go(gw, http, base):
        status, body = await chat(http, base, "w")
        waiting = asyncio.create_task(chat(http, base, "w2"))
        await asyncio.sleep(0.2)
        gw.add_server("late", EngineClient(engines["urls"][1], engines["secret"]), 2)
        late = await waiting
        await gw.router.servers["late"].client.close()
        return status, body, late
    status, body, late = run_gateway(engines, tmp_path, go, servers=(), wait_s=1.0)
    assert status == 503 and "no rollout server" in body["error"]["message"]
    assert late[0] == 200 and late[1]["gyre"]["server"] == "late"


def test_errors_keep_gateway_serving(engines, tmp_path):
    async def go(gw, http, base):
        url = f"{base}/runs/e/v1/chat/completions"
        out = {}
        async with aiohttp.ClientSession() as anon:
            async with anon.post(url, json={"messages": HELLO}) as r:
                out["nokey"] = r.status
            async with anon.post(url, json={"messages": HELLO},
                                 headers={"Authorization": "Bearer wrong"}) as r:
                out["badkey"] = r.status
        for name, data in [("badjson", b"{nope"), ("nomsg", b"{}"),
                           ("big", b"[" + b"1," * (3 << 20) + b"1]")]:
            async with http.post(url, data=data,
                                 headers={"Content-Type": "application/json"}) as r:
                out[name] = (r.status, (await r.json())["error"]["message"])
        out["toolong"] = await chat(http, base, "e", [{"role": "user", "content": "fox " * 600}])
        dead = EngineClient(f"http://{HOST}:9", "x")  # nothing listens there
        gw.add_server("dead", dead, 1)
        gw.drain_server("s0")
        out["dead"] = await chat(http, base, "to-dead")  # fewest runs: "dead" (0 runs)
        out["suspect"] = gw.server_load()["dead"]["suspect"]  # it gave no answer
        out["fresh"] = await chat(http, base, "fresh")  # not to the suspect server
        gw.trust_server("dead")  # what a good health check does
        out["trusted"] = gw.server_load()["dead"]["suspect"]
        gw.drain_server("dead")
        out["after"] = await chat(http, base, "to-dead")
        await dead.close()
        out["calls"] = gw.calls_of("to-dead"), gw.calls_of("e")
        return out
    out = run_gateway(engines, tmp_path, go)
    assert out["nokey"] == 401 and out["badkey"] == 401
    assert out["badjson"][0] == 400 and "JSON" in out["badjson"][1]
    assert out["nomsg"][0] == 400 and "messages" in out["nomsg"][1]
    assert out["big"][0] == 413
    assert out["toolong"][0] == 400 and "positions" in out["toolong"][1]["error"]["message"]
    assert out["dead"][0] == 502 and "'dead'" in out["dead"][1]["error"]["message"]
    assert out["suspect"] and not out["trusted"]
    assert out["fresh"][0] == 200 and out["fresh"][1]["gyre"]["server"] == "s1"
    assert out["after"][0] == 200 and out["after"][1]["gyre"]["server"] == "s1"
    assert out["calls"] == (1, 0)


def test_concurrent_runs_balance_and_record(engines, tmp_path):
    run_ids = [f"p{i}" for i in range(6)]

    async def go(gw, http, base):
        async def agent(run_id):
            servers = []
            for turn in range(2):
                status, body = await chat(http, base, run_id, max_tokens=6, seed=turn)
                assert status == 200, body
                servers.append(body["gyre"]["server"])
            return servers
        placed = await asyncio.gather(*(agent(r) for r in run_ids))
        return placed, gw.server_load(), [gw.calls_of(r) for r in run_ids]
    placed, load, calls = run_gateway(engines, tmp_path, go)
    assert all(len(set(p)) == 1 for p in placed)  # affinity under concurrency
    idle = {"in_flight": 0, "draining": False, "suspect": False, "external": 0}
    assert load == {"s0": {"runs": 3, **idle}, "s1": {"runs": 3, **idle}}
    assert calls == [2] * 6
    loaded = load_store(tmp_path)
    assert not loaded.errors and sorted(loaded.runs) == run_ids
    assert all([d.call for d in loaded.runs[r]] == [0, 1] for r in run_ids)


def test_an_unmodified_openai_client_is_all_an_agent_needs(engines, tmp_path):
    """The official `openai` package, pointed at a run's base URL, chats and lists models;
    its calls are recorded like any other; a wrong key is refused the OpenAI way."""
    import openai

    async def fn(gw, http, base):
        client = openai.AsyncOpenAI(base_url=f"{base}/runs/oa-1/v1", api_key=key_of(gw, "oa-1"),
                                    max_retries=0)
        reply = await client.chat.completions.create(model="gyre-policy", messages=HELLO,
                                                     max_tokens=6, logprobs=True)
        models = await client.models.list()
        bad = openai.AsyncOpenAI(base_url=f"{base}/runs/oa-1/v1", api_key="wrong",
                                 max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="gyre-policy", messages=HELLO)
        await client.close()
        await bad.close()
        return reply, [m.id for m in models.data]

    reply, model_ids = run_gateway(engines, tmp_path, fn)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert reply.usage.completion_tokens == len(choice.logprobs.content) >= 1
    assert model_ids
    (call,) = records(tmp_path, "oa-1")
    assert len(call.output_ids) == reply.usage.completion_tokens

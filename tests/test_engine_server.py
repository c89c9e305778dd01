"""The embedded engine as a real process on loopback, driven through EngineClient."""

import asyncio

import aiohttp
import pytest
import torch

from gyre_slurm.engines import EngineClient, EngineError, start_engine, wait_healthy, write_secret
from gyre_slurm.models import tiny
from engine_helpers import START_S

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("engine-run")
    model_dir = tiny.make_model_dir(run_dir / "model", max_positions=256)
    tiny.save_weights(tiny.new_model(model_dir, seed=0), tiny.weights_dir(run_dir, 0))
    tiny.save_weights(tiny.new_model(model_dir, seed=1), tiny.weights_dir(run_dir, 1))
    secret = write_secret(run_dir / "engine.secret")
    proc = start_engine(model_dir=model_dir, host=HOST, weights_dir=tiny.weights_dir(run_dir, 0),
                        version=0, secret_file=run_dir / "engine.secret",
                        log_path=run_dir / "engine.log", ready_timeout_s=START_S)
    try:
        yield {"proc": proc, "secret": secret, "run_dir": run_dir, "model_dir": model_dir}
    finally:
        proc.stop(timeout_s=10)


def run(coro_fn, engine, timeout_s=30):
    async def main():
        client = EngineClient(engine["proc"].base_url, engine["secret"])
        try:
            return await asyncio.wait_for(coro_fn(client), timeout_s)
        finally:
            await client.close()
    return asyncio.run(main())


def reference_logprobs(model_dir, weights, prompt, output, temperature):
    model = tiny.new_model(model_dir)
    tiny.load_weights(model, weights)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / t, dim=-1)
    return [float(logp[i, tok]) for i, tok in enumerate(output)]


def test_health_and_models(engine):
    async def go(c):
        return await wait_healthy(c, timeout_s=10), await c.models()
    health, models = run(go, engine)
    assert health == {"status": "ok", "policy_version": 0, "active": 0, "cancelled": 0}
    assert models["data"][0]["id"] == "gyre-policy"


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_generate_logprobs_match_teacher_forcing(engine, temperature):
    prompt = [3, 10, 20, 30, 40]
    out = run(lambda c: c.generate(prompt, max_tokens=12, temperature=temperature, seed=5),
              engine)
    assert out["finish_reason"] == "length" and out["policy_version"] == 0
    assert len(out["output_ids"]) == len(out["output_logprobs"]) == 12
    ref = reference_logprobs(engine["model_dir"], tiny.weights_dir(engine["run_dir"], 0),
                             prompt, out["output_ids"], temperature)
    assert max(abs(a - b) for a, b in zip(out["output_logprobs"], ref)) < 1e-4
    again = run(lambda c: c.generate(prompt, max_tokens=12, temperature=temperature, seed=5),
                engine)
    assert again["output_ids"] == out["output_ids"]  # the seed fixes the sample


def test_stop_token_ends_and_is_included(engine):
    prompt = [3, 10, 20]
    greedy = run(lambda c: c.generate(prompt, max_tokens=8, temperature=0), engine)
    stop = greedy["output_ids"][3]
    out = run(lambda c: c.generate(prompt, max_tokens=8, temperature=0,
                                   stop_token_ids=[stop]), engine)
    first = greedy["output_ids"].index(stop)
    assert out["output_ids"] == greedy["output_ids"][:first + 1]
    assert out["finish_reason"] == "stop"


def test_concurrent_requests(engine):
    prompts = [[3, 10 + i, 20 + i] for i in range(6)]

    async def go(c):
        solo = [await c.generate(p, max_tokens=10, temperature=0.9, seed=i)
                for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(c.generate(p, max_tokens=10, temperature=0.9, seed=i)
                                          for i, p in enumerate(prompts)))
        return solo, together
    solo, together = run(go, engine)
    assert [s["output_ids"] for s in solo] == [t["output_ids"] for t in together]
    assert all(len(t["output_ids"]) == 10 for t in together)


def test_bad_requests_get_400_and_server_keeps_serving(engine):
    base, secret = engine["proc"].base_url, engine["secret"]
    bad = [{"max_tokens": 3}, {"prompt_ids": [1, 2]}, {"prompt_ids": [1, 99999], "max_tokens": 3},
           {"prompt_ids": [1], "max_tokens": -1}, {"prompt_ids": [1] * 300, "max_tokens": 1},
           {"prompt_ids": [], "max_tokens": 1}, {"prompt_ids": [1], "max_tokens": 1,
                                                 "temperature": -1}]

    async def go():
        headers = {"Authorization": f"Bearer {secret}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            answers = []
            for body in bad:
                async with s.post(base + "/generate", json=body) as r:
                    answers.append((r.status, (await r.json())["error"]))
            async with s.post(base + "/generate", data=b"{not json") as r:
                answers.append((r.status, (await r.json())["error"]))
            async with s.post(base + "/generate",
                              json={"prompt_ids": [3, 4], "max_tokens": 2}) as r:
                ok = (r.status, await r.json())
        return answers, ok
    answers, ok = asyncio.run(asyncio.wait_for(go(), 30))
    assert [a[0] for a in answers] == [400] * (len(bad) + 1)
    assert "prompt_ids" in answers[0][1] and "max_tokens" in answers[1][1]
    assert "99999" in answers[2][1] and "positions" in answers[4][1]
    assert ok[0] == 200 and len(ok[1]["output_ids"]) == 2


def test_auth_required(engine):
    base = engine["proc"].base_url

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/health") as r1:
                s1 = r1.status
            async with s.get(base + "/health", headers={"Authorization": "Bearer nope"}) as r2:
                s2 = r2.status
        return s1, s2
    assert asyncio.run(asyncio.wait_for(go(), 10)) == (401, 401)
    with pytest.raises(EngineError) as info:
        run(lambda c: c.generate([3], max_tokens=1), {**engine, "secret": "wrong"})
    assert info.value.status == 401


def test_load_weights_release_resume(engine):
    run_dir = engine["run_dir"]
    prompt = [3, 11, 22, 33]

    async def go(c):
        v0 = await c.generate(prompt, max_tokens=16, temperature=0)
        # a generation in flight when the load arrives finishes under the old version
        inflight = asyncio.create_task(c.generate(prompt, max_tokens=200, temperature=0))
        while (await c.health())["active"] == 0:
            await asyncio.sleep(0.005)
        await c.load_weights(tiny.weights_dir(run_dir, 1), 1)
        old = await inflight
        v1 = await c.generate(prompt, max_tokens=16, temperature=0)
        health1 = await c.health()
        await c.release()
        released = await c.health()
        with pytest.raises(EngineError) as info:
            await c.generate(prompt, max_tokens=2)
        await c.resume(tiny.weights_dir(run_dir, 0), 0)
        back = await c.generate(prompt, max_tokens=16, temperature=0)
        return v0, old, v1, health1, released, info.value.status, back
    v0, old, v1, health1, released, status, back = run(go, engine)
    assert old["policy_version"] == 0 and old["output_ids"][:16] == v0["output_ids"]
    assert v0["policy_version"] == 0 and v1["policy_version"] == 1
    assert v0["output_ids"] != v1["output_ids"]
    assert health1["policy_version"] == 1
    assert released["status"] == "released" and status == 503
    assert back["output_ids"] == v0["output_ids"] and back["policy_version"] == 0


def test_an_engine_log_tail_keeps_the_start_of_a_line_longer_than_the_tail(tmp_path):
    """What an engine's failure carries of its log: the last lines, each cut to 400
    characters. vLLM names its ~300 supported architectures on the line that says the
    model's is not one: the last 4000 bytes held only the middle of that list."""
    from gyre_slurm.engines.launcher import log_tail

    log = tmp_path / "engine.log"
    names = ", ".join(f"'Arch{i}ForCausalLM'" for i in range(600))
    log.write_text("starting\n" * 2000 + "Traceback (most recent call last):\n"
                   "ValidationError: 1 validation error for ModelConfig\n"
                   f"  Value error, Model architectures ['FooForCausalLM'] are not supported "
                   f"for now. Supported architectures: dict_keys([{names}])\n"
                   "For further information visit https://errors.pydantic.dev\n")
    tail = log_tail(log)
    assert "Model architectures ['FooForCausalLM'] are not supported for now" in tail
    assert tail.endswith("For further information visit https://errors.pydantic.dev")
    assert "'Arch599ForCausalLM'" not in tail and " [...]" in tail
    assert 3000 < len(tail) <= 4400, len(tail)
    assert log_tail(tmp_path / "none.log") == ""


def test_the_engine_serves_a_sharded_tied_checkpoint(tmp_path):
    """A model.path the way small published models come: tie_word_embeddings, the
    checkpoint in shards with their index and without lm_head.weight. The engine asked
    for model.safetensors (every server of such a run failed to start); it serves the
    shards, its log-probs those of the tied model."""
    import json

    model_dir = tiny.make_model_dir(tmp_path / "hf", family="qwen2", max_positions=256)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tiny.save_weights_into(tiny.new_model(model_dir, seed=3), model_dir, shards=2)
    assert not (model_dir / "model.safetensors").exists()
    secret = write_secret(tmp_path / "engine.secret")
    proc = start_engine(model_dir=model_dir, host=HOST, weights_dir=model_dir, version=0,
                        secret_file=tmp_path / "engine.secret", log_path=tmp_path / "engine.log",
                        ready_timeout_s=START_S)
    try:
        prompt = [3, 10, 20, 30]
        out = run(lambda c: c.generate(prompt, max_tokens=6, temperature=1.0, seed=2),
                  {"proc": proc, "secret": secret})
    finally:
        proc.stop(timeout_s=10)
    ref = reference_logprobs(model_dir, model_dir, prompt, out["output_ids"], 1.0)
    assert max(abs(a - b) for a, b in zip(out["output_logprobs"], ref)) < 1e-4

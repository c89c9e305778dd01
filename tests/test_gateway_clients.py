"""Each client library people write agents with (openai, openai-agents, langchain-openai,
pydantic-ai, litellm), unmodified and with its default settings, holds a tool-using
two-question conversation with a run's gateway URL and key (`tests/client_agents.py`,
run in the `clients` role environment); the run's calls are one chain of its prefix
tree (every call's prompt continues the previous call's prompt and output, token for
token), whatever each library does to the messages it sends back.

The model behind the gateway is a scripted engine on the engine protocol (a tiny random
model never writes a tool call): it calls get_weather for the city the last user
message names, and answers in words after a tool's result.
"""

import asyncio
import json
import os
import re
from pathlib import Path

import pytest
from aiohttp import web

from gyre_slurm.engines import EngineClient
from gyre_slurm.gateway import Gateway
from gyre_slurm.models import tiny
from gyre_slurm.traj.delta import decode_run
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.store import CallStoreWriter, load_store

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
SCRIPT = Path(__file__).resolve().parent / "client_agents.py"
TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)


class WeatherModel:
    """The engine protocol's /generate, answering from the conversation it is given."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def reply(self, prompt: str) -> str:
        turns = TURN.findall(prompt)
        role, text = turns[-2] if turns[-1][0] == "assistant" else turns[-1]
        if role == "tool":
            city = text.rsplit(" in ", 1)[-1].split("\n")[0].strip()
            return f"It is sunny in {city}."
        city = "Rome" if "Rome" in text else "Paris"
        return ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n'
                '</tool_call>' % city)

    async def generate(self, request):
        body = await request.json()
        self.calls += 1
        text = self.reply(self.tok.decode(body["prompt_ids"]))
        ids = self.tok.encode(text, add_special_tokens=False) + [self.end]
        ids = ids[:body["max_tokens"]]
        return web.json_response({"output_ids": ids, "output_logprobs": [-0.1] * len(ids),
                                  "finish_reason": "stop", "policy_version": 0})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_model_dir(tmp_path_factory.mktemp("clients") / "model", max_positions=8192)


def converse(model_dir, run_dir, python, library):
    async def main():
        model = WeatherModel(tiny.load_tokenizer(model_dir))
        app = web.Application()
        app.router.add_post("/generate", model.generate)
        engine = web.AppRunner(app, access_log=None)
        await engine.setup()
        await web.TCPSite(engine, HOST, 0).start()
        writer = CallStoreWriter(run_dir, "gateway")
        gw = Gateway(model_dir=model_dir, call_writer=writer, wait_for_server_s=5)
        port = await gw.start(HOST, 0)
        client = EngineClient(f"http://{HOST}:{engine.addresses[0][1]}", "unused")
        gw.add_server("s0", client, capacity=4)
        key = gw.open_run("s0000-p000-g00")
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
        env.update(OPENAI_BASE_URL=f"http://{HOST}:{port}/runs/s0000-p000-g00/v1",
                   OPENAI_API_KEY=key, LITELLM_LOCAL_MODEL_COST_MAP="True",
                   HF_HUB_OFFLINE="1", NO_PROXY="*")
        try:
            proc = await asyncio.create_subprocess_exec(
                python, str(SCRIPT), library, env=env, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 180)
            return proc.returncode, out.decode(), err.decode(), model.calls
        finally:
            await gw.stop()
            await client.close()
            await engine.cleanup()
            writer.close()
    return asyncio.run(main())


@pytest.mark.parametrize("library", ["openai", "openai-agents", "langchain", "pydantic-ai",
                                     "litellm"])
def test_client_library_conversation_is_one_chain(model_dir, clients_python, tmp_path, library):
    code, out, err, model_calls = converse(model_dir, tmp_path, clients_python, library)
    assert code == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tool_calls"] == ["Paris", "Rome"], result
    assert "sunny in Paris" in result["answers"][0] and "sunny in Rome" in result["answers"][1]
    deltas = load_store(tmp_path).runs["s0000-p000-g00"]
    records = list(decode_run(deltas))
    assert len(records) == model_calls == 4  # call, answer; call, answer
    for a, b in zip(records, records[1:]):
        pa, oa = a.prompt_ids.tolist(), a.output_ids.tolist()
        assert b.prompt_ids.tolist()[:len(pa) + len(oa)] == pa + oa, library
    [trajectory] = process_run(deltas, max_per_run=5).trajectories
    assert int(trajectory.loss_mask.sum()) == sum(len(r.output_ids) for r in records)

"""An external scaffold, mini-swe-agent (unmodified, in its own environment), runs a task
against the gateway in this process, in front of a real embedded engine process; its
calls become a run in the call store, then a prefix tree and trajectories."""

import asyncio
import sys
from pathlib import Path

import pytest

from gyre_slurm.agents.external import (
    mini_swe_agent_command, mini_swe_agent_summary, run_base_url, run_external_agent,
    run_external_agent_async,
)
from engine_helpers import tiny_engines
from gyre_slurm.engines import EngineClient
from gyre_slurm.gateway import Gateway
from gyre_slurm.models import tiny
from gyre_slurm.traj.delta import decode_run
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.store import CallStoreWriter, load_store

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
STEP_LIMIT = 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # mini-swe-agent's prompts are long (its instructions, then a format-error message per
    # call) and the tiny tokenizer splits unfamiliar text finely: room for ~3 calls.
    with tiny_engines(tmp_path_factory.mktemp("ext-engine"), max_positions=8192) as e:
        yield dict(e, url=e["urls"][0])


def with_gateway(engine, run_dir, fn):
    """Gateway (+ one server) in this event loop; `await fn(gateway_url)`."""
    async def main():
        writer = CallStoreWriter(run_dir, "gateway")
        gw = Gateway(model_dir=engine["model_dir"], call_writer=writer,
                     wait_for_server_s=10, default_max_tokens=16)
        client = EngineClient(engine["url"], engine["secret"])
        port = await gw.start(HOST, 0)
        try:
            gw.add_server("s0", client, capacity=8)
            return await fn(gw, f"http://{HOST}:{port}")
        finally:
            await gw.stop()
            await client.close()
            writer.close()
    return asyncio.run(main())


@pytest.mark.slow
def test_mini_swe_agent_run_becomes_trajectories(engine, minisweagent_python, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "hello.txt").write_text("hello fox\n")
    run_dir = tmp_path / "run"

    async def go(gw, url):
        scaffold = mini_swe_agent_command(
            python=minisweagent_python, task="Print the content of hello.txt, then finish.",
            workdir=workdir, gateway_url=url, run_id="mini-1", out_dir=tmp_path / "agent",
            step_limit=STEP_LIMIT, max_tokens=24, temperature=1.0)
        rec = await run_external_agent_async(
            scaffold.command, base_url=url, api_key=gw.open_run("mini-1"), run_id="mini-1",
            workdir=workdir,
            env_extra=scaffold.env, timeout_s=120, log_path=tmp_path / "agent" / "mini.log")
        return scaffold, rec, gw.calls_of("mini-1")

    scaffold, rec, num_calls = with_gateway(engine, run_dir, go)
    log = Path(rec["log_path"]).read_text()
    assert rec["status"] == "ok" and rec["exit_code"] == 0, log[-3000:]
    summary = mini_swe_agent_summary(scaffold.output_path)
    # A tiny model writes no bash block: mini-swe-agent answers each reply with a format
    # error (a user message) until its limits end the run; every call was a model call.
    assert summary["api_calls"] == STEP_LIMIT == num_calls, (summary, log[-3000:])
    assert summary["exit_status"] in ("LimitsExceeded", "RepeatedFormatError"), summary
    assert set(summary["roles"]) <= {"system", "user", "assistant", "exit"}

    loaded = load_store(run_dir)
    assert not loaded.errors and list(loaded.runs) == ["mini-1"]
    deltas = loaded.runs["mini-1"]
    assert [d.call for d in deltas] == list(range(STEP_LIMIT))
    tok = tiny.load_tokenizer(engine["model_dir"])
    records = list(decode_run(deltas))
    first = tok.decode(records[0].prompt_ids.tolist())
    assert first.startswith("<|im_start|>system\nYou are a helpful assistant")
    assert "<|im_start|>user\nPlease solve this issue: Print the content of hello.txt" in first
    assert first.endswith("<|im_start|>assistant\n")
    # Each call re-sends the conversation so far plus a user message (the format error;
    # mini-swe-agent keeps no assistant turn of a reply it could not parse), so the
    # previous prompt, less its assistant header, is a prefix of the next one.
    header = len(tok.encode("assistant\n", add_special_tokens=False))
    for a, b in zip(records, records[1:]):
        shared = a.prompt_ids.tolist()[:-header]
        assert b.prompt_ids.tolist()[:len(shared)] == shared
        assert tok.decode(b.prompt_ids[len(shared):].tolist()).startswith("user\n")
    generated = sum(len(r.output_ids) for r in records)
    assert generated > 0

    result = process_run(deltas, max_per_run=8)
    assert len(result.trajectories) >= 1
    assert sum(t.num_trained for t in result.trajectories) == generated
    assert result.selection.num_covered == result.selection.num_trainable == generated


def test_run_external_agent_env_status_and_timeout(tmp_path):
    show = [sys.executable, "-c", "import os; print(os.environ['OPENAI_BASE_URL'], "
            "os.environ['OPENAI_API_KEY'], os.environ['GYRE_RUN_ID'], os.environ['X'], "
            "os.getcwd())"]
    rec = run_external_agent(show, base_url="http://127.0.0.1:9", api_key="k", run_id="r1",
                             workdir=tmp_path, env_extra={"X": "y"}, timeout_s=30)
    assert rec["status"] == "ok" and rec["exit_code"] == 0 and rec["error"] is None
    assert Path(rec["log_path"]).read_text().split() == [
        "http://127.0.0.1:9/runs/r1/v1", "k", "r1", "y", str(tmp_path)]

    fail = run_external_agent([sys.executable, "-c", "raise SystemExit(3)"],
                              base_url="http://127.0.0.1:9", api_key="k", run_id="r2",
                              workdir=tmp_path, timeout_s=30)
    assert fail["status"] == "failed" and fail["exit_code"] == 3
    assert "exited with code 3" in fail["error"] and fail["log_path"] in fail["error"]

    missing = run_external_agent(["/no/such/scaffold"], base_url="http://127.0.0.1:9",
                                 api_key="k", run_id="r3", workdir=tmp_path, timeout_s=30)
    assert missing["status"] == "failed" and missing["exit_code"] is None

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    slow = run_external_agent(sleeper, base_url="http://127.0.0.1:9", api_key="k",
                              run_id="r4", workdir=tmp_path, timeout_s=0.5)
    assert slow["status"] == "timeout" and slow["t_end"] - slow["t_start"] < 10
    slow_async = asyncio.run(run_external_agent_async(
        sleeper, base_url="http://127.0.0.1:9", api_key="k", run_id="r5", workdir=tmp_path,
        timeout_s=0.5))
    assert slow_async["status"] == "timeout" and slow_async["exit_code"] is not None


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gateway's root"):
        run_base_url("http://127.0.0.1:1/runs/x/v1", "r")
    with pytest.raises(ValueError, match="not a directory"):
        run_external_agent(["true"], base_url="http://127.0.0.1:1", api_key="k", run_id="r",
                           workdir=tmp_path / "nope", timeout_s=1)
    with pytest.raises(ValueError, match="step_limit"):
        mini_swe_agent_command(python="python", task="t", workdir=tmp_path,
                               gateway_url="http://127.0.0.1:1", run_id="r",
                               out_dir=tmp_path, step_limit=0)

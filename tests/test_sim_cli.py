"""`gyre sim` as a user runs it: JSON shape, plot, sweep, workload files, bad input."""

import json

import pytest

from gyre_slurm.config.presets import preset_path
from gyre_slurm.config.schema import load_config
from gyre_slurm.sched.policies import named_policy
from gyre_slurm.sim import limits
from gyre_slurm.sim.runner import compare, simulate
from gyre_slurm.sim.workload import sample_workload

ROOT_CONFIGS = __import__("pathlib").Path(__file__).resolve().parent.parent / "configs"


def test_json_has_the_documented_shape(gyre):
    out = json.loads(gyre("sim", "--preset", "small", "--json").stdout)
    assert out["preset"] == "small"
    assert out["lower_bound_s"] > 0
    for name in ("elastic", "colocate", "async", "async-even", "elastic-nostream",
                 "elastic-nofloor", "elastic-naive", "async-stream"):
        entry = out["policies"][name]
        assert entry["makespan_s"] >= out["lower_bound_s"] - 1e-6
        assert 0 < entry["busy_fraction"] <= 1
        assert isinstance(entry["handoffs"], int)
    assert any(k.startswith("async-split-") for k in out["policies"])
    best = min(v["makespan_s"] for k, v in out["policies"].items() if k.startswith("async-split-"))
    assert out["policies"]["async"]["makespan_s"] == best
    assert out["policies"]["colocate"]["max_staleness"] == 0


def test_where_a_replica_needs_every_cell_there_is_no_async_row(gyre):
    """Two one-node cells and a replica of two nodes: no fixed split leaves a cell to roll
    out, so the comparison has elastic and colocate only (it was an IndexError)."""
    sets = ["cluster.num_nodes=2", "cluster.gpus_per_node=0", "training.min_replica_nodes=2",
            "scheduler.min_rollout_cells=0", "scheduler.min_train_cells=0"]
    args = [a for kv in sets for a in ("--set", kv)]
    out = json.loads(gyre("sim", "--preset", "small", "--json", *args).stdout)
    assert out["best_async_split"] is None
    assert not any(k.startswith("async") for k in out["policies"])
    assert {"elastic", "colocate", "elastic-naive", "colocate-stream"} <= set(out["policies"])
    assert set(out["elastic_speedup"]) == {"vs_colocate"}
    table = gyre("sim", "--preset", "small", "--no-ablations", *args).stdout
    assert "no async split (a model replica needs every cell)" in " ".join(table.split())
    refused = gyre("sim", "--preset", "small", *args, "--set", "scheduler.policy=async",
                   check=False)
    assert refused.returncode == 2 and "Use colocate or elastic" in refused.stderr


def test_elastic_beats_both_baselines_on_the_small_preset():
    out = compare(load_config(preset_path("small")), ablations=False)
    r = {k: v.makespan_s for k, v in out["results"].items()}
    assert r["elastic"] < r["colocate"]
    assert r["elastic"] < r["async"]


def test_plot_writes_a_png(gyre, tmp_path):
    png = tmp_path / "t.png"
    gyre("sim", "--preset", "small", "--no-ablations", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    svg = tmp_path / "t.svg"  # the format the suffix names, written whole (no temp left)
    gyre("sim", "--preset", "small", "--no-ablations", "--plot", str(svg))
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png", "t.svg"]


def test_sweep_runs_each_value(gyre):
    out = json.loads(gyre("sim", "--preset", "small", "--no-ablations", "--json",
                          "--sweep", "cell_nodes=1,2").stdout)
    assert out["sweep"] == "cluster.cell_nodes"
    assert [p["value"] for p in out["points"]] == [1, 2]
    seeds = json.loads(gyre("sim", "--preset", "small", "--no-ablations", "--json",
                            "--sweep", "seed=1,2").stdout)
    assert seeds["sweep"] == "seed"
    a, b = (p["policies"]["elastic"]["makespan_s"] for p in seeds["points"])
    assert a != b  # another seed, another workload
    unknown = gyre("sim", "--preset", "small", "--sweep", "nosuchkey=1,2", check=False)
    assert unknown.returncode == 2 and "in no section" in unknown.stderr


def test_workload_file_with_a_trace(gyre):
    path = ROOT_CONFIGS / "workload-example.yaml"
    cfg = load_config(path)
    w = sample_workload(cfg, base_dir=path.parent)
    trace = [float(x) for x in (ROOT_CONFIGS / "workload-example-durations.txt").read_text().split()]
    assert set(w.work_s) <= {min(x, cfg.workload.duration.max_s) for x in trace}
    out = json.loads(gyre("sim", "--workload", str(path), "--json", "--no-ablations").stdout)
    assert out["preset"] == "workload-example"


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--workload", "missing.yaml"], "cannot read config file"),
    (["--preset", "small", "--set", "workload.num_step=3"], "Did you mean 'workload.num_steps'"),
    (["--preset", "small", "--set", "workload.duration.dist=trace"], "trace_file is not set"),
    (["--preset", "small", "--set", "workload.duration.dist=trace",
      "--set", "workload.duration.trace_file=none.txt"], "none.txt"),
    (["--preset", "small", "--sweep", "cell_nodes"], "expected KEY=V1,V2"),
    # values that would make the simulation run for ever, overflow or exhaust memory:
    # refused up front (sim/limits.py, config/phases.py, the loader's finite numbers)
    (["--preset", "small", "--set", "workload.duration.mean_s=.inf"],
     "workload.duration.mean_s: expected a finite number, got inf"),
    (["--preset", "small", "--set", "workload.tokens_mean=1e999"],
     "workload.tokens_mean: expected a finite number"),
    (["--preset", "small", "--set", "workload.phases=[{from_step: 0, growth_per_step: 1e300}]"],
     "workload.phases[0]: durations reach x1.01e+304"),
    (["--preset", "small", "--set", "workload.phases=[{from_step: 1, tokens_scale: 1e-9}]"],
     "tokens reach x1e-09"),
    (["--preset", "small", "--set", "workload.duration.mean_s=1e9"], "policy ticks"),
    (["--preset", "small", "--set", "training.node_tokens_per_s=1e-30"], "policy ticks"),
    (["--preset", "small", "--set", "scheduler.interval_s=1e-9"], "raise scheduler.interval_s"),
    (["--preset", "small", "--set", "workload.phases=[{from_step: 0, turns: 1000000000}]"],
     "policy ticks"),
    (["--preset", "small", "--set", "workload.num_steps=100000000"],
     "100,000,000 x 8 x 4 = 3,200,000,000 runs; a job (and a simulation) books"),
    (["--preset", "small", "--set", "cluster.num_nodes=100000"], "100,000 cells"),
    (["--preset", "small", "--set", "handoff.engine_start_s=1e8"],
     "handoff.engine_start_s = 1e+08 s is longer than"),
    (["--preset", "small", "--set", "rollout.weight_sync_s=1e8"], "rollout.weight_sync_s"),
    # any key of seconds: past 1e9 s an OverflowError where the runtime waits on it
    (["--preset", "small", "--set", "handoff.engine_start_s=1e30"],
     "handoff.engine_start_s must be <= 1e+09 (seconds"),
    (["--preset", "small", "--set", "faults.agent_lost_s=1e300"],
     "faults.agent_lost_s must be <= 1e+09"),
    (["--preset", "small", "--set", "seed=-1"], "seed = -1: seeds are whole numbers"),
    # finite but past what the forecast's and the simulator's arithmetic holds (each was a
    # traceback: an overflow in the forecast's grid, a rate table of 1e20 entries, a
    # division by a throughput that underflowed to 0)
    (["--preset", "small", "--set", "workload.duration.mean_s=1e308"],
     "workload.duration.mean_s must be <= 1e+09"),
    (["--preset", "small", "--set", "workload.duration.sigma=1e308"],
     "workload.duration.sigma must be <= 5"),
    (["--preset", "small", "--set", "workload.phases=[{from_step: 1, sigma: 50}]"],
     "sigma must be in [0, 5]"),
    (["--preset", "small", "--set", "rollout.runs_per_node=99999999999999999999"],
     "rollout.runs_per_node must be <= 100,000"),
    (["--preset", "small", "--set", "rollout.runs_per_node=100000", "--set",
      "cluster.num_nodes=32", "--set", "cluster.cell_nodes=16"],
     "the simulator takes at most 1,000,000"),
    (["--preset", "small", "--set", "training.scaling_efficiency=1e-300"],
     "a throughput of 0 tokens/s (a float underflow)"),
    # --plot is checked before the simulation runs, not when the figure is written
    (["--preset", "small", "--plot", "/nonexistent-dir/x.png"],
     "the folder /nonexistent-dir does not exist"),
    (["--preset", "small", "--plot", "timelines.txt"], "name the image with one of"),
    (["--preset", "small", "--plot", "x.png", "--sweep", "seed=1,2"],
     "it does not go with --sweep"),
])
def test_bad_input_is_a_clear_error(gyre, args, message):
    proc = gyre("sim", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe12\n", "not UTF-8 text (byte 0)"),
    (b"600\n1e10\n", "line 2: a duration of 1e+10 s; durations are seconds"),
    (b"600\nnan\n", "line 2: 'nan': durations must be positive numbers"),
    (b"# seconds\n600\n\n-5\n", "line 4: '-5': durations must be positive numbers"),
    (b"600 abc\n", "line 1: 'abc' is not a number; expected one duration in seconds per line"),
    (b"1,2\n", "line 1: '1,2' is not a number"),
    (b"# only a comment\n\n", "no durations in it"),
    (None, "not a regular file"),  # a folder
    ("/dev/zero", "not a regular file"),  # a device: reading it would never end
])
def test_a_bad_trace_file_is_a_clear_error(gyre, tmp_path, content, message):
    trace = tmp_path / "trace.txt"
    if content is None:
        trace.mkdir()
    elif isinstance(content, str):
        trace = content
    else:
        trace.write_bytes(content)
    workload = tmp_path / "workload.yaml"
    workload.write_text(f"workload:\n  duration: {{dist: trace, trace_file: {trace}}}\n")
    proc = gyre("sim", "--workload", str(workload), "--no-ablations", check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_simulation_that_runs_past_the_limit_stops_with_a_clear_error(monkeypatch):
    """What no check up front foresees (here handoffs of 5,000 s, each within the limit,
    that colocate makes twice a step) stops the simulation once it has simulated
    MAX_TICKS policy ticks, as a user error (the limit lowered to 1,000 ticks, 10,000
    simulated seconds at the preset's 10 s interval, for the test's time)."""
    monkeypatch.setattr(limits, "MAX_TICKS", 1000)
    cfg = load_config(preset_path("small"), ["handoff.engine_start_s=5000"])
    workload = sample_workload(cfg)
    with pytest.raises(limits.TooLargeToSimulate, match="passed 1e.04 s"):
        simulate(cfg, named_policy(cfg, "colocate"), workload)
    assert simulate(cfg, named_policy(cfg, "async-even"), workload).makespan_s < 10_000


def test_the_table_is_whole_when_stdout_is_not_a_terminal(gyre):
    """Piped or redirected, rich assumed 80 columns and cut the cells (`89.…`)."""
    out = gyre("sim", "--preset", "small").stdout  # captured: not a terminal
    rows = [ln for ln in out.splitlines() if ln.startswith(("┃", "│"))]
    assert "…" not in out, out
    assert rows[0].split("┃")[1:-1] and [c.strip() for c in rows[0].split("┃")[1:-1]] == [
        "policy", "hours", "x bound", "vs elastic", "busy", "handoffs", "migrated"], out
    names = [r.split("│")[1].strip() for r in rows[1:]]
    assert {"elastic", "colocate", "async", "elastic-nostream", "async-stream"} <= set(names)
    assert all(r.split("│")[5].strip().endswith("%") for r in rows[1:]), out  # busy, whole

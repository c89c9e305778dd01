"""`gyre status` (one frame, JSON, the live view under tmux) and `gyre report`, on a real
run dir made here with `gyre run` (an elastic run with handoffs, ~30 s), or the one
GYRE_EXAMPLE_RUN_DIR names."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_slurm.monitor import model
from test_runtime_e2e import WATERLEVEL

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = Path(os.environ["GYRE_EXAMPLE_RUN_DIR"]) if "GYRE_EXAMPLE_RUN_DIR" in os.environ \
    else None
TINY = ["workload.num_steps=4", "workload.prompts_per_step=2", "workload.group_size=4",
        "rollout.runs_per_node=4", "agent.max_tokens=8", "scheduler.confirm_s=0.3",
        "scheduler.min_dwell_s=0.5", "workload.duration.mean_s=1.0", *WATERLEVEL,
        "agent.env_params={tool_mean_s: 1.0, tool_sigma: 0.5, tool_max_s: 3.0}"]
AGENT_LOST = {"kind": "agent_lost", "node": 2, "error": "node agent 2 silent for 9.0s"}


def gyre(*args: str, env: dict | None = None, timeout_s: float = 120):
    base = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "COLUMNS")}
    env = dict(base, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "gyre_slurm", *args], env=env,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def source_run(tmp_path_factory) -> Path:
    if EXAMPLE is not None:
        return EXAMPLE
    run_dir = tmp_path_factory.mktemp("monitor") / "run"
    sets = [a for item in TINY for a in ("--set", item)]
    proc = gyre("run", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run_dir), *sets,
                timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture
def run_dir(source_run, tmp_path) -> Path:
    """A copy of the run dir's two monitor inputs (tests may append to it)."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("status.json", "events.jsonl"):
        shutil.copy(source_run / name, out / name)
    return out


def append_event(run_dir: Path, event: dict, *, newline: bool = True) -> None:
    line = json.dumps({"t": time.time(), **event})
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(line + ("\n" if newline else ""))


def test_once_shows_header_cells_progress_and_events(run_dir):
    status = json.loads((run_dir / "status.json").read_text())
    proc = gyre("status", str(run_dir), "--once")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    n = status["num_steps"]
    assert f"version {n}/{n}" in out and "(final)" in out and "policy" in out
    assert f"step {status['version']}/{n}" in out and "100%" in out
    for cell in status["cells"]:
        assert f"cell {cell['cell']} [{','.join(cell['nodes'])}]" in out
    roles = {c["role"] for c in status["cells"]}
    assert all(r in out for r in roles)
    assert "waterlevel" in out and "runs/min" in out and "tokens/s" in out
    assert "\x1b[" not in out  # not a terminal: plain text
    events = list(model.EventTail(run_dir / "events.jsonl").poll())
    last_step = [e for e in events if e["kind"] == "step"][-1]
    assert f"step {last_step['step']} -> version {last_step['version']}: mean reward" in out
    decisions = [e for e in events if e["kind"] == "decision"]
    shown = [line for line in out.splitlines() if line.startswith("+")]
    cell_lines = [line for line in out.splitlines() if line.lstrip().startswith("cell ")]
    if decisions:  # an elastic run with handoffs: reasons and handoff times are shown
        assert "handoff" in out
        if any(" decision " in line for line in shown):  # within the latest events
            assert decisions[-1]["reason"][:30] in out
        handoffs = [e for e in events if e["kind"] == "handoff"]
        if handoffs:  # a handoff done: its cells show it on their strips (the strip's
            # last 40 s hold it: this run's role history is shorter than that)
            for c in handoffs[-1]["cells"]:
                line = next(line for line in cell_lines
                            if line.lstrip().startswith(f"cell {c} "))
                assert "-" in line.split()[-1], out
            assert any("T" in line.split()[-1] for line in cell_lines), out
        else:  # the job ended first (it started late on a loaded machine, 8 s before
            # its end): the cells still moving are shown on their way, as status.json has them
            moving = [c for c in status["cells"] if c.get("target")]
            assert moving, status["cells"]
            for c in moving:
                assert any(line.lstrip().startswith(f"cell {c['cell']} ")
                           and f"{c['role']} -> {c['target']}" in line for line in cell_lines), out
    assert "FAILURES" not in out


def cut_to_mid_run(run_dir: Path, *, status_age_s: float) -> dict:
    """Make the copy look like a live run after its first step: events up to that step,
    status.json not final and `status_age_s` old."""
    lines = (run_dir / "events.jsonl").read_text().splitlines(keepends=True)
    first_step = next(i for i, line in enumerate(lines) if '"kind": "step"' in line)
    (run_dir / "events.jsonl").write_text("".join(lines[:first_step + 1]))
    status = json.loads((run_dir / "status.json").read_text())
    status.update(final=False, version=1, t=time.time() - status_age_s)
    (run_dir / "status.json").write_text(json.dumps(status))
    return status


def test_a_live_run_shows_an_eta_and_a_stale_status(run_dir):
    status = cut_to_mid_run(run_dir, status_age_s=0)
    out = gyre("status", str(run_dir), "--once").stdout
    assert f"step 1/{status['num_steps']}" in out and "ETA" in out
    assert "(final)" not in out
    # the age is the time gyre took to start: on a loaded machine that passed 10 s once
    # (CI), so the mark is checked against the age printed, not assumed fresh
    age = re.search(r"status (\d+)s old", out)
    assert age, out
    shown = int(age.group(1))  # rounded: an age of 10.3 s shows "10s" and is stale
    assert (shown >= 10) if "(stale)" in out else (shown <= 10), out
    status = cut_to_mid_run(run_dir, status_age_s=30)
    out = gyre("status", str(run_dir), "--once").stdout
    age = re.search(r"status (\d+)s old\s+\(stale\)", out)  # rich may wrap there
    assert age and int(age.group(1)) >= 30, out  # 30 s, and the time gyre took to start
    # the colour follows the age: rendered at fixed ages, since a loaded machine's start
    # time would move a live age across the 60 s line
    from rich.console import Console

    from gyre_slurm.monitor import view
    for age_s, code in ((5, "32"), (30, "33"), (90, "1;31")):
        snap = model.Snapshot(run_dir=run_dir, status=status, events=[],
                              now=status["t"] + age_s)
        console = Console(force_terminal=True, color_system="standard", width=1000)
        with console.capture() as cap:
            console.print(view.header(snap))
        assert f"\x1b[{code}mstatus {age_s}s old" in cap.get(), (age_s, cap.get())
        assert ("(stale)" in cap.get()) == (age_s > 10)


def test_failures_are_listed_in_red(run_dir):
    append_event(run_dir, AGENT_LOST)
    append_event(run_dir, {"kind": "run_end", "run_id": "s0009-p000-g00", "status": "failed",
                           "reward": None, "error": "tool crashed"})
    plain = gyre("status", str(run_dir), "--once").stdout
    assert "FAILURES (2):" in plain and "node agent 2 silent" in plain
    assert "run s0009-p000-g00 failed: tool crashed" in plain
    coloured = gyre("status", str(run_dir), "--once", env={"FORCE_COLOR": "1"}).stdout
    red = [line for line in coloured.splitlines() if "agent_lost" in line]
    assert red and all("\x1b[1;31m" in line for line in red)


def test_dropped_decisions_and_cancelled_drains_are_listed(run_dir):
    append_event(run_dir, {"kind": "decision_dropped", "cell": 2, "to": "train",
                           "cause": "release", "why": "the cell is draining in a handoff to "
                           "train", "reason": "r", "drain": "wait", "t_run_s": 9.0})
    append_event(run_dir, {"kind": "handoff_cancelled", "direction": "rollout->train",
                           "cells": [2], "drain_s": 0.31, "others": []})
    plain = gyre("status", str(run_dir), "--once").stdout
    assert "decision cell 2 -> train (release) not carried out" in plain
    assert "handoff rollout->train of cells [2] cancelled" in plain


def test_rollout_slots_are_counted_against_the_run_dirs_cell_capacity(source_run, tmp_path):
    """A cell serves rollout.runs_per_node x cluster.cell_nodes runs (a run dir of the older
    layout: runtime.runs_per_cell); the live view's occupancy needs it."""
    from gyre_slurm.config.schema import load_config

    cfg = load_config(source_run / "config.yaml")
    assert model.cell_capacity(source_run) == cfg.cell_capacity == 4
    out = gyre("status", str(source_run), "--once").stdout
    assert re.search(r"rollout slots \d+% full", out), out
    (tmp_path / "config.yaml").write_text("runtime: {runs_per_cell: 6}\n")
    assert model.cell_capacity(tmp_path) == 6
    (tmp_path / "config.yaml").write_text("rollout: {runs_per_node: 3}\n")
    assert model.cell_capacity(tmp_path) is None  # not a resolved config: no figure


def test_json_prints_status_json(run_dir):
    proc = gyre("status", str(run_dir), "--json")
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == json.loads((run_dir / "status.json").read_text())


def test_missing_run_dir_and_not_started_run(tmp_path):
    missing = gyre("status", str(tmp_path / "nope"), "--once")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    once = gyre("status", str(empty), "--once")
    assert once.returncode == 0 and "waiting for status.json" in once.stdout
    as_json = gyre("status", str(empty), "--json")
    assert as_json.returncode == 2 and "does not exist" in as_json.stderr
    report = gyre("report", str(empty), "-o", str(tmp_path / "r.png"))
    assert report.returncode == 2 and "no start/layout events" in report.stderr
    assert not (tmp_path / "r.png").exists()


def test_report_refuses_an_image_path_it_cannot_write_before_reading_the_run(tmp_path):
    """`gyre report -o` names a path that is no image, or a folder that cannot be one:
    exit 2 with what to fix, no traceback, nothing written (the file in the way kept)."""
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "a_file").write_text("mine\n")
    for out, message in ((tmp_path / "a_file" / "r.png", "is a file, not a folder"),
                         (tmp_path / "r.txt", "name the image with one of the suffixes"),
                         (tmp_path / "a_file", "name the image with one of the suffixes")):
        proc = gyre("report", str(run), "-o", str(out))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert (tmp_path / "a_file").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "run"]
    not_a_dir = gyre("report", str(tmp_path / "a_file"), "-o", str(tmp_path / "r.png"))
    assert not_a_dir.returncode == 2 and "is a file, not a run dir" in not_a_dir.stderr


def test_a_redraw_period_out_of_range_is_refused(tmp_path):
    """--refresh-s must be a number of seconds in 0.1-3600: 0 or less, nan, inf or 1e300
    had been taken (clamped to 0.1, or a live view that never redrew)."""
    for value in ("0", "-1", "nan", "inf", "1e300", "abc"):
        proc = gyre("status", str(tmp_path), "--refresh-s", value)
        assert proc.returncode == 2 and "--refresh-s" in proc.stderr, (value, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_torn_last_line_and_bad_status_are_tolerated(run_dir):
    tail = model.EventTail(run_dir / "events.jsonl")
    n = len(tail.poll())
    append_event(run_dir, AGENT_LOST, newline=False)  # a writer caught mid-line
    assert len(tail.poll()) == n
    assert "FAILURES" not in gyre("status", str(run_dir), "--once").stdout
    with open(run_dir / "events.jsonl", "a") as f:
        f.write("\n")  # the line completes: now it is read, once
    assert len(tail.poll()) == n + 1 and tail.poll()[-1]["kind"] == "agent_lost"
    (run_dir / "status.json").write_text('{"cells": [')  # torn (not atomic) status
    proc = gyre("status", str(run_dir), "--once")
    assert proc.returncode == 0 and "waiting for status.json" in proc.stdout
    assert "FAILURES (1):" in proc.stdout  # events are still shown


# Events and status.json whose fields are of another type than the coordinator writes (a
# file edited by hand, another version): each stopped `gyre status` or `gyre report` with
# a traceback where it read the field.
MISSHAPEN_EVENTS = [
    ({"kind": "decision", "t": "1e400"}, "a decision event whose time is not a finite number"),
    ({"kind": "handoff", "direction": ["a"], "cells": [1]}, "'direction' must be"),
    ({"kind": "handoff", "direction": "rollout->train", "cells": [1, "x"]},
     "cells[1] does not fit (a list of cell numbers): 'x'"),
    ({"kind": "step", "step": "x"}, "'step' must be a step number"),
    ({"kind": "step", "step": 1, "metrics": {"train/loss": "low"}}, "'metrics' must be"),
    ({"kind": "microbatch", "tokens": [5]}, "'tokens' must be a number"),
    ({"kind": 5}, "an event without a kind"),
    ({"kind": "step", "step": 2, "mean_reward": {"a": 1}}, "'mean_reward' must be a number"),
    # an integer past a float's range: OverflowError where it was checked for finite
    ({"kind": "microbatch", "seconds": 10 ** 400}, "'seconds' must be seconds"),
]


def test_misshapen_events_are_skipped_and_reported(run_dir, tmp_path):
    lines = [json.dumps({"t": time.time(), **e}) for e, _ in MISSHAPEN_EVENTS]
    lines[0] = lines[0].replace('"1e400"', "1e400")  # JSON's number that overflows to inf
    with open(run_dir / "events.jsonl", "a") as f:
        f.write("\n".join(lines) + "\n")
    append_event(run_dir, AGENT_LOST)  # good events after them are read
    append_event(run_dir, {"kind": "step", "step": 99, "mean_reward": math.nan, "metrics": {
        "train/loss": math.nan, "mismatch/abs_mean": math.nan}})  # a diverged step
    proc = gyre("status", str(run_dir), "--once")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "FAILURES (1):" in proc.stdout and "training (step 99): loss nan" in proc.stdout
    for _, why in MISSHAPEN_EVENTS:
        assert why in proc.stderr, why
    proc = gyre("report", str(run_dir), "-o", str(tmp_path / "r.png"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    tail = model.EventTail(run_dir / "events.jsonl")
    assert [e["kind"] for e in tail.poll()[-2:]] == ["agent_lost", "step"]
    assert model.event_error({"kind": "step", "t": 1.0, "step": 3, "mean_reward": math.nan,
                              "metrics": {"train/loss": math.nan}}) is None  # diverged: shown
    assert [b.reason.split(": b'")[0].endswith(why) or why in b.reason for b, (_, why)
            in zip(tail.bad, MISSHAPEN_EVENTS)] == [True] * len(MISSHAPEN_EVENTS)


@pytest.mark.parametrize("edit, why", [
    (lambda d: d["cells"].__setitem__(0, {"id": "a"}), "status.json cells[0] has no 'cell'"),
    (lambda d: d["cells"][1].__setitem__("nodes", "n1"), "cells[1]: 'nodes' must be"),
    (lambda d: d.__setitem__("version", "7"), "'version' must be a whole number"),
    (lambda d: d.__setitem__("waterlevel_history", [{"t": 1.0}, {"t": "x"}]),
     "waterlevel_history[1] does not fit"),
    (lambda d: d.__setitem__("rewards", [{"step": 0, "mean_reward": "high"}]),
     "rewards[0] does not fit"),
    # the cells' fields were checked even when `cells` was not a list: a TypeError
    (lambda d: d.__setitem__("cells", 1.5), "'cells' must be a list of cells"),
])
def test_a_status_json_of_another_shape_is_refused_like_a_garbled_one(run_dir, tmp_path,
                                                                      edit, why):
    data = json.loads((run_dir / "status.json").read_text())
    edit(data)
    (run_dir / "status.json").write_text(json.dumps(data))
    proc = gyre("status", str(run_dir), "--once")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    said = " ".join((proc.stdout + proc.stderr).split())  # rich wraps the warning's line
    assert "not the shape gyre writes" in said and why in said, said
    assert "waiting for status.json" in proc.stdout  # no good status read before this one
    proc = gyre("status", str(run_dir), "--json")
    assert proc.returncode == 2 and why in proc.stderr
    proc = gyre("report", str(run_dir), "-o", str(tmp_path / "r.png"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_text_no_encoding_takes_is_printed_escaped(run_dir):
    """A lone surrogate (JSON's "\\ud800") in status.json or an event stopped `gyre
    status` with a UnicodeEncodeError traceback as it printed: shown escaped."""
    data = json.loads((run_dir / "status.json").read_text())
    data["policy"] = "elastic\ud800"
    (run_dir / "status.json").write_text(json.dumps(data))
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "note\udfff", "t": 1.0}) + "\n")
    proc = gyre("status", str(run_dir), "--once")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "elastic\\ud800" in proc.stdout


def test_a_final_status_without_its_time_is_drawn(run_dir):
    """`t` is optional in status.json: a final one without it ended the view with a
    KeyError traceback (the timeline's end); the last event's time stands in."""
    data = json.loads((run_dir / "status.json").read_text())
    data.pop("t")
    data["final"] = True
    (run_dir / "status.json").write_text(json.dumps(data))
    proc = gyre("status", str(run_dir), "--once")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "cell" in proc.stdout


def check_segments(segs: list, span_s: float) -> None:
    """Each cell's segments run back to back (gaps only where a job stopped)."""
    for cell in {s[0] for s in segs}:
        mine = [s for s in segs if s[0] == cell]
        assert all(t1 >= t0 - 1e-9 for _, t0, t1, _ in mine)
        assert mine[-1][2] == pytest.approx(span_s)
        for a, b in zip(mine, mine[1:]):
            assert b[1] >= a[2] - 1e-6


def test_role_segments_follow_handoffs_and_a_resume(source_run):
    events = list(model.EventTail(source_run / "events.jsonl").poll())
    segs, span_s = model.role_segments(events)
    check_segments(segs, span_s)
    handoffs = [e for e in events if e["kind"] == "handoff"]
    moving = sum(t1 - t0 for _, t0, t1, lab in segs if "->" in lab)
    assert moving == pytest.approx(sum(e["total_s"] * len(e["cells"]) for e in handoffs))
    # The same job resumed 100 s later: a second layout restarts every cell's roles.
    later = [dict(e, t=e["t"] + 100) for e in events
             if e["kind"] not in ("start", "finish") and e["t"] > 1e8]
    segs2, span2 = model.role_segments(events + later)
    check_segments(segs2, span2)
    assert span2 == pytest.approx(max(e["t"] for e in later) - model.Snapshot(
        run_dir=source_run, status=None, events=events).start_t)
    assert len(segs2) == 2 * len(segs)


def test_a_handoff_shorter_than_a_strip_character_still_shows():
    # Cell 0: rollout, a 0.25 s handoff between the strip's 1 s instants, then training;
    # cell 1: failed for 0.1 s between two instants.
    segs = [(0, 0.0, 3.3, "rollout"), (0, 3.3, 3.45, "draining->train"),
            (0, 3.45, 3.55, "loading->train"), (0, 3.55, 8.0, "train"),
            (1, 0.0, 5.4, "rollout"), (1, 5.4, 5.5, "failed"), (1, 5.5, 8.0, "rollout")]
    assert model.role_strip(segs, 0, span_end_s=8.0, width=8) == "RRR-TTTT"
    assert model.role_strip(segs, 1, span_end_s=8.0, width=8) == "RRRRRXRR"
    # At a finer step the same handoff spans its own characters.
    assert model.role_strip(segs, 0, span_end_s=4.05, width=9, step_s=0.1) == "R---TTTTT"


def test_report_writes_a_png(run_dir, tmp_path):
    out = tmp_path / "report.png"
    proc = gyre("report", str(run_dir), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_status_and_report_show_the_training_signals(run_dir, source_run):
    """The last step's loss, entropy, mismatch by lag and staleness in `gyre status`;
    the report's panels plot every step's figures (the step events' metrics)."""
    import matplotlib.pyplot as plt

    from gyre_slurm.monitor.report import figure

    out = gyre("status", str(run_dir), "--once", env={"COLUMNS": "300"}).stdout
    steps = model.step_metrics(model.load(run_dir).events)
    last = steps[-1]
    assert f"training (step {last['step']}): loss " in out and "entropy" in out
    lags = last["staleness/lag_hist"]
    assert "mismatch |logp trainer - sampler|: mean" in out
    assert "; by lag " + ", ".join(
        f"{lag}: {last[f'mismatch/lag{lag}/abs_mean']:.3g}" for lag in lags) in out
    assert "staleness: tokens by lag " + ", ".join(f"{k}: {v}" for k, v in lags.items()) in out
    fig = figure(run_dir)
    try:
        axes = {ax.get_title(): ax for ax in fig.axes}
        mismatch = next(ax for title, ax in axes.items()
                        if title.startswith("trainer/sampler mismatch on trained tokens"))
        assert list(mismatch.lines[0].get_ydata()) == [m["mismatch/abs_mean"] for m in steps]
        training = axes["entropy of trained tokens; grad norm"]
        assert list(training.lines[0].get_ydata()) == [m["train/entropy"] for m in steps]
        clipped = axes["what the loss clipped, truncated, dropped"]
        assert list(clipped.lines[0].get_ydata()) == [m["train/clip_frac"] for m in steps]
        rewards = axes["mean reward per step"]
        assert list(rewards.lines[0].get_ydata()) == [m["reward/mean"] for m in steps]
    finally:
        plt.close(fig)
    assert (source_run / "metrics.jsonl").is_file() or EXAMPLE is not None


def tmux_available() -> bool:
    for step in (["apt-get", "install", "-y", "tmux"], ["apt-get", "update"],
                 ["apt-get", "install", "-y", "tmux"]):  # a fresh machine has no apt lists
        if shutil.which("tmux") is not None:
            break
        subprocess.run(step, capture_output=True, timeout=300,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if shutil.which("tmux") is None:
        if os.environ.get("CI"):
            pytest.fail("tmux is needed for the live-view test and could not be installed")
        return False
    return True


def capture(sock: str) -> str:
    return subprocess.run(["tmux", "-S", sock, "capture-pane", "-p", "-t", "mon"],
                          capture_output=True, text=True, timeout=10).stdout


def wait_for(sock: str, text: str, *, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    screen = ""
    while time.monotonic() < deadline:
        screen = capture(sock)
        if text in screen:
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not on screen after {timeout_s}s:\n{screen}")


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_live_view_under_tmux(run_dir, tmp_path, key):
    if not tmux_available():
        pytest.skip("tmux not installed and apt-get could not install it")
    sock = str(tmp_path / "tmux.sock")
    done = tmp_path / "exit-code"
    cmd = (f"env -u COLUMNS -u LINES PYTHONPATH={ROOT} {sys.executable} -m gyre_slurm "
           f"status {run_dir} --refresh-s 0.3; echo $? > {done}; sleep 30")
    subprocess.run(["tmux", "-S", sock, "new-session", "-d", "-s", "mon", "-x", "150", "-y",
                    "50", cmd], check=True, timeout=10)
    try:
        screen = wait_for(sock, "cell 0 [", timeout_s=15)
        assert "version" in screen and "elapsed" in screen and "step" in screen
        status = json.loads((run_dir / "status.json").read_text())
        for cell in status["cells"]:
            assert f"cell {cell['cell']} [{','.join(cell['nodes'])}]" in screen
        append_event(run_dir, AGENT_LOST)  # the view follows the run dir as it grows
        wait_for(sock, "FAILURES (1):", timeout_s=5)
        subprocess.run(["tmux", "-S", sock, "send-keys", "-t", "mon", key], check=True,
                       timeout=10)
        deadline = time.monotonic() + 5
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.exists(), capture(sock)
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True, timeout=10)


def test_the_commands_a_run_prints_are_quoted_for_the_shell(tmp_path):
    """A run dir with a space, a `;` or a `$(...)` in its path: the printed `gyre status`
    command, pasted into a shell, names that path and runs nothing else."""
    import shlex

    from gyre_slurm.monitor.summary import start_text

    run_dir = tmp_path / "a b; touch x" / "$(touch y)"
    watch = [line for line in start_text(run_dir).splitlines() if "watch" in line][0]
    assert shlex.split(watch.split("watch", 1)[1]) == ["gyre", "status", str(run_dir)]


def test_trained_microbatches_keep_each_ones_last_standing_training():
    """What a run trained, from its events: a rewound step's micro-batch counts its last
    training; a life that starts at version V (a resume) drops the earlier events of
    steps >= V, which it trains again; steps before V stay."""
    def mb(step, index, tag):
        return {"kind": "microbatch", "step": step, "index": index, "tag": tag}

    events = [{"kind": "start", "version": 0}, mb(0, 0, "a"), mb(0, 1, "b"),
              {"kind": "step", "step": 0}, mb(1, 0, "c"), mb(1, 1, "d"),
              mb(1, 0, "c again"),  # step 1 rewound: both trained again
              mb(1, 1, "d again"), {"kind": "step", "step": 1}, mb(2, 0, "e"),
              {"kind": "resume", "version": 2},  # checkpoint of step 1: step 2 again
              mb(2, 0, "e2"), mb(2, 1, "f2"), {"kind": "step", "step": 2}]
    got = [e["tag"] for e in model.trained_microbatches(events)]
    assert got == ["a", "b", "c again", "d again", "e2", "f2"]
    # started again from 0 (no checkpoint): nothing before counts
    assert [e["tag"] for e in model.trained_microbatches(
        events + [{"kind": "start", "version": 0}, mb(0, 0, "z")])] == ["z"]

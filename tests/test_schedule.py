"""The suite's packing onto xdist workers (tests/schedule.py), run for real: two workers,
longest unit first, a long file split into its tests except those sharing a module
fixture, which stay together and make it once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from schedule import LIGHT_NICE

TESTS = Path(__file__).resolve().parent

LOG = '''
import os, time, pytest

def log(name, value=None):  # one line: name, worker, value (default: the time)
    value = time.monotonic() if value is None else value
    with open(os.environ["LOG"], "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']} {value}\\n")
'''
LONG = LOG + '''
@pytest.fixture(scope="module")
def engine():
    log("engine-made")
    return object()

def test_a(engine):
    log("long::a"); time.sleep(0.3)

def test_b():
    log("long::b"); time.sleep(0.3)

def test_c(engine):
    log("long::c"); time.sleep(0.3)

def test_d():
    log("long::d"); time.sleep(0.3)
'''
SHORT = LOG + '''
def test_e():
    log("short::e")
'''


def run_packed(tmp_path: Path, files: dict[str, str], durations: dict[str, float], *,
               workers: int, heavy: int | None = None) -> tuple[str, list[list[str]]]:
    """pytest on `workers` xdist workers with the packing plugin over `files` (name ->
    source), `durations` recorded: its output and the lines the tests logged."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    solo: solo\n")
    (tmp_path / "durations.json").write_text(json.dumps(durations))
    log = tmp_path / "log"
    env = dict(os.environ, PYTHONPATH=str(TESTS), LOG=str(log), GYRE_TEST_PACK="1",
               GYRE_TEST_DURATIONS=str(tmp_path / "durations.json"))
    env.pop("CI", None)
    env.pop("GYRE_TEST_HEAVY_WORKERS", None)
    if heavy is not None:
        env["GYRE_TEST_HEAVY_WORKERS"] = str(heavy)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "schedule", "-p", "no:cacheprovider",
         f"--rootdir={tmp_path}", "-q", "-n", str(workers), "--dist", "loadfile", *files],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    rows = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return proc.stdout + proc.stderr, rows


def test_units_are_long_files_split_by_shared_fixture_longest_first(tmp_path):
    durations = {"test_long.py::test_a": 100, "test_long.py::test_b": 30,
                 "test_long.py::test_c": 100, "test_long.py::test_d": 40,
                 "test_short.py::test_e": 1}
    out, rows = run_packed(tmp_path, {"test_short.py": SHORT, "test_long.py": LONG},
                           durations, workers=2)
    assert "5 passed" in out, out
    worker = {name: w for name, w, _ in rows}
    start = {name: float(t) for name, _, t in rows}
    # a and c share the module fixture: one unit, one worker, the fixture made once
    assert [r[0] for r in rows].count("engine-made") == 1
    assert worker["long::a"] == worker["long::c"] == worker["engine-made"]
    # the file is split: its fixture-free tests are units of their own; the two longest
    # units (a+c: 200 s, d: 40 s) start first, one on each worker, before the short file
    assert worker["long::d"] != worker["long::a"]
    assert start["short::e"] > min(start["long::a"], start["long::d"])
    assert start["long::b"] > start["long::d"]


MIXED = LOG + '''
@pytest.mark.slow
def test_s1():
    log("mixed::s1"); time.sleep(1.0)

def test_l1():
    log("mixed::l1")

@pytest.mark.slow
def test_s2():
    log("mixed::s2"); time.sleep(1.0)
'''
UNIT = LOG + '''
def test_u():
    log("unit::u", os.nice(0))
'''


def test_a_light_worker_runs_only_the_tests_not_marked_slow(tmp_path):
    """Three workers, GYRE_TEST_HEAVY_WORKERS=2: the slow tests run on gw0/gw1 only, the
    third worker takes the others (a file's unmarked tests apart from its slow ones), and
    the run ends (the light worker stops once no light unit is left). The light worker runs
    niced, on the core the slow tests leave idle."""
    durations = {"test_mixed.py::test_s1": 200, "test_mixed.py::test_s2": 100,
                 "test_mixed.py::test_l1": 1, "test_unit.py::test_u": 1}
    out, rows = run_packed(tmp_path, {"test_unit.py": UNIT, "test_mixed.py": MIXED},
                           durations, workers=3, heavy=2)
    assert "4 passed" in out, out
    worker = {name: w for name, w, _ in rows}
    nice = {name: int(v) for name, _, v in rows if name == "unit::u"}
    assert nice["unit::u"] >= os.nice(0) + LIGHT_NICE or nice["unit::u"] == 19
    assert worker["mixed::s1"] in ("gw0", "gw1") and worker["mixed::s2"] in ("gw0", "gw1")
    assert worker["mixed::s1"] != worker["mixed::s2"]  # split: 300 s > SPLIT_OVER_S
    assert worker["mixed::l1"] == worker["unit::u"] == "gw2"


BUSY = LOG + '''
@pytest.mark.slow
def test_b1():
    log("busy::b1"); time.sleep(3.0)

@pytest.mark.slow
def test_b2():
    log("busy::b2"); time.sleep(3.0)
'''
SOLO = LOG + '''
pytestmark = pytest.mark.solo

@pytest.mark.slow
def test_alone():
    log("solo::alone", os.nice(0))

def test_quick():
    log("solo::quick")
'''


def test_solo_units_go_to_the_light_worker_once_its_light_units_are_done(tmp_path):
    """A slow test marked solo (all its work in its own process) is queued first, being the
    longest, but the heavy workers leave it while other slow units are left: the light
    worker takes it after its light units, niced like them. The file's unmarked test is
    a light unit of its own."""
    durations = {"test_busy.py::test_b1": 200, "test_busy.py::test_b2": 100,
                 "test_unit.py::test_u": 1, "test_solo.py::test_alone": 500,
                 "test_solo.py::test_quick": 1}
    out, rows = run_packed(tmp_path, {"test_unit.py": UNIT, "test_busy.py": BUSY,
                                      "test_solo.py": SOLO}, durations, workers=3, heavy=2)
    assert "5 passed" in out, out
    worker = {name: w for name, w, _ in rows}
    value = {name: v for name, _, v in rows}
    assert {worker["busy::b1"], worker["busy::b2"]} == {"gw0", "gw1"}
    assert worker["solo::alone"] == worker["solo::quick"] == worker["unit::u"] == "gw2"
    assert int(value["solo::alone"]) == int(value["unit::u"])  # niced alike
    order = [name for name, w, _ in rows if w == "gw2"]
    assert order.index("solo::alone") > max(order.index("solo::quick"), order.index("unit::u"))

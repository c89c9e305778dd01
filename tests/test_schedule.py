"""The suite's packing onto xdist workers (tests/schedule.py), run for real: two workers,
longest unit first, a long file split into its tests except those sharing a module
fixture, which stay together and make it once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

LONG = '''
import os, time, pytest

def log(name):
    with open(os.environ["LOG"], "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()}\\n")

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
SHORT = '''
import os, time
def test_e():
    with open(os.environ["LOG"], "a") as f:
        f.write(f"short::e {os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()}\\n")
'''


def test_units_are_long_files_split_by_shared_fixture_longest_first(tmp_path):
    (tmp_path / "test_long.py").write_text(LONG)
    (tmp_path / "test_short.py").write_text(SHORT)
    durations = {"test_long.py::test_a": 100, "test_long.py::test_b": 30,
                 "test_long.py::test_c": 100, "test_long.py::test_d": 40,
                 "test_short.py::test_e": 1}
    (tmp_path / "durations.json").write_text(json.dumps(durations))
    log = tmp_path / "log"
    env = dict(os.environ, PYTHONPATH=str(TESTS), LOG=str(log), GYRE_TEST_PACK="1",
               GYRE_TEST_DURATIONS=str(tmp_path / "durations.json"))
    env.pop("CI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "schedule", "-p", "no:cacheprovider",
         f"--rootdir={tmp_path}", "-q", "-n", "2", "--dist", "loadfile",
         "test_short.py", "test_long.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "5 passed" in proc.stdout, proc.stdout + proc.stderr
    rows = [line.split() for line in log.read_text().splitlines()]
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

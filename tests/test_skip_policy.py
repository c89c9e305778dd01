"""A first run after a fresh install skips no tier: availability is decided at run time
(never by a collection-time skipif/importorskip), and under CI a skip is a failure."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

def test_decided_at_run_time():
    pytest.skip("no such tool here")

@pytest.mark.skipif(True, reason="decided at collection")
def test_decided_at_collection():
    pass

def test_passes():
    pass
'''
SAMPLE_MODULE_SKIP = 'import pytest\npytest.importorskip("gyre_no_such_module")\n'


def collection_time_skips(source: str) -> list[str]:
    """Where `source` decides a skip before the run: skipif/skip marks, importorskip,
    unittest's skip decorators, and a module-level pytest.skip."""
    tree = ast.parse(source)
    inside_defs = {id(n) for f in ast.walk(tree)
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if n is not f}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(
            node.value, "id", "")
        hit = (node.attr in ("skipif", "importorskip", "skipIf", "skipUnless")
               or (node.attr == "skip" and base in ("mark", "unittest"))
               or (node.attr == "skip" and base == "pytest" and id(node) not in inside_defs))
        if hit:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checker_finds_each_kind_of_collection_time_skip():
    assert len(collection_time_skips(SAMPLE)) == 1
    assert collection_time_skips(SAMPLE_MODULE_SKIP) == [
        "line 2: pytest.importorskip"]
    assert collection_time_skips("import pytest\npytest.skip('x', allow_module_level=True)\n")
    assert collection_time_skips("import unittest\n@unittest.skip('x')\ndef test(): pass\n")
    assert collection_time_skips("import pytest\npytestmark = pytest.mark.skip\n")
    assert not collection_time_skips("import pytest\ndef f():\n    pytest.skip('at run time')\n")


def test_no_test_decides_a_skip_at_collection():
    found = {p.name: hits for p in sorted(TESTS.glob("*.py"))
             if (hits := collection_time_skips(p.read_text()))}
    assert not found, ("skips decided at collection, before the run installs anything "
                       f"(decide in a fixture or the test instead): {found}")


def _pytest(tmp_path: Path, *, ci: str | None, files=(), extra=()) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "skip_policy", "-p", "no:cacheprovider",
         f"--rootdir={tmp_path}", "-q", "-rA", *extra, *(files or [str(tmp_path)])],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_under_ci_every_skip_fails_the_run(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_module_skip.py").write_text(SAMPLE_MODULE_SKIP)
    rc, out = _pytest(tmp_path, ci="1", files=["test_sample.py"])
    assert rc == 1 and "1 failed, 1 passed, 1 error" in out, out  # a setup skip: an error
    assert out.count("skipped under CI, where every tier must run") >= 2, out
    assert "no such tool here" in out and "decided at collection" in out, out
    rc, out = _pytest(tmp_path, ci="true", files=["test_module_skip.py"])
    assert rc == 2 and "1 error" in out, out  # a collection error stops the session
    assert "skipped under CI" in out and "gyre_no_such_module" in out, out
    for off in (None, "0", "false"):
        rc, out = _pytest(tmp_path, ci=off)
        assert rc == 0 and "1 passed, 3 skipped" in out, (off, out)


def test_under_ci_a_skip_fails_on_xdist_workers_too(tmp_path):
    """tools/test runs the suite on pytest-xdist workers: the hook runs in each worker."""
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    rc, out = _pytest(tmp_path, ci="1", files=["test_sample.py"], extra=["-n", "2"])
    assert rc == 1 and "1 failed, 1 passed, 1 error" in out, out
    assert "no such tool here" in out and "decided at collection" in out, out


def test_ci_passes_its_arguments_on_and_durations_are_printed():
    """`.ci/run --durations=N` reaches pytest (it dropped its arguments: the lead's
    --durations printed nothing), also with the suite's two workers."""
    root = TESTS.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["GYRE_TEST_WORKERS"] = "2"
    # its own session, killed whole on timeout: were the arguments dropped again, this
    # would be the whole suite
    proc = subprocess.Popen(["bash", str(root / ".ci" / "run"), "tests/test_readme.py",
                             "-q", "-p", "no:cacheprovider", "--durations=2"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(".ci/run tests/test_readme.py ran past 180 s: its arguments "
                             "did not reach pytest?") from None
    out = stdout + stderr
    assert proc.returncode == 0, out[-4000:]
    assert "slowest 2 durations" in out and "2 passed" in out, out[-4000:]
    assert "bringing up nodes" in out, out[-4000:]  # xdist's workers ran it

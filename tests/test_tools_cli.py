"""The scripts under tools/ treat a user's mistake as gyre does: one line naming it,
exit status 2, no traceback (gyre_slurm.cli.run_tool)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, message", [
    (["sim_table.py", "no-such-preset"], "sim_table.py: error: unknown preset 'no-such-preset'"),
    (["sim_table.py", "--preset", "x"], "unrecognized arguments: --preset"),  # not a name
    (["sim_table.py", "--losses", "no-such-preset"], "unknown preset 'no-such-preset'"),
    (["sim_table.py", "--all", "deepswe-122b"], "--assumptions and --all take no PRESET"),
    (["make_tiny_model.py", "--heads", "3", "OUT"],
     "make_tiny_model.py: error: hidden_size 64, num_heads 3"),
    (["make_tiny_model.py", "--layers", "0", "OUT"], "--layers must be >= 1"),
    (["test_durations.py", "/no/such/log"], "test_durations.py: error: no such log"),
    (["bench_modes.py", "--modes", "elastic,bogus"], "bench_modes: error: unknown mode 'bogus'"),
    (["bench_modes.py", "--modes", "elastic", "--out", "FILE"],
     "--out FILE is a file, not a folder"),
    (["bench_modes.py", "--modes", "elastic", "--out", "OUT", "--png", "FILE/x.png"],
     "its folder FILE is a file, not a folder"),
    (["sim_draws.py", "--draws", "0"], "sim_draws.py: error: --draws must be >= 1, got 0"),
    (["sim_draws.py", "--draws", "2", "--jsonl", "OUT"], "--jsonl OUT is a folder"),
])
def test_a_tools_script_reports_bad_input_in_one_line(argv, message, tmp_path):
    """OUT: a folder of the test's (made here for --jsonl); FILE: a file in the way."""
    (tmp_path / "f").write_text("mine\n")
    (tmp_path / "m").mkdir()
    argv = [a.replace("OUT", str(tmp_path / "m")).replace("FILE", str(tmp_path / "f"))
            for a in argv]
    message = message.replace("OUT", str(tmp_path / "m")).replace("FILE", str(tmp_path / "f"))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / argv[0]), *argv[1:]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert (tmp_path / "f").read_text() == "mine\n"

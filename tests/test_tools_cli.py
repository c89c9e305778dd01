"""The scripts under tools/ treat a user's mistake as gyre does: one line naming it,
exit status 2, no traceback (gyre_slurm.cli.run_tool)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, message", [
    (["sim_table.py", "no-such-preset"], "sim_table.py: error: unknown preset 'no-such-preset'"),
    (["make_tiny_model.py", "--heads", "3", "OUT"],
     "make_tiny_model.py: error: hidden_size 64, num_heads 3"),
    (["make_tiny_model.py", "--layers", "0", "OUT"], "--layers must be >= 1"),
    (["test_durations.py", "/no/such/log"], "test_durations.py: error: no such log"),
])
def test_a_tools_script_reports_bad_input_in_one_line(argv, message, tmp_path):
    argv = [a.replace("OUT", str(tmp_path / "m")) for a in argv]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / argv[0]), *argv[1:]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

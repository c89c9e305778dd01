import os
import subprocess
import tempfile
from pathlib import Path


def run(directory):
    proc = subprocess.run(["./count_lines.sh", str(directory)], capture_output=True, text=True,
                          timeout=10)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_executable():
    assert os.access("count_lines.sh", os.X_OK)


def test_data_dir():
    assert run("data") == "5"


def test_ignores_other_files():
    with tempfile.TemporaryDirectory() as d:
        Path(d, "x.txt").write_text("1\n2\n3\n4\n")
        Path(d, "y.log").write_text("1\n2\n")
        Path(d, "z.txt").write_text("1\n")
        assert run(d) == "5"


def test_empty_dir():
    with tempfile.TemporaryDirectory() as d:
        assert run(d) == "0"

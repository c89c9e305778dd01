"""monitor.slurm: a Slurm job's run dir from its `scontrol show job -o` line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_slurm.errors import UserError
from gyre_slurm.monitor.slurm import find_run_dir, parse_job_line

ROOT = Path(__file__).resolve().parent.parent

LINE = ("JobId=4242 JobName=gyre UserId=me(1000) GroupId=me(1000) Priority=1 "
        "Comment=gyre_run_dir=/scratch/me/runs/exp 1 StdErr=/scratch/me/slurm-4242.out "
        "StdIn=/dev/null")


def test_parse_job_line_finds_the_comment_path():
    assert parse_job_line(LINE) == Path("/scratch/me/runs/exp 1")
    assert parse_job_line("JobId=1 Comment=gyre_run_dir=/r/x") == Path("/r/x")
    assert parse_job_line("Comment=gyre_run_dir=/r/y JobId=1") == Path("/r/y")


def test_parse_job_line_without_a_gyre_comment_is_none():
    assert parse_job_line("JobId=1 Comment=(null) StdOut=/x") is None
    assert parse_job_line("JobId=1 JobName=other") is None
    assert parse_job_line("JobId=1 Comment=gyre_run_dir= StdOut=/x") is None


def test_find_run_dir_without_slurm_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: no scontrol
    with pytest.raises(UserError, match="scontrol not found"):
        find_run_dir("4242")


def test_find_run_dir_of_a_job_slurm_does_not_know_is_a_clear_error(slurm_cluster, monkeypatch):
    # the local cluster's fixture installs Slurm first (a fresh machine has no scontrol)
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env()["SLURM_CONF"])
    with pytest.raises(UserError, match="job 99999999: unknown to Slurm"):
        find_run_dir("99999999")


def test_find_run_dir_when_slurm_cannot_be_asked_says_so(slurm_cluster, monkeypatch, tmp_path):
    """A config scontrol cannot read is not an unknown job: the error says what to check."""
    (tmp_path / "slurm.conf").write_text("NotASlurmKey=1\n")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    with pytest.raises(UserError, match=r"job 4242: scontrol could not ask Slurm \(is SLURM_CONF"):
        find_run_dir("4242")


@pytest.mark.parametrize("target, message", [
    ("", "the argument is empty"), ("\u0661\u0662", "run dir \u0661\u0662 does not exist")])
def test_gyre_status_of_an_empty_or_non_ascii_target_exits_2(target, message):
    proc = subprocess.run([sys.executable, "-m", "gyre_slurm", "status", target, "--once"],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_gyre_status_of_an_unknown_job_exits_2():
    proc = subprocess.run([sys.executable, "-m", "gyre_slurm", "status", "99999999", "--once"],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "job 99999999" in proc.stderr

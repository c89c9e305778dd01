"""The local Slurm cluster (tools/localslurm, gyre_slurm.slurm.localcluster) runs real jobs:
multi-node steps with real node names, overlapping steps pinned to a node, a signal to the batch
shell, a requeue that runs the job again, and fake GPUs bound per step."""
import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from gyre_slurm.slurm import pytest_fixtures
from gyre_slurm.slurm.localcluster import LocalCluster

pytestmark = pytest.mark.slow

CMD_TIMEOUT_S = 30


@pytest.fixture(scope="session")
def slurm_cluster(request):
    yield from pytest_fixtures.slurm_cluster(request)


@pytest.fixture
def job_name(slurm_cluster):
    """A unique job name; every job of that name is cancelled after the test."""
    name = f"gyre-test-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", "--full", "-n", name], env=slurm_cluster.env(),
                   capture_output=True, timeout=CMD_TIMEOUT_S, check=False)


def slurm(cluster: LocalCluster, *argv: str, timeout_s: float = CMD_TIMEOUT_S) -> str:
    proc = subprocess.run(list(argv), env=cluster.env(), capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert proc.returncode == 0, f"{' '.join(argv)} failed: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


def wait_for(predicate, *, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def job_by_name(cluster: LocalCluster, name: str) -> dict | None:
    jobs = json.loads(slurm(cluster, "squeue", "--json"))["jobs"]
    return next((job for job in jobs if job["name"] == name), None)


def test_srun_runs_on_every_node_under_its_name(slurm_cluster):
    out = slurm(slurm_cluster, "srun", "-N4", "hostname")
    assert sorted(out.split()) == ["node1", "node2", "node3", "node4"]


USR2_SCRIPT = """#!/bin/bash
trap 'kill $sleeper 2>/dev/null; echo "usr2 $(hostname)" > usr2.marker; exit 0' USR2
srun --overlap -w node2 -N1 -n1 hostname > step.out
echo ready > ready.marker
sleep 60 & sleeper=$!
wait $sleeper
echo "no signal" > usr2.marker
exit 3
"""


def test_batch_job_steps_on_a_node_and_traps_usr2(slurm_cluster, job_name, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(USR2_SCRIPT)
    sbatch = subprocess.Popen(
        ["sbatch", "--wait", "--nodes=4", f"--job-name={job_name}", f"--chdir={tmp_path}",
         f"--output={tmp_path}/slurm-%j.out", str(script)],
        env=slurm_cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: read(tmp_path / "ready.marker"), timeout_s=30, what="the job to start")
        job = job_by_name(slurm_cluster, job_name)
        assert job is not None and job["job_state"] == "RUNNING"
        assert job["node_count"] == 4
        slurm(slurm_cluster, "scancel", "--batch", "--signal=USR2", str(job["job_id"]))
        out, _ = sbatch.communicate(timeout=CMD_TIMEOUT_S)
    finally:
        if sbatch.poll() is None:
            sbatch.kill()
            sbatch.wait()
    assert sbatch.returncode == 0, out
    assert read(tmp_path / "step.out").strip() == "node2"
    assert read(tmp_path / "usr2.marker").strip() == "usr2 node1"


REQUEUE_SCRIPT = """#!/bin/bash
echo "restart=${SLURM_RESTART_COUNT:-0} host=$(hostname)" >> runs.txt
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
  sleep 60 & wait $!
fi
"""


def test_requeued_job_runs_again(slurm_cluster, job_name, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(REQUEUE_SCRIPT)
    job_id = slurm(slurm_cluster, "sbatch", "--parsable", "--requeue", "--nodes=1",
                   f"--job-name={job_name}", f"--chdir={tmp_path}", "--open-mode=append",
                   f"--output={tmp_path}/slurm-%j.out", str(script)).strip().split(";")[0]
    runs = tmp_path / "runs.txt"
    wait_for(lambda: read(runs), timeout_s=30, what="the first run")
    slurm(slurm_cluster, "scontrol", "requeue", job_id)
    # A requeued job may start again only after cred_expire (10 s here).
    wait_for(lambda: len(read(runs).splitlines()) >= 2, timeout_s=45, what="the second run")
    lines = read(runs).splitlines()
    assert lines[0].startswith("restart=0 ") and lines[1].startswith("restart=1 ")


def test_gpu_steps_get_their_own_devices(slurm_cluster):
    out = slurm(slurm_cluster, "srun", "-N1", "--gpus-per-node=2",
                "bash", "-c", "echo $CUDA_VISIBLE_DEVICES")
    ids = out.strip().split(",")
    assert len(ids) == 2 and len(set(ids)) == 2
    # Two concurrent steps in one 4-GPU allocation split the GPUs between them.
    step = "srun --exact -n1 --gpus-per-node=2 bash -c 'echo $CUDA_VISIBLE_DEVICES'"
    out = slurm(slurm_cluster, "salloc", "-N1", "-n2", "--gpus-per-node=4", "bash", "-c",
                f"{step} & {step} & wait")
    halves = sorted(line for line in out.split() if "," in line)
    assert halves == ["0,1", "2,3"], out

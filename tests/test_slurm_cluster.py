"""The local Slurm cluster (tools/localslurm, gyre_slurm.slurm.localcluster) runs real jobs:
multi-node steps with real node names, overlapping steps pinned to a node, a signal to the batch
shell, a requeue that runs the job again, and fake GPUs bound per step."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from gyre_slurm.slurm.localcluster import HOSTS_FILE, HOSTS_TAG, LocalCluster

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent

CMD_TIMEOUT_S = 30


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
        wait_for(lambda: read(tmp_path / "ready.marker"), timeout_s=120, what="the job to start")
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
    wait_for(lambda: read(runs), timeout_s=120, what="the first run")
    slurm(slurm_cluster, "scontrol", "requeue", job_id)
    # A requeued job may start again only after cred_expire (10 s here).
    wait_for(lambda: len(read(runs).splitlines()) >= 2, timeout_s=120, what="the second run")
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


def localslurm(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess:
    env = dict(cluster.env(), GYRE_SLURM_STATE=str(cluster.state_dir))
    return subprocess.run([sys.executable, str(ROOT / "tools" / "localslurm"), *args], env=env,
                          capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False)


def test_tool_up_on_a_running_cluster_only_reports_it(slurm_cluster):
    up = localslurm(slurm_cluster, "up")
    assert up.returncode == 0, up.stderr
    assert "already running" in up.stdout
    assert f"export SLURM_CONF={slurm_cluster.conf_path}" in up.stdout
    status = localslurm(slurm_cluster, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.count(" alive") == 6  # munged, slurmctld, 4 slurmd
    # each node up with its GPUs; idle, or running another worker's job (the cluster is
    # shared: in CI a bad-config sbatch test held nodes at this moment, "mixed")
    assert all(re.search(rf"node{n} (idle|mixed|allocated|completing)\S* gpu:4",
                         status.stdout) for n in range(1, 5)), status.stdout
    hosts = HOSTS_FILE.read_text()
    assert all(f"127.0.10.{n} node{n}  {HOSTS_TAG}" in hosts for n in range(1, 5))


def test_a_second_cluster_on_the_same_ports_is_refused(slurm_cluster, tmp_path):
    second = LocalCluster(tmp_path / "second", num_nodes=1)
    with pytest.raises(RuntimeError, match="in use"):
        second.up(timeout_s=10)
    assert not any(d.alive for d in second.status().daemons)
    assert slurm_cluster.is_up()


@pytest.fixture
def open_dir():
    """A fresh dir under /tmp that all may search (munged's socket needs o+x on every parent;
    pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gyre-slurm-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_state_dir_that_munged_cannot_use_is_refused(slurm_cluster, tmp_path):
    closed = LocalCluster(tmp_path / "closed", num_nodes=1, ctld_port=16818,
                          node_port_base=16950)
    with pytest.raises(RuntimeError, match="searchable by all"):
        closed.up(timeout_s=10)
    assert not any(d.alive for d in closed.status().daemons)


def test_a_half_started_cluster_is_stopped(slurm_cluster, open_dir):
    """`up` that times out stops what it started and removes its /etc/hosts lines."""
    half = LocalCluster(open_dir / "half", num_nodes=1, ctld_port=16818, node_port_base=16950)
    with pytest.raises(TimeoutError):
        half.up(timeout_s=0)
    assert "munged --socket" in read(half.state_dir / "log" / "daemons.out")  # it did start
    assert not any(d.alive for d in half.status().daemons)
    assert processes_naming(half.state_dir) == []
    assert str(half.state_dir) not in HOSTS_FILE.read_text()
    assert slurm_cluster.is_up()


def processes_naming(path: Path) -> list[str]:
    """Command lines of live (not zombie) processes that name `path`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(path) in cmdline and state != "Z" and proc.name != str(os.getpid()):
            found.append(cmdline)
    return found


def test_a_second_cluster_runs_beside_the_shared_one(slurm_cluster, open_dir):
    """Its own state dir, ports, node names and addresses: both clusters run jobs at once,
    and taking the second down leaves the first (and its /etc/hosts lines) alone."""
    second = LocalCluster(open_dir / "bench", num_nodes=2, ctld_port=16837,
                          node_port_base=17200, node_prefix="tnode", addr_prefix="127.0.12.")
    try:
        assert second.up(timeout_s=60)
        out = subprocess.run(["srun", "-N2", "hostname"], env=second.env(), capture_output=True,
                             text=True, timeout=60, check=True).stdout.split()
        assert sorted(out) == ["tnode1", "tnode2"]
        hosts = HOSTS_FILE.read_text()
        assert f"127.0.12.2 tnode2  {HOSTS_TAG} {second.state_dir}" in hosts
        first = subprocess.run(["srun", "-N1", "hostname"], env=slurm_cluster.env(),
                               capture_output=True, text=True, timeout=60, check=True)
        assert first.stdout.strip().startswith("node")
    finally:
        second.down()
    assert "tnode1" not in HOSTS_FILE.read_text()
    assert "node1" in HOSTS_FILE.read_text() and slurm_cluster.is_up()
    assert processes_naming(second.state_dir) == []


def test_up_starts_a_stopped_slurmd_again_and_leaves_the_jobs_running(slurm_cluster, open_dir):
    """Debian's slurmd 22.05.8 can abort (free() in a thread's exit) when batch jobs launch at
    once on a node. `up` on that cluster starts only the stopped slurmd: the controller, the
    other nodes and their jobs go on (a whole restart would cancel every job)."""
    second = LocalCluster(open_dir / "heal", num_nodes=2, ctld_port=16847,
                          node_port_base=17300, node_prefix="hnode", addr_prefix="127.0.13.")
    argv = ["--nodes", "2", "--state-dir", str(second.state_dir), "--ctld-port", "16847",
            "--port-base", "17300", "--node-prefix", "hnode", "--addr-prefix", "127.0.13."]
    try:
        assert second.up(timeout_s=60)
        ctld = second._daemon_pid("slurmctld")
        job_id = subprocess.run(
            ["sbatch", "--parsable", "-w", "hnode1", f"--chdir={open_dir}", "--wrap", "sleep 120"], env=second.env(),
            capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        wait_for(lambda: subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"],
                                        env=second.env(), capture_output=True, text=True,
                                        timeout=30).stdout.strip() == "RUNNING",
                 timeout_s=60, what="the job on hnode1 to run")
        os.kill(second._daemon_pid("slurmd-hnode2"), signal.SIGABRT)
        wait_for(lambda: not second.is_up(), timeout_s=10, what="slurmd-hnode2 to die")
        up = subprocess.run([sys.executable, str(ROOT / "tools" / "localslurm"), "up", *argv],
                            capture_output=True, text=True, timeout=90, check=False)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "already running (slurmd had stopped on hnode2: restarted it there)" in up.stdout
        assert second.is_up() and second._daemon_pid("slurmctld") == ctld
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=second.env(),
                               capture_output=True, text=True, timeout=30).stdout.strip()
        assert state == "RUNNING"
        out = subprocess.run(["srun", "-w", "hnode2", "-N1", "hostname"], env=second.env(),
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert out.strip() == "hnode2"
        assert second.up(timeout_s=10) is False and second.restarted == []
    finally:
        second.down()
    assert processes_naming(second.state_dir) == []


def test_cluster_names_and_addresses_are_checked():
    with pytest.raises(ValueError, match="node_prefix"):
        LocalCluster("/tmp/x", 2, node_prefix="Bad-Name")
    with pytest.raises(ValueError, match="loopback prefix"):
        LocalCluster("/tmp/x", 2, addr_prefix="10.0.0.")

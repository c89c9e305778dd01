"""Faults: bad configs are refused before anything starts, with the key and the fix.

A table of bad configs (over configs/tiny.yaml) each naming the key the error must name;
then the real entry points: `gyre run` and `gyre submit` refuse before making a run dir or
starting a node agent, and so does the sbatch script's first step (run as a shell script
with the job's environment, and as a real job on the local Slurm cluster). What only the
nodes can tell (the GPUs they see) is refused once their agents register.
"""

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
MEGATRON = ["trainer.backend=megatron", "trainer.python=env:megatron"]

# (overrides on configs/tiny.yaml, the key the message starts with or names, a fragment)
BAD = [
    (["cluster.num_nodse=4"], "cluster.num_nodse", "Did you mean 'cluster.num_nodes'"),
    (["faults.heartbeat=1"], "faults.heartbeat", "Did you mean 'faults.heartbeat_s'"),
    (["cluster.num_nodes=four"], "cluster.num_nodes", "expected an integer"),
    (["agent.max_tokens=1.5"], "agent.max_tokens", "expected an integer"),
    (["agent.env_params=[1]"], "agent.env_params", "expected a mapping"),
    (["scheduler.policy=elastc"], "scheduler.policy", "did you mean 'elastic'"),
    (["cluster.num_nodes=0"], "cluster.num_nodes", "must be > 0"),
    (["cluster.num_nodes=6", "cluster.cell_nodes=4"], "cluster.cell_nodes", "divisor"),
    (["model.heads=0"], "model.heads", "must be > 0"),
    (["model.heads=3"], "model.heads", "must divide"),
    (["cluster.gpus_per_node=65"], "cluster.gpus_per_node", "must be <= 64 (GPUs of one node)"),
    (["trainer.ranks_per_node=100000000000000000000000"], "trainer.ranks_per_node",
     "must be <= 256 (processes on one node)"),
    (["rollout.tensor_parallel=128"], "rollout.tensor_parallel", "must be <= 64"),
    (["workload.group_size=100000000"], "workload.num_steps",
     "x prompts_per_step x group_size = 40 x 4 x 100,000,000 = 16,000,000,000 runs"),
    (["cluster.num_nodes=100000000000000000000000"], "cluster.num_nodes",
     "must be <= 100,000 (nodes of one job)"),
    (["rollout.max_model_len=100000000000"], "rollout.max_model_len",
     "must be <= 16,777,216"),
    (["rollout.weight_bucket_mb=1e30"], "rollout.weight_bucket_mb", "must be <= 1,048,576"),
    (["agent.scaffold.memory_mb=99999999999999999999"], "agent.scaffold.memory_mb",
     "must be <= 1,073,741,824 (MiB: 1 PiB)"),
    (["agent.scaffold.nproc=99999999999999999999"], "agent.scaffold.nproc",
     "must be <= 4,194,304"),
    (["model.layers=100000"], "model.layers", "would have 4,108,865,600 parameters"),
    (["model.family=qwen3_moe", "model.experts=1000000", "model.experts_per_token=1"],
     "model.layers", "model.experts = 1000000"),
    (["agent.temperature=-1"], "agent.temperature", "must be >= 0"),
    (["optimizer.lr=0"], "optimizer.lr", "must be > 0"),
    (["agent.run_timeout_s=.nan"], "agent.run_timeout_s", "got nan"),
    (["faults.agent_lost_s=0.5"], "faults.agent_lost_s", "set it to at least 1"),
    (["faults.engine_strikes=0"], "faults.engine_strikes", "must be > 0"),
    (["faults.max_engine_restarts=-1"], "faults.max_engine_restarts", "must be >= 0"),
    (["faults.max_run_attempts=2.5"], "faults.max_run_attempts", "expected an integer"),
    (["faults.engine_handoff_timeout_s=0"], "faults.engine_handoff_timeout_s",
     "must be > 0"),
    (["agent.env=nope"], "agent.env", "learnable, longhorizon, shell"),
    (["agent.env_params={bogus: 1}"], "agent.env_params", "'bogus'"),
    (["cluster.node_addr_prefix=127.0.300."], "cluster.node_addr_prefix", "127.X.Y."),
    (["cluster.launcher=local", "cluster.num_nodes=300", "cluster.cell_nodes=100"],
     "cluster.num_nodes", "cluster.launcher: slurm"),
    (["name=../elsewhere"], "name", "names run dirs"),
    (["scheduler.min_gain=-1"], "scheduler.min_gain", "must be >= 0"),
    (["workload.duration.max_s=0"], "workload.duration.max_s", "must be > 0"),
    (["workload.duration.dist=trace"], "workload.duration.trace_file", "is not set"),
    (["training.scaling_efficiency=2"], "training.scaling_efficiency", "(0, 1]"),
    # layouts the cells cannot hold
    (["scheduler.min_rollout_cells=3", "scheduler.min_train_cells=2"],
     "scheduler.min_rollout_cells + scheduler.min_train_cells", "lower the floors or add nodes"),
    (["training.min_replica_nodes=8"], "training.min_replica_nodes", "cannot train"),
    (["scheduler.min_rollout_cells=4", "scheduler.min_train_cells=0"],
     "scheduler.min_rollout_cells", "lower scheduler.min_rollout_cells or add nodes"),
    (["scheduler.policy=async", "scheduler.async_rollout_cells=4"],
     "scheduler.async_rollout_cells", "between 1 and 3"),
    (["scheduler.policy=async", "scheduler.async_rollout_cells=0"],
     "scheduler.async_rollout_cells", "between 1 and 3"),
    (["sim.async_splits=[1, 9]"], "sim.async_splits", "between 1 and 3"),
    (["trainer.tensor_parallel=2"], "trainer.backend: megatron", "data parallel"),
    (["trainer.backend=megatron"], "trainer.python", "env:megatron"),
    (MEGATRON + ["cluster.gpus_per_node=8", "trainer.tensor_parallel=3"],
     "tensor_parallel x pipeline_parallel", "change one of them"),
    (MEGATRON + ["cluster.gpus_per_node=8", "trainer.ranks_per_node=16"],
     "trainer.ranks_per_node", "one rank per GPU"),
    (MEGATRON + ["cluster.gpus_per_node=8", "trainer.tensor_parallel=8",
                 "trainer.pipeline_parallel=2"], "training.min_replica_nodes", "set it to 2"),
    # a replica of 3 nodes in cells of 2: neither holds whole copies of the other
    (MEGATRON + ["cluster.num_nodes=6", "cluster.cell_nodes=2", "cluster.gpus_per_node=8",
                 "trainer.tensor_parallel=8", "trainer.pipeline_parallel=3",
                 "training.min_replica_nodes=3"], "cluster.cell_nodes", "does not tile"),
    (["cluster.gpus_per_node=8", "rollout.tensor_parallel=3"], "rollout.tensor_parallel",
     "must divide cluster.gpus_per_node"),
    (["rollout.release=sleep"], "rollout.release: sleep", "rollout.engine: vllm"),
    (["rollout.engine=vllm", "rollout.python=env:vllm"], "model.heads",
     "vLLM's CPU attention"),
    (["rollout.engine=vllm", "rollout.python=env:vllm", "model.heads=2",
      "rollout.max_model_len=16"], "agent.max_tokens", "raise max_model_len"),
    (["rollout.python="], "rollout.python", "is empty"),
]


@pytest.mark.parametrize("overrides, key, fragment", BAD, ids=[b[1] for b in BAD])
def test_bad_config_is_refused_naming_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    message = str(err.value)
    assert key in message and fragment in message, message
    assert "Traceback" not in message


def test_tiny_configs_pass_the_checks():
    for name in ("tiny.yaml", "tiny-vllm-megatron.yaml", "workload-example.yaml"):
        load_config(ROOT / "configs" / name)


@pytest.fixture
def bad_config(tmp_path):
    """configs/tiny.yaml with an impossible layout: floors of 5 cells on 4."""
    data = yaml.safe_load(TINY.read_text())
    data["scheduler"]["min_rollout_cells"] = 4
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


KEY = "scheduler.min_rollout_cells + scheduler.min_train_cells = 5"


def test_gyre_run_refuses_before_starting_anything(gyre, bad_config, tmp_path):
    run_dir = tmp_path / "run"
    proc = gyre("run", str(bad_config), "--run-dir", str(run_dir), check=False)
    assert proc.returncode == 2, proc.stderr
    assert KEY in proc.stderr and "lower the floors" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()  # no config.yaml, secret, logs/agent-*, events.jsonl
    # an override that breaks a good config is refused the same way
    proc = gyre("run", str(TINY), "--run-dir", str(run_dir), "--set", "agent.env=nope",
                check=False)
    assert proc.returncode == 2 and "agent.env = 'nope'" in proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("devices, env, seen", [
    ([], {}, 0),  # no driver: a CPU node
    ([], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 0),  # a Slurm gres of no real device
    (["kfd"], {}, None),  # ROCm: not counted, not refused
    (["nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm", "nvidia-caps"], {}, 2),
    (["nvidiactl", "nvidia0", "nvidia1"], {"CUDA_VISIBLE_DEVICES": "1"}, 1),
    (["nvidiactl", "nvidia0", "nvidia1"], {"CUDA_VISIBLE_DEVICES": ""}, 0),
    (["nvidiactl", "nvidia0", "nvidia1"], {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 0),
    (["nvidiactl", "nvidia0", "nvidia1"], {"CUDA_VISIBLE_DEVICES": "0,-1,1"}, 1),
    (["nvidiactl", "nvidia0"], {"CUDA_VISIBLE_DEVICES": "GPU-8f3a-11, MIG-2c1d-0"}, 2),
])
def test_a_node_counts_the_gpus_its_processes_can_use(tmp_path, devices, env, seen):
    from gyre_slurm.runtime.agent import visible_gpus

    for name in devices:
        (tmp_path / name).touch()
    assert visible_gpus(env, dev=tmp_path) == seen


def test_gyre_run_on_nodes_without_the_gpus_it_asks_for_is_refused_before_training(
        gyre, tmp_path):
    """This machine has no GPU: a config that asks for two a node is refused once the
    node agents have said what they see, before a rank trains or a server starts (it
    failed at the first training join with a rank's "Torch not compiled with CUDA
    enabled" and a traceback); the run dir keeps only the logs, so the same command with
    the config fixed makes the run afresh."""
    run_dir = tmp_path / "run"
    proc = gyre("run", str(TINY), "--run-dir", str(run_dir), "--set",
                "cluster.gpus_per_node=2", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("cluster.gpus_per_node = 2, but 4 of the job's 4 nodes see fewer GPUs (node 0 "
            "has 0, node 1 has 0") in proc.stderr, proc.stderr
    assert "gyre submit --gpus-per-node 2" in proc.stderr
    assert [p.name for p in run_dir.iterdir()] == ["logs"]


def test_gyre_run_outside_slurm_refuses_more_nodes_than_the_local_launcher_has(gyre,
                                                                               tmp_path):
    """`cluster.launcher: auto` (the default) is the local launcher outside a Slurm job:
    300 nodes need 300 addresses 127.0.10.N (it started agents that never all registered,
    and the job ended with a bare TimeoutError)."""
    env_job = os.environ.pop("SLURM_JOB_ID", None)
    try:
        proc = gyre("run", str(TINY), "--run-dir", str(tmp_path / "run"), "--set",
                    "cluster.num_nodes=300", check=False)
    finally:
        if env_job is not None:
            os.environ["SLURM_JOB_ID"] = env_job
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "cluster.num_nodes = 300: the local launcher (this is not a Slurm job)" \
        in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no agent was started


def test_node_agents_that_do_not_register_in_time_are_named_with_their_logs(gyre, tmp_path):
    run_dir = tmp_path / "run"
    proc = gyre("run", str(TINY), "--run-dir", str(run_dir), "--set",
                "faults.agent_register_s=0.01", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "4 of 4 node agents did not register within faults.agent_register_s = 0.01 s " \
           "(nodes 0, 1, 2, 3): see " + str(run_dir / "logs" / "agent-node1.log") in proc.stderr
    assert "raise faults.agent_register_s" in proc.stderr
    # a failure of the job's start, not of its config: exit 1, one line, no traceback
    assert "gyre run: failed: 4 of 4 node agents" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_training_world_that_cannot_start_ends_the_job_saying_why(tmp_path):
    """A rank that fails as the first world is built (here gloo told to use a network
    interface the node lacks, as a cluster's `GLOO_SOCKET_IFNAME` copied to another
    machine does): exit 1 with the rank's own error and where the logs are, one line,
    no traceback; before, the coordinator's traceback with the agent's answer as a
    Python dict, the rank's traceback escaped inside it."""
    import sys

    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="nosuchif0")
    proc = subprocess.run([sys.executable, "-m", "gyre_slurm", "run", str(TINY), "--run-dir",
                           str(run_dir), "--set", "workload.num_steps=2"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "gyre run: failed: the job's first layout did not start: http://" in proc.stderr
    assert "/cmd/join: RankError: training rank pid " in proc.stderr
    assert "Unable to find address for: nosuchif0. " in proc.stderr, proc.stderr[-3000:]
    assert f"output are in the node agents' logs, {run_dir / 'logs'}" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("trainer-node*.log"))
    assert "Traceback" in logs and "nosuchif0" in logs  # the rank's, for whoever debugs it


def test_a_layout_failure_names_the_exception_a_servers_traceback_ends_with():
    """An engine's failure carries its log's tail, a traceback in it: the job's line
    quotes the exception it ends with (vLLM prefixes its lines with the process), not
    the traceback's frames or its ^^^ markers."""
    from gyre_slurm.runtime.coordinator import _exception_lines, _failure_text

    trace = ("\n(APIServer pid=7) Traceback (most recent call last):\n"
             "(APIServer pid=7)   File \"x.py\", line 3, in <module>\n"
             "(APIServer pid=7)     main()\n(APIServer pid=7)     ^^^^^^\n"
             "(APIServer pid=7) pydantic_core.ValidationError: 1 validation error for "
             "ModelConfig\n(APIServer pid=7)   Value error, Model architectures ['Foo'] "
             "are not supported for now. " + "x" * 500 + "\n"
             "(APIServer pid=7)     For further information visit https://errors\n"
             "(APIServer pid=7) [rank0]: shutting down\n")
    assert "(APIServer pid=7) Traceback" in trace
    lines = _exception_lines(trace)
    assert lines[0] == "pydantic_core.ValidationError: 1 validation error for ModelConfig"
    assert lines[1].startswith("Value error, Model architectures ['Foo'] are not supported")
    assert len(lines) == 3 and len(lines[1]) == 300
    assert _exception_lines("  File \"x.py\", line 3\n    ^^^^\n") == []
    # the whole line: the agent's first line, the exception, not the log's other lines
    from gyre_slurm.runtime.control import CommandError

    said = ("EngineError: vLLM exited with code 1 before serving; log /r/e.log:\n"
            "(APIServer pid=7) WARNING the random seed is set to 0\n" * 50 + trace)
    text = _failure_text(CommandError("http://h:1/cmd/start_engine: 500 {'error': ...}",
                                      error=said))
    assert text.startswith("http://h:1/cmd/start_engine: EngineError: vLLM exited with code 1 "
                           "before serving; log /r/e.log (pydantic_core.ValidationError: 1 "
                           "validation error for ModelConfig / Value error, Model architectures")
    assert "WARNING" not in text and len(text) < 1000
    assert _failure_text(CommandError("http://h:1/cmd/join: 500 boom")) == \
        "http://h:1/cmd/join: 500 boom"


def test_gyre_submit_refuses_before_sbatch(gyre, bad_config, tmp_path):
    run_dir = tmp_path / "run"
    proc = gyre("submit", str(bad_config), "--run-dir", str(run_dir), check=False)
    assert proc.returncode == 2 and KEY in proc.stderr, proc.stderr
    assert not run_dir.exists()


def _job_env(tmp_path: Path) -> dict:
    """What Slurm gives a batch script; `srun`/`scontrol` on PATH record any call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} >> {tmp_path}/called\n")
        (bin_dir / tool).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", GYRE_ROOT=str(ROOT),
                SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="4242",
                SLURM_JOB_NODELIST="node[1-4]", SLURM_JOB_NUM_NODES="4",
                PYTHONPATH=str(ROOT))


def test_sbatch_script_refuses_in_its_first_step(bad_config, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(["bash", str(ROOT / "sbatch" / "gyre.sbatch"), str(bad_config),
                           str(run_dir)], env=_job_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert KEY in proc.stderr and "nothing was started" in proc.stderr
    assert not run_dir.exists()
    assert not (tmp_path / "called").exists()  # no srun step, no scontrol


def test_sbatch_script_refuses_a_run_dir_it_cannot_make(tmp_path):
    """A RUN_DIR under a file: exit 2 naming it, before any step or scontrol; and the
    script run without Slurm says how to run it."""
    blocker = tmp_path / "a_file"
    blocker.write_text("mine\n")
    job_env = _job_env(tmp_path)
    proc = subprocess.run(["bash", str(ROOT / "sbatch" / "gyre.sbatch"),
                           str(ROOT / "configs" / "tiny.yaml"), str(blocker / "run")],
                          env=job_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot make the run dir" in proc.stderr and "nothing was started" in proc.stderr
    assert blocker.read_text() == "mine\n"
    assert not (tmp_path / "called").exists()  # no srun step, no scontrol
    env = {k: v for k, v in job_env.items() if k != "SLURM_JOB_ID"}
    bare = subprocess.run(["bash", str(ROOT / "sbatch" / "gyre.sbatch"),
                           str(ROOT / "configs" / "tiny.yaml")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert bare.returncode != 0 and "runs as a Slurm batch job" in bare.stderr


def test_sbatch_script_refuses_a_time_limit_its_warning_reaches_at_once(tmp_path):
    """A job whose limit (squeue's %l) is 5 minutes or less would get USR2 as it started,
    checkpoint and requeue, again and again: exit 2 saying so, before the run dir, any
    step or scontrol. A form the check cannot read is left to Slurm."""
    job_env = _job_env(tmp_path)
    squeue = tmp_path / "bin" / "squeue"
    run_dir = tmp_path / "run"
    for limit in ("4:00", "5:00", "0:00:30"):
        squeue.write_text(f"#!/bin/sh\necho {limit}\n")
        squeue.chmod(0o755)
        proc = subprocess.run(["bash", str(ROOT / "sbatch" / "gyre.sbatch"), str(TINY),
                               str(run_dir)], env=job_env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"its time limit {limit} is not over the 5 minutes" in proc.stderr
        assert "nothing was started" in proc.stderr
        assert not run_dir.exists() and not (tmp_path / "called").exists()


@pytest.mark.slow
def test_sbatch_job_with_a_bad_config_fails_without_a_step(slurm_cluster, bad_config, tmp_path):
    from test_slurm_e2e import sbatch, wait_done

    run_dir = tmp_path / "run"
    out = tmp_path / "job.out"
    job = sbatch(slurm_cluster, f"--output={out}", "--nodes=1",  # the refusal needs one
                 str(ROOT / "sbatch" / "gyre.sbatch"), str(bad_config), str(run_dir))
    state, _ = wait_done(slurm_cluster, job, timeout_s=300)  # the cluster may be busy
    assert state == "FAILED"
    text = out.read_text()
    assert KEY in text and "nothing was started" in text, text
    assert not run_dir.exists()  # the coordinator (and its srun step) never started
    assert f"gyre: job {job} (restart" not in text  # refused before the job's first echo


@pytest.mark.slow
def test_sbatch_job_whose_limit_its_warning_reaches_fails_without_a_step(slurm_cluster,
                                                                         tmp_path):
    """The same on the local Slurm cluster, squeue answering: `sbatch --time=4` fails
    at once with the reason in its output, no run dir made, no step started."""
    from test_slurm_e2e import sbatch, wait_done

    run_dir = tmp_path / "run"
    out = tmp_path / "job.out"
    job = sbatch(slurm_cluster, f"--output={out}", "--nodes=1", "--time=4",
                 str(ROOT / "sbatch" / "gyre.sbatch"), str(TINY), str(run_dir))
    state, _ = wait_done(slurm_cluster, job, timeout_s=300)
    assert state == "FAILED"
    text = out.read_text()
    assert "its time limit 4:00 is not over the 5 minutes" in text, text
    assert not run_dir.exists()

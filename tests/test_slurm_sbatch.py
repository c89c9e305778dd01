"""The shipped sbatch file and the batch file `gyre submit` has submitit write (golden)."""

import subprocess
from pathlib import Path

import pytest

from gyre_slurm.errors import UserError
from gyre_slurm.sim.array import slurm_parameters
from gyre_slurm.slurm.submit import GYRE_ROOT, SBATCH_FILE, sbatch_parameters, time_limit_s

GOLDEN_DIRECTIVES = [
    "#SBATCH --job-name=gyre",
    "#SBATCH --nodes=4",
    "#SBATCH --ntasks-per-node=1",
    "#SBATCH --exclusive",
    "#SBATCH --time=72:00:00",
    "#SBATCH --signal=B:USR2@300",
    "#SBATCH --requeue",
    "#SBATCH --open-mode=append",
    "#SBATCH --output=gyre-%j.out",
]


def test_sbatch_file_directives_are_the_documented_defaults():
    text = SBATCH_FILE.read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == GOLDEN_DIRECTIVES
    assert subprocess.run(["bash", "-n", str(SBATCH_FILE)]).returncode == 0
    # requeued jobs resume; the batch shell stays to forward USR2 to the coordinator
    assert "--resume" in text and "trap 'kill -USR2 $child" in text
    assert "exec \"$GYRE_ROOT/tools/gyre\"" not in text


def test_submit_gives_submitit_the_sbatch_files_directives():
    """The directives of the shipped script (whole nodes, one task each, USR2 to the batch
    shell 300 s before the limit, requeue), the run dir's log and comment, and a setup
    that hands the batch shell to the script itself."""
    params = sbatch_parameters(config=Path("/c/tiny.yaml"), run_dir=Path("/lustre/runs/r1"),
                               nodes=4, time_limit="01:00:00", partition="gpu",
                               gpus_per_node=8, extra=["--qos=high", "--hold"])
    assert params == {
        "job_name": "gyre-r1", "nodes": 4, "ntasks_per_node": 1, "exclusive": True,
        "time": "01:00:00", "comment": "gyre_run_dir=/lustre/runs/r1",
        "stderr_to_stdout": True, "use_srun": False, "partition": "gpu", "gpus_per_node": 8,
        "setup": [f"exec bash {SBATCH_FILE} /c/tiny.yaml /lustre/runs/r1"],
        "additional_parameters": {
            "signal": "B:USR2@300", "requeue": True,
            "output": "/lustre/runs/r1/logs/slurm-%j.out", "chdir": str(GYRE_ROOT),
            "export": f"ALL,GYRE_ROOT={GYRE_ROOT}", "qos": "high", "hold": True}}
    default = sbatch_parameters(config=Path("/c"), run_dir=Path("/r"), nodes=2,
                                time_limit=None, partition=None, gpus_per_node=None, extra=[])
    assert default["time"] == "72:00:00" and "partition" not in default


def test_submit_refuses_a_node_count_the_config_does_not_have(gyre, tmp_path):
    proc = gyre("submit", "configs/tiny.yaml", "--nodes", "8", "--run-dir", str(tmp_path / "r"),
                check=False)
    assert proc.returncode == 2 and "cluster.num_nodes is 4" in proc.stderr


@pytest.mark.parametrize("value, seconds", [
    ("72:00:00", 259200), ("30", 1800), ("6", 360), ("10:30", 630), ("3-00", 259200),
    ("1-12:30", 131400), ("1-00:00:01", 86401), ("UNLIMITED", float("inf")),
])
def test_slurm_time_limits_read_as_sbatch_reads_them(value, seconds):
    assert time_limit_s(value) == seconds


@pytest.mark.parametrize("args, message", [
    (["--time", "72h"], "is not a Slurm time limit: give MINUTES"),
    (["--time", "1:2:3:4"], "is not a Slurm time limit"),
    (["--time", "5"], "checkpoint and requeue 300 s before its limit"),
    (["--time", "0:04:59"], "is 299 s"),
    (["--nodes", "0"], "give a number of nodes >= 1"),
    (["--gpus-per-node", "-1"], "give 0 or more GPUs"),
])
def test_submit_refuses_a_flag_slurm_would_refuse_or_misread_before_the_run_dir(
        gyre, tmp_path, args, message):
    """Checked before the run dir is made and anything is submitted: a time limit under
    the USR2 warning would checkpoint and requeue the job as soon as it started; --nodes
    0 was taken as unset."""
    run_dir = tmp_path / "r"
    proc = gyre("submit", "configs/tiny.yaml", *args, "--run-dir", str(run_dir), check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def _params(run_dir="/lustre/runs/r1", extra=(), **kw):
    args = dict(config=Path("/c/tiny.yaml"), run_dir=Path(run_dir), nodes=4, time_limit=None,
                partition=None, gpus_per_node=None, extra=list(extra))
    args.update(kw)
    return sbatch_parameters(**args)


@pytest.mark.parametrize("extra, message", [
    (["--qos=high\necho injected"], r"control character '\\n'"),
    (["--mail-user=a\rb"], "control character"),
    (["--comment=mine"], "gyre status finds the run dir by the job's comment"),
    (["--output=/tmp/x.out"], "RUN_DIR/logs/slurm-%j.out"),
    (["--sig=USR1@60"], "gyre sets --signal itself"),  # sbatch takes a prefix
    (["--export=NONE"], "the job needs GYRE_ROOT"),
    (["--no-requeue"], "requeued and resumes"),
    (["--array=0-3"], "a run dir holds one job"),
    (["--nodes=8"], "use --nodes"),
    (["--time=10"], "use --time"),
    (["--job-name=x"], "use --run-dir"),
    (["qos=high"], "give one long sbatch option"),
    (["--=x"], "give one long sbatch option"),
    (["--q os=high"], "give one long sbatch option"),
    (["--qos=a", "--qos=b"], "given twice"),
])
def test_sbatch_args_that_would_break_the_job_are_refused(extra, message):
    """A newline would end the #SBATCH line and run the rest as a shell command; an option
    gyre sets (the comment the monitor reads, the log, the USR2 warning, requeue, the
    environment) would silently break status, logs or resume."""
    with pytest.raises(UserError, match=message):
        _params(extra=extra)


def test_sbatch_args_gyre_does_not_set_pass_as_given():
    add = _params(extra=["--qos=high", "--hold", "--gpus=8", "--mail-user=a b",
                         "--dependency=afterok:7"])["additional_parameters"]
    assert {k: add[k] for k in ("qos", "hold", "gpus", "mail-user", "dependency")} == {
        "qos": "high", "hold": True, "gpus": "8", "mail-user": "a b",
        "dependency": "afterok:7"}


def test_paths_and_flags_written_into_the_batch_file_are_checked():
    with pytest.raises(UserError, match="the run dir .* control character"):
        _params(run_dir="/lustre/runs/a\necho injected")
    with pytest.raises(UserError, match="--partition .* control character"):
        _params(partition="gpu\n#SBATCH --qos=x")
    # a literal % in the run dir stays one in the log's path (Slurm's file name pattern)
    assert _params(run_dir="/lustre/100%x")["additional_parameters"]["output"] == \
        "/lustre/100%%x/logs/slurm-%j.out"


@pytest.mark.parametrize("arg, message", [
    ('partition="cpu\\necho injected"', "control character"),
    ("partition=[a, b]", "partition takes one value, not a list"),
    ('additional_parameters={qos: "a\\nb"}', "control character"),
    ("partition", "expected KEY=VALUE"),
])
def test_sim_slurm_args_that_would_break_the_batch_file_are_refused(arg, message):
    with pytest.raises(UserError, match=message):
        slurm_parameters([arg])

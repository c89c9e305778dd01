"""The shipped sbatch file and the batch file `gyre submit` has submitit write (golden)."""

import subprocess
from pathlib import Path

from gyre_slurm.slurm.submit import GYRE_ROOT, SBATCH_FILE, sbatch_parameters

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

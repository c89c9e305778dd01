"""The shipped sbatch file and the sbatch command `gyre submit` builds (golden text)."""

import subprocess
from pathlib import Path

from gyre_slurm.slurm.submit import GYRE_ROOT, SBATCH_FILE, sbatch_command

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


def test_submit_builds_the_sbatch_command():
    cmd = sbatch_command(config=Path("/c/tiny.yaml"), run_dir=Path("/lustre/runs/r1"), nodes=4,
                         time_limit="01:00:00", partition="gpu", gpus_per_node=8,
                         extra=["--qos=high"])
    assert cmd == [
        "sbatch", "--parsable", "--nodes=4", "--job-name=gyre-r1",
        "--output=/lustre/runs/r1/logs/slurm-%j.out", "--comment=gyre_run_dir=/lustre/runs/r1",
        f"--chdir={GYRE_ROOT}", f"--export=ALL,GYRE_ROOT={GYRE_ROOT}", "--time=01:00:00",
        "--partition=gpu", "--gpus-per-node=8", "--qos=high", str(SBATCH_FILE), "/c/tiny.yaml",
        "/lustre/runs/r1"]


def test_submit_refuses_a_node_count_the_config_does_not_have(gyre, tmp_path):
    proc = gyre("submit", "configs/tiny.yaml", "--nodes", "8", "--run-dir", str(tmp_path / "r"),
                check=False)
    assert proc.returncode == 2 and "cluster.num_nodes is 4" in proc.stderr

"""Which interpreter and container each role runs in (gyre_slurm.runtime.roles)."""

import re
import sys
from pathlib import Path

import pytest

from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import UserError
from gyre_slurm.runtime import roles


def test_unset_python_is_gyres_own_and_a_path_must_exist():
    assert roles.resolve_python(None, section="trainer") == sys.executable
    assert roles.resolve_python(sys.executable, section="trainer") == sys.executable
    with pytest.raises(UserError, match=r"rollout.python = '/no/such/python': no such"):
        roles.resolve_python("/no/such/python", section="rollout")


def test_an_unknown_role_env_says_which_roles_exist():
    envs = Path(__file__).resolve().parents[1] / "tools" / "envs"
    names = " ".join(sorted(p.stem for p in envs.glob("*.txt")))
    assert {"megatron", "vllm"} <= set(names.split())
    with pytest.raises(UserError, match=r"(?s)tools/role-env nosuch failed.*roles: " + re.escape(names)):
        roles.resolve_python("env:nosuch", section="trainer")


def test_roles_file_round_trip(tmp_path):
    cfg = load_config(None, ["trainer.python=" + sys.executable, "cluster.launcher=slurm",
                             "rollout.container_image=nvcr.io/x/vllm:1"])
    written = roles.resolve_roles(cfg, tmp_path)
    assert roles.read_roles(tmp_path) == written
    assert written["trainer"] == {"python": sys.executable, "container_image": None}
    assert written["rollout"] == {"python": "python", "container_image": "nvcr.io/x/vllm:1"}


def test_a_container_image_without_a_slurm_job_is_refused_before_any_step(tmp_path,
                                                                          monkeypatch):
    """A container runs through a nested srun step: with the local launcher (auto
    outside an allocation) it is refused as the roles are resolved, before any process
    starts; it had failed at the first engine start with a traceback."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    for section in ("rollout", "trainer"):
        for launcher in ("local", "auto"):
            cfg = load_config(None, [f"cluster.launcher={launcher}",
                                     f"{section}.container_image=img.sqsh"])
            with pytest.raises(UserError, match=f"{section}.container_image = 'img.sqsh' "
                                                "runs the role through srun .* needs a Slurm job"):
                roles.resolve_roles(cfg, tmp_path)
    assert not (tmp_path / roles.ROLES_FILE).exists()
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # auto inside an allocation is Slurm
    cfg = load_config(None, ["rollout.container_image=img.sqsh"])
    assert roles.resolve_roles(cfg, tmp_path)["rollout"]["container_image"] == "img.sqsh"


def test_a_container_runs_through_a_nested_srun_step(tmp_path, monkeypatch):
    role = {"python": "python", "container_image": "img.sqsh"}
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(UserError, match="needs a Slurm job"):
        roles.command_prefix(role, run_dir=tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    cmd = roles.command_prefix(role, run_dir=tmp_path)
    assert cmd[:5] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n3"]
    assert "--container-image=img.sqsh" in cmd
    mounts = [a for a in cmd if a.startswith("--container-mounts=")][0]
    assert str(tmp_path.resolve()) in mounts
    assert roles.command_prefix({"python": "p", "container_image": None}, run_dir=tmp_path) == []


@pytest.mark.parametrize("overrides, message", [
    (["trainer.backend=megatron"], "set trainer.python"),
    (["trainer.tensor_parallel=2"], "need trainer.backend: megatron"),
    (["trainer.backend=megatron", "trainer.python=env:megatron", "trainer.tensor_parallel=2",
      "cluster.gpus_per_node=0"], "set it to 2"),
    (["trainer.backend=megatron", "trainer.python=env:megatron", "trainer.tensor_parallel=3",
      "trainer.ranks_per_node=2", "cluster.gpus_per_node=0"], "whole nodes of 2 ranks"),
    (["rollout.tensor_parallel=3"], "must divide cluster.gpus_per_node = 8"),
    (["rollout.engine_args=[--foo]"], "apply to rollout.engine: vllm"),
    (["rollout.release=sleep"], "apply to rollout.engine: vllm"),
    (["trainer.python="], "trainer.python is empty"),
])
def test_engine_settings_are_checked_before_anything_runs(overrides, message):
    with pytest.raises(Exception, match=message):
        load_config(None, overrides)

"""Where each role's processes run: which Python, inside which container.

`rollout.python` and `trainer.python` name an interpreter: unset = gyre's own, a path, or
`env:<role>`, the environment `tools/role-env <role>` builds from
`tools/envs/<role>.txt` (cached by a hash of it, so every job and CI reuse it).
The coordinator resolves both once, before any step (a missing interpreter or a failed
build is refused then, not at the first handoff), and writes `RUN_DIR/roles.json`;
node agents read it.

`container_image` runs the role's processes through a nested job step,
`srun --overlap --nodes=1 --ntasks=1 --nodelist=<this node> --container-image=IMAGE
--container-mounts=...` (pyxis/enroot sites); inside the image the interpreter is
`python` unless `python` names another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import gyre_slurm
from gyre_slurm.common.fsio import loads_json, write_json_atomic
from gyre_slurm.errors import UserError

if TYPE_CHECKING:
    from gyre_slurm.config.schema import GyreConfig

PACKAGE_ROOT = Path(gyre_slurm.__file__).resolve().parent.parent
ROLES_FILE = "roles.json"


def resolve_python(spec: str | None, *, section: str) -> str:
    """The interpreter a `python:` setting names (building a role env if needed)."""
    if spec is None:
        return sys.executable
    if spec.startswith("env:"):
        role = spec[4:].strip()
        tool = PACKAGE_ROOT / "tools" / "role-env"
        if not tool.is_file():
            raise UserError(f"{section}.python = {spec!r} needs gyre's checkout (tools/role-env); "
                            f"set GYRE_ROOT-free paths instead: {section}.python: /path/to/python")
        res = subprocess.run([str(tool), role], capture_output=True, text=True)
        if res.returncode != 0:
            raise UserError(f"{section}.python = {spec!r}: tools/role-env {role} failed "
                            f"(exit {res.returncode}):\n{res.stderr[-3000:]}")
        return res.stdout.strip().splitlines()[-1]
    path = shutil.which(spec) if os.sep not in spec else spec
    if path is None or not os.access(path, os.X_OK):
        raise UserError(f"{section}.python = {spec!r}: no such executable interpreter")
    return path


def resolve_roles(cfg: GyreConfig, run_dir: Path) -> dict:
    """Resolve both roles' interpreters; write and return RUN_DIR/roles.json."""
    from gyre_slurm.runtime.launcher import launcher_kind

    roles = {}
    launcher = launcher_kind(cfg.cluster.launcher)
    for section, conf in (("rollout", cfg.rollout), ("trainer", cfg.trainer)):
        if conf.container_image and launcher != "slurm":
            raise UserError(f"{section}.container_image = {conf.container_image!r} runs the "
                            f"role through srun --container-image (pyxis): it needs a Slurm "
                            f"job (sbatch/gyre.sbatch or gyre submit); unset it to run with "
                            f"the local launcher")
        if conf.container_image:
            roles[section] = {"python": conf.python or "python",
                              "container_image": conf.container_image}
        else:
            roles[section] = {"python": resolve_python(conf.python, section=section),
                              "container_image": None}
    write_json_atomic(Path(run_dir) / ROLES_FILE, roles)
    return roles


def read_roles(run_dir: Path) -> dict:
    path = Path(run_dir) / ROLES_FILE
    if not path.is_file():
        return {r: {"python": sys.executable, "container_image": None}
                for r in ("rollout", "trainer")}
    return loads_json(path.read_text())


def command_prefix(role: dict, *, run_dir: Path) -> list[str]:
    """What goes before `PYTHON -m ...`: a nested srun step for a container, else nothing."""
    image = role.get("container_image")
    if not image:
        return []
    node = os.environ.get("SLURMD_NODENAME")
    if not node or "SLURM_JOB_ID" not in os.environ:
        raise UserError(f"container_image {image!r} runs through srun --container-image: it "
                        "needs a Slurm job (launcher slurm), and pyxis on the cluster")
    mounts = ",".join(f"{p}:{p}" for p in sorted({str(Path(run_dir).resolve()),
                                                   str(PACKAGE_ROOT)}))
    return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            f"--container-image={image}", f"--container-mounts={mounts}",
            f"--container-workdir={PACKAGE_ROOT}", "--export=ALL"]

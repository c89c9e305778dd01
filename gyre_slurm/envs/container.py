"""Container images for sandboxed commands: a shell task that comes with an image
(`image:` in its task.yaml) runs each command, and its tests, inside that image, with
the sandbox's isolation and limits unchanged.

The runtime is Charliecloud's `ch-run` (an unprivileged container runtime made for HPC
centers; the Debian package `charliecloud-runtime`, which `ensure_charliecloud()`
installs with apt-get when missing and we are root, as the sandbox does for
bubblewrap). An image is a directory (an unpacked root filesystem, as `ch-convert`
writes from a SquashFS file, a Docker archive or a registry image on a machine that has
one); it must have `/home` (the workdir appears at /home/agent) and `bash`.

Inside the bubblewrap sandbox (`gyre_slurm.envs.sandbox`, still the outer wall:
private network, PID, IPC and UTS namespaces, seccomp, the workdir the only writable
place, uid nobody when we are root, limits by prlimit) the command line becomes

    prlimit ... -- ch-run --no-passwd --home -c /home/agent /gyre/image -- bash -c CMD

with the image shown read-only at /gyre/image (on a tmpfs of its own: ch-run cannot
pivot from bwrap's root), an empty /sys for ch-run to bind, and USER=agent (ch-run's
`--home` mounts the sandbox's HOME, the workdir, at /home/$USER). ch-run enters the
image in a user namespace of its own, so in image mode the sandbox does not forbid
user namespaces, and when we are root the command's drop to nobody makes none (ch-run's
is the one RLIMIT_NPROC counts in). What the command sees: the image's files, its
workdir, ch-run's /dev, /proc and /sys binds of the sandbox's own (minimal /dev, the
sandbox's /proc, an empty /sys); nothing of the host's filesystem.

Not covered: SquashFS or SIF images directly (ch-run needs FUSE inside the sandbox for
those; unpack them first); Apptainer/Singularity and enroot are not installable from
the package registries this project reaches (Debian 12 packages neither, PyPI has no
build), so they are not offered: see docs/agents.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from gyre_slurm.common.debian import which_or_install
from gyre_slurm.errors import UserError

IMAGE_MOUNT = "/gyre/image"  # where the sandbox shows the image (under its own tmpfs)
IMAGE_PARENT = "/gyre"
CONTAINER_USER = "agent"  # ch-run --home: the workdir at /home/agent


class ContainerError(RuntimeError):
    """The container runtime cannot be used here."""


def check_image(image: Path) -> Path:
    """The image folder, resolved; `UserError` naming what is missing."""
    image = Path(image).resolve()
    if not image.is_dir():
        raise UserError(f"container image {image} is not a directory (an unpacked root "
                        "filesystem: `ch-convert IMAGE.sqfs DIR` unpacks a SquashFS one)")
    for need in ("home", "bin/bash"):
        if not os.path.lexists(image / need):
            raise UserError(f"container image {image} has no /{need}: the sandbox runs "
                            "`bash -c` in the image with its workdir at /home/agent")
    return image


def bwrap_mounts(image: Path) -> list[str]:
    """bwrap arguments that show `image` to ch-run inside the sandbox."""
    return ["--dir", "/sys", "--tmpfs", IMAGE_PARENT, "--ro-bind", str(image), IMAGE_MOUNT]


def run_argv(command: str, *, home: str) -> list[str]:
    """The command in the image (after the sandbox's drop and prlimit), with HOME =
    `home` inside (ch-run's --home mounts the sandbox's HOME, the workdir, which must
    stay so outside)."""
    return ["ch-run", "--no-passwd", "--home", f"--set-env=HOME={home}",
            "-c", f"/home/{CONTAINER_USER}", IMAGE_MOUNT, "--", "bash", "-c", command]


def ensure_charliecloud(*, install: bool = True) -> str:
    """The path of `ch-run`; installs `charliecloud-runtime` with apt-get when missing
    (as root). `ContainerError` with the fix otherwise."""
    path = which_or_install("ch-run", "charliecloud-runtime", install=install)
    if path is None:
        raise ContainerError("Charliecloud's ch-run is not installed and could not be "
                             "installed: install the `charliecloud-runtime` package (or "
                             "Charliecloud from its release) to run tasks with an image")
    return path

"""A system command that a tier needs and the machine may lack (bubblewrap, Charliecloud):
installed from its Debian package on first use, as root, where apt-get exists."""

from __future__ import annotations

import os
import shutil
import subprocess


def which_or_install(command: str, package: str, *, install: bool = True) -> str | None:
    """The path of `command`; when it is missing and `install` (and we are root with
    apt-get), installs `package` first, updating the apt lists once if a fresh machine
    has none. None if it is still missing: the caller says how to fix that."""
    if shutil.which(command) is None and install and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        get = ["apt-get", "install", "-y", "--no-install-recommends", package]
        for argv in (get, ["apt-get", "update"], get):  # a fresh machine has no apt lists
            if shutil.which(command):
                break
            subprocess.run(argv, capture_output=True, timeout=600, env=env, check=False)
    return shutil.which(command)

"""Shell tasks that come with a container image: every command and the tests run in the
image (Charliecloud's ch-run inside the bubblewrap sandbox), with the sandbox's walls
and limits. The image is made here from the host's own bash and coreutils (their
libraries found with ldd) plus a marker file, so nothing is downloaded; it has no
Python, which the host has, so what a command sees tells image from host."""

import asyncio
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from gyre_slurm.envs import make_env
from gyre_slurm.envs.container import check_image
from gyre_slurm.envs.sandbox import Limits, Sandbox
from gyre_slurm.errors import UserError

TOOLS = ("bash", "cat", "ls", "head", "rm")
MARKER = "gyre-test-image 1"


def make_image(root: Path) -> Path:
    image = root / "image"
    for d in ("bin", "etc", "home", "tmp", "dev", "proc", "sys"):
        (image / d).mkdir(parents=True)
    libs = set()
    for tool in TOOLS:
        path = shutil.which(tool)
        shutil.copy(path, image / "bin" / tool)
        out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
        libs |= {w for w in out.split() if w.startswith("/")}
    for lib in libs:
        dest = image / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(lib, dest)
    (image / "etc" / "image-release").write_text(MARKER + "\n")
    for f in ("passwd", "group", "hosts", "resolv.conf"):
        (image / "etc" / f).touch()
    for p in image.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() or os.access(p, os.X_OK) else 0o644)
    return image


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-tasks")
    task = root / "answer-in-image"
    (task / "tests").mkdir(parents=True)
    make_image(task)
    (task / "task.yaml").write_text(yaml.safe_dump({
        "instruction": "Write 42 into the file answer.", "image": "image",
        "test_command": "bash .gyre_tests/check.sh", "tests": ["in_image", "solved"]}))
    (task / "tests" / "check.sh").write_text(
        f'[ "$(cat /etc/image-release)" = "{MARKER}" ] && echo "PASS in_image" >&$GYRE_RESULTS_FD\n'
        '[ "$(cat answer)" = 42 ] && echo "PASS solved" >&$GYRE_RESULTS_FD\n'
        'echo "PASS solved"  # printed, not written to the results pipe: scores nothing\n')
    return root


def episode(tasks_dir, tmp_path, replies, **params):
    async def main():
        env = make_env("shell", tasks_dir=str(tasks_dir), base_dir=str(tmp_path / "sb"),
                       **params)
        await env.reset(task_id="shell/answer-in-image/0", seed=0)
        out = []
        try:
            for reply in replies:
                out.append(await env.step(f"```bash\n{reply}\n```"))
                if out[-1].done:
                    break
        finally:
            await env.close()
        return out
    return asyncio.run(main())


def test_commands_and_tests_run_in_the_image(tasks_dir, tmp_path):
    steps = episode(tasks_dir, tmp_path, [
        "cat /etc/image-release; ls /usr/bin/python3 || echo no python here; pwd; id -u",
        "echo 42 > answer; cat answer", "submit"])
    seen = steps[0].observation
    assert MARKER in seen and "no python here" in seen and "/home/agent" in seen
    assert "42" in steps[1].observation
    final = steps[-1]
    assert final.done and final.info["tests"] == {"in_image": True, "solved": True}
    assert final.reward == 1.0


def test_an_unsolved_task_in_the_image_scores_what_the_tests_say(tasks_dir, tmp_path):
    final = episode(tasks_dir, tmp_path, ["echo 41 > answer", "submit"])[-1]
    assert final.info["tests"] == {"in_image": True, "solved": False}  # its print: nothing


def test_the_image_keeps_the_sandbox_walls_and_limits(tasks_dir, tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        steps = episode(tasks_dir, tmp_path, [
            f"(exec 3<>/dev/tcp/127.0.0.1/{port}) && echo CONNECTED || echo refused",
            f"ls {tasks_dir} {Path.home()} 2>&1 | head -3; echo x > /etc/x || echo READ-ONLY",
            "head -c 3000000 /dev/zero > big",
        ], fsize_mb=1, max_steps=5)
    finally:
        listener.close()
    assert "refused" in steps[0].observation and "CONNECTED" not in steps[0].observation
    assert steps[1].observation.count("No such file") == 2, steps[1].observation
    assert "READ-ONLY" in steps[1].observation
    assert steps[2].done and steps[2].info["limit"] == "fsize"
    slow = episode(tasks_dir, tmp_path, ["while :; do :; done"], time_s=2, max_steps=3)
    assert slow[0].done and slow[0].info["limit"] in ("time", "cpu")


def test_a_bad_image_is_refused_with_what_is_missing(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        check_image(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no /home"):
        check_image(tmp_path / "empty")
    with pytest.raises(UserError, match="isolation must be bwrap"):
        Sandbox(tmp_path, limits=Limits(), isolation="none", image=tmp_path / "empty")

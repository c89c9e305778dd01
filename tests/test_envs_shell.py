"""The `shell` environment: real bash commands in a real bubblewrap sandbox, scored by
the tasks' own tests. No model: the actions are crafted replies."""

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import faults
from gyre_slurm.envs import Environment, make_env, tasks_for_step
from gyre_slurm.envs.sandbox import Limits, Sandbox, limit_hit, seccomp_program
from gyre_slurm.envs.shell import FORMAT_HELP, TASKS_DIR, extract_command, score, task_names
from gyre_slurm.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
TASK = "shell/fix-off-by-one/0"  # unfixed: 2 of its 5 tests pass


def reply(command: str) -> str:
    return f"I will run this.\n```bash\n{command}\n```\nThen check."


def run(coro):
    return asyncio.run(coro)


async def episode(commands, *, task=TASK, **params):
    """Reset, run `commands` (stopping when done), close; (results, workdir)."""
    env = make_env("shell", **params)
    await env.reset(task_id=task, seed=0)
    workdir, results = env.workdir, []
    try:
        for c in commands:
            results.append(await env.step(c))
            if results[-1].done:
                break
    finally:
        await env.close()
    return results, workdir


@pytest.mark.parametrize("name", task_names())
def test_reference_solution_scores_one_and_untouched_task_less(name):
    solution = (TASKS_DIR / name / "solution.sh").read_text()
    (*_, solved), wd1 = run(episode([reply(solution), reply("submit")], task=f"shell/{name}/3"))
    (*_, untouched), wd2 = run(episode([reply("ls -la"), reply("submit")], task=f"shell/{name}/3"))
    assert solved.done and solved.reward == 1.0, solved.info["test_output"]
    assert all(solved.info["tests"].values()) and solved.info["end_reason"] == "submit"
    assert untouched.done and untouched.reward < 1.0
    assert not wd1.exists() and not wd2.exists()


def test_wrong_fix_scores_partially_and_tests_cannot_be_planted():
    # a wrong fix, plus fake tests and a fake runner planted where the real ones go
    plant = ("sed -i 's/range(1, n)/range(0, n)/' rangesum.py && mkdir -p .gyre_tests && "
             "printf 'print(\"PASS test_small\")\\n' > .gyre_tests/gyre_runner.py")
    (first, last), _ = run(episode([reply(plant), reply("submit")]))
    assert first.observation.startswith("<returncode>0</returncode>") and not first.done
    assert last.reward == pytest.approx(2 / 5) and last.info["num_passed"] == 2
    assert last.info["tests"] == {"test_small": False, "test_one": False, "test_zero": True,
                                  "test_negative": True, "test_hundred": False}


def test_format_errors_run_nothing_and_max_steps_ends_and_scores():
    two = reply("echo a") + reply("echo b")
    steps, _ = run(episode(["no block here", two, reply("echo hi > x")], max_steps=3))
    assert [s.observation for s in steps[:2]] == [FORMAT_HELP, FORMAT_HELP]
    assert steps[0].info["exit_code"] is None and not steps[1].done
    assert steps[2].done and steps[2].info["end_reason"] == "max_steps"
    assert steps[2].reward == pytest.approx(2 / 5) and steps[2].info["exit_code"] == 0


def test_env_protocol_task_ids_and_errors():
    env = make_env("shell")
    assert isinstance(env, Environment) and env.name == "shell"
    tasks = tasks_for_step("shell", step=0, num_prompts=8, seed=0, pool_size=4)
    assert {t.task_id.split("/")[1] for t in tasks} <= set(task_names())
    assert all(t.task_id == f"shell/{t.task_id.split('/')[1]}/{t.seed}" for t in tasks)
    assert tasks == tasks_for_step("shell", step=0, num_prompts=8, seed=0, pool_size=4)
    with pytest.raises(UserError, match="unknown task"):
        run(env.reset(task_id="shell/nope/0", seed=0))
    with pytest.raises(UserError, match="isolation"):
        make_env("shell", isolation="docker")
    with pytest.raises(RuntimeError):
        run(env.step(reply("true")))
    assert extract_command("```sh\nls\n```") == "ls" and extract_command("``` bash\nls```") is None
    assert score("PASS a\nPASS b\nFAIL b: x\nPASS zz\n", ("a", "b", "c")) == {
        "a": True, "b": False, "c": False}


def test_a_malformed_task_file_is_a_clear_error(tmp_path):
    """A task folder is user content: a YAML bomb, bytes that are not UTF-8 or broken JSON
    are a UserError naming the file, never a hang or a traceback."""
    from gyre_slurm.envs.shell import load_task

    bomb = tmp_path / "bomb"
    bomb.mkdir()
    (bomb / "task.yaml").write_text(
        "instruction: x\ntest_command: y\n" + "".join(
            f"{x}: &{x} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['1'] * 9)}]\n"
            for p, x in zip([None, *"abcdefgh"], "abcdefghi")) + "tests: *i\n")
    with pytest.raises(UserError, match="bomb/task.yaml holds more than"):
        load_task(bomb)
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "task.yaml").write_bytes(b"instruction: \xff\n")
    with pytest.raises(UserError, match="binary/task.yaml is not UTF-8"):
        load_task(binary)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "task.json").write_text('{"instruction": "x",')
    with pytest.raises(UserError, match="broken/task.json is not valid JSON"):
        load_task(broken)
    empty = tmp_path / "empty"
    (empty / "tests").mkdir(parents=True)
    (empty / "task.yaml").write_text("instruction: null\ntest_command: y\ntests: [a]\n")
    with pytest.raises(UserError, match="`instruction` must be non-empty text, got None"):
        load_task(empty)
    (empty / "task.yaml").write_text("instruction: x\ntest_command: {a: 1}\ntests: [a]\n")
    with pytest.raises(UserError, match="`test_command` must be non-empty text"):
        load_task(empty)
    # YAML's and JSON's escapes: a lone surrogate (no UTF-8, so no prompt or file) or a
    # NUL (ends the command's C string), refused with the key, not failed in each run
    (empty / "task.yaml").write_text('instruction: "fix \\ud800"\ntest_command: y\ntests: [a]\n')
    with pytest.raises(UserError, match="`instruction`: 'fix .ud800' holds a lone surrogate"):
        load_task(empty)
    (empty / "task.yaml").unlink()
    (empty / "task.json").write_text('{"instruction": "x", "test_command": "y\\u0000",'
                                     ' "tests": ["a"]}')
    with pytest.raises(UserError, match="`test_command`: 'y.x00' holds a NUL character"):
        load_task(empty)


@pytest.mark.parametrize("command, params, limit", [
    ("sleep 600", {"time_s": 1.0}, "time"),
    ("python3 -c 'x = bytearray(2 * 10**9)'", {"memory_mb": 256}, "memory"),
    ("yes flood", {"output_bytes": 4096}, "output"),
    ("head -c 4M /dev/zero > big", {"fsize_mb": 1}, "fsize"),
    ("python3 -c 'while True: pass'", {"cpu_s": 1, "time_s": 30.0}, "cpu"),
])
def test_a_command_over_a_limit_ends_the_episode_with_its_reason(command, params, limit):
    t0 = time.monotonic()
    (res,), workdir = run(episode([reply(command)], **params))
    assert res.done and res.info["end_reason"] == "limit" and res.info["limit"] == limit
    assert f"exceeded the {limit} limit" in res.observation
    assert res.reward == pytest.approx(2 / 5)  # scored as it stands
    assert time.monotonic() - t0 < 20 and not workdir.exists()
    if limit == "output":
        assert res.observation.count("flood") <= 4096 // 6 + 1


@pytest.mark.parametrize("command, params", [
    # many files each under fsize_mb: RLIMIT_FSIZE bounds one file, not how many
    ("for i in $(seq 200); do head -c 1M /dev/zero > f$i; done; sleep 60",
     {"disk_mb": 8, "fsize_mb": 2}),
    # a flood of empty files: no blocks, but an inode each (counted 4 KiB)
    ("mkdir d && cd d && seq 1000000 | xargs touch; sleep 60", {"disk_mb": 2}),
    # over the budget and done before the first poll: the check after it ends
    ("head -c 3M /dev/zero > a; head -c 3M /dev/zero > b", {"disk_mb": 4, "fsize_mb": 4}),
])
def test_a_command_that_fills_the_workdir_is_killed_and_scores_nothing(command, params):
    """The workdir (under RUN_DIR/sandboxes, the shared filesystem) holds at most
    `disk_mb`: past it the command is killed, the episode ends with the limit "disk",
    and the tests find the workdir still over it, so they are stopped too (reward 0)."""
    t0 = time.monotonic()
    (res,), workdir = run(episode([reply(command)], time_s=60.0, **params))
    assert res.done and res.info["limit"] == "disk", res.info
    assert "exceeded the disk limit" in res.observation and res.info["exit_code"] is None
    assert res.reward == 0.0 and res.info["test_limit"] == "disk", res.info
    assert time.monotonic() - t0 < 30 and not workdir.exists()


def test_the_disk_budget_is_on_top_of_the_task_s_own_files(tmp_path):
    """A task whose files alone pass `disk_mb` (a large repository) still runs: the
    budget is what its commands may add."""
    task = tmp_path / "tasks" / "big-repo"
    (task / "tests").mkdir(parents=True)
    (task / "files").mkdir()
    (task / "files" / "blob.bin").write_bytes(os.urandom(3 << 20))
    (task / "task.yaml").write_text("instruction: look\ntest_command: 'true'\ntests: [t]\n")

    async def main():
        env = make_env("shell", tasks_dir=str(tmp_path / "tasks"), disk_mb=2, fsize_mb=2)
        await env.reset(task_id="shell/big-repo/0", seed=0)
        try:
            small = await env.step(reply("head -c 1M /dev/zero > more && ls -s"))
            big = await env.step(reply("head -c 1M /dev/zero > more2; head -c 1M "
                                       "/dev/zero > more3"))
        finally:
            await env.close()
        return small, big
    small, big = run(main())
    assert not small.done and small.info["limit"] is None, small.info
    assert big.done and big.info["limit"] == "disk", big.info


def test_disk_usage_counts_blocks_inodes_once_and_stops_at_its_cap(tmp_path):
    from gyre_slurm.envs.sandbox import BLOCK, disk_usage

    (tmp_path / "a").write_bytes(b"x" * 100_000)
    os.link(tmp_path / "a", tmp_path / "hard")  # one inode: counted once
    (tmp_path / "sparse").touch()
    os.truncate(tmp_path / "sparse", 1 << 30)  # 1 GiB long, no blocks
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "e").touch()
    os.symlink("/usr", tmp_path / "link")  # not followed
    got = disk_usage(tmp_path, cap=1 << 40)
    assert 100_000 <= got <= 100_000 + 8 * BLOCK + 65536, got
    assert disk_usage(tmp_path, cap=BLOCK) > BLOCK  # stopped once past the cap
    # files as roots (a log), counted once with a tree holding them; a missing root is 0
    assert disk_usage(tmp_path / "a", tmp_path / "missing", cap=1 << 40) >= 100_000
    assert disk_usage(tmp_path, tmp_path / "a", cap=1 << 40) == got


# Run from a checkout (argv[1]: a world-writable host dir in it, argv[2]: a file name): a
# solved episode, writes outside the workdir, and a search of the whole sandbox for
# anything of the tasks (this checkout's, another checkout's, an installed copy's).
SANDBOX_CHECK = r"""
import asyncio, json, sys
from pathlib import Path
from gyre_slurm.envs import make_env
from gyre_slurm.envs.shell import TASKS_DIR, task_names

host_dir, tag = sys.argv[1], sys.argv[2]
names = " -o ".join(f"-name {n}" for n in ["solution.sh", "task.yaml", "gyre_runner.py",
                                             *task_names()])
find = (f"find / \\( -path /proc -o -path /dev -o -path /sys \\) -prune -o \\( {names} \\) "
        f"-print 2>/dev/null; ls -A {TASKS_DIR} 2>/dev/null | wc -l")
writes = [f"echo x > /etc/{tag}", f"touch /tmp/../root/{tag}", f"echo x > {host_dir}/{tag}",
          f"echo x > {host_dir}/../{tag}", f"ln -s /etc {tag}-link && echo x > {tag}-link/{tag}"]

async def main():
    # `find /` walks the whole host as the sandbox sees it: under a whole suite's load on a
    # cold cache it once took over the default 30 s a command (the limit ended the episode)
    env = make_env("shell", max_steps=20, time_s=300)
    await env.reset(task_id="shell/fix-off-by-one/0", seed=0)
    step = lambda c: env.step(f"```bash\n{c}\n```")
    out = {"tasks_dir": str(TASKS_DIR), "writes": []}
    for c in writes:
        res = await step(c)
        out["writes"].append([c, res.info["exit_code"], res.observation])
    await step(f"echo x > $HOME/../{tag}")  # a private tmpfs: nothing reaches the host
    found = await step(find)
    assert not found.done, found.observation  # a limit would end the episode here
    out["find"] = found.observation
    await step((TASKS_DIR / "fix-off-by-one" / "solution.sh").read_text())
    out["reward"] = (await step("submit")).reward
    await env.close()
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.fixture(params=["this checkout", "a copy under /tmp", "a copy under a 0700 dir"])
def checkout(request, tmp_path):
    """Where the package runs from: its root (on PYTHONPATH) and a world-writable host
    dir in it. The sandbox must not depend on that place being visible to its user."""
    if request.param == "this checkout":
        root, made = ROOT, None
    elif request.param == "a copy under /tmp":
        made = root = Path(tempfile.mkdtemp(prefix="gyre-checkout-"))
        root.chmod(0o755)
    else:
        made = Path(tempfile.mkdtemp(prefix=".gyre-private-", dir=ROOT))  # mode 0700
        root = made / "checkout"
    if made is not None:
        shutil.copytree(ROOT / "gyre_slurm", root / "gyre_slurm",
                        ignore=shutil.ignore_patterns("__pycache__"))
    probe = Path(tempfile.mkdtemp(prefix=".sandbox-probe-", dir=root))
    probe.chmod(0o777)
    try:
        yield root, probe
    finally:
        shutil.rmtree(made if made is not None else probe)


def test_the_sandbox_hides_the_tasks_and_keeps_the_host_read_only_wherever_it_runs(checkout):
    root, probe = checkout
    tag = f"gyre-test-{os.getpid()}"
    proc = subprocess.run([sys.executable, "-c", SANDBOX_CHECK, str(probe), tag], cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert Path(out["tasks_dir"]).is_relative_to(root), out["tasks_dir"]
    # nothing of any task in sight (before scoring): no folder, solution, test or runner
    assert out["find"] == "<returncode>0</returncode>\n<output>\n0\n</output>", out["find"]
    for c, code, observation in out["writes"]:
        assert code not in (0, None), (c, observation)
        assert any(m in observation for m in ("Read-only file system", "Permission denied",
                                              "No such file or directory")), (c, observation)
    for path in (f"/etc/{tag}", f"/root/{tag}", f"/home/{tag}", f"{probe}/{tag}",
                 f"{root}/{tag}", f"{ROOT}/{tag}"):
        assert not os.path.lexists(path), path
    assert out["reward"] == 1.0  # and the sandbox still does its job from there


def test_no_network_inside():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    accepted = []
    def accept():
        with contextlib.suppress(OSError):  # closed at the end: nothing connected
            accepted.append(srv.accept())

    threading.Thread(target=accept, daemon=True).start()
    with tempfile.TemporaryDirectory() as d:
        usock = Path(d, "s")
        Path(d).chmod(0o755)
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(str(usock))
        unix.listen()
        usock.chmod(0o777)
        tcp = (f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), "
               "timeout=3); print(\"CONNECTED\")'")
        uds = (f"python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); "
               f"s.connect(\"{usock}\"); print(\"CONNECTED\")'")
        results, _ = run(episode([reply(tcp), reply(uds), reply("cat /proc/net/dev"),
                                  reply("submit")]))
        unix.close()
    srv.close()
    assert "ConnectionRefusedError" in results[0].observation, results[0].observation
    assert "PermissionError" in results[1].observation, results[1].observation
    assert "CONNECTED" not in results[0].observation + results[1].observation
    assert not accepted
    devices = [ln.split(":")[0].strip() for ln in results[2].observation.splitlines() if ":" in ln]
    assert devices == ["lo"], results[2].observation


def test_close_kills_everything_and_removes_the_workdir():
    marker = f"gyre-sleeper-{os.getpid()}"

    async def go():
        env = make_env("shell")
        await env.reset(task_id=TASK, seed=0)
        wd = env.workdir
        res = await env.step(reply(f"(exec -a {marker} sleep 300) & echo started"))
        assert "started" in res.observation and res.info["exit_code"] == 0
        await env.reset(task_id=TASK, seed=1)  # a new episode: a new workdir, old one gone
        assert not wd.exists() and env.workdir.exists()
        # a step cancelled mid-command (the runtime's run timeout) kills its command
        step = asyncio.ensure_future(env.step(reply(f"exec -a {marker} sleep 300")))
        await asyncio.sleep(1.0)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        wd = env.workdir
        await env.close()
        return wd

    wd = run(go())
    assert not wd.exists()
    time.sleep(0.2)
    left = [p for p in os.listdir("/proc")
            if p.isdigit() and faults.cmdline(p).startswith(marker)]
    assert left == []


def test_keep_workdir_and_unsafe_isolation_none():
    async def go():
        env = make_env("shell", isolation="none", keep_workdir=True)
        await env.reset(task_id=TASK, seed=0)
        res = await env.step(reply("pwd; echo ok > note"))
        wd = env.workdir
        await env.close()
        return res, wd

    res, wd = run(go())
    try:
        assert str(wd) in res.observation and (wd / "note").read_text() == "ok\n"
    finally:
        shutil.rmtree(wd)


def test_sandbox_runs_as_an_unprivileged_user_with_a_process_limit(tmp_path):
    # As root the command drops to nobody; as another user it keeps that user's uid.
    root = os.geteuid() == 0
    uid = 65534 if root else os.geteuid()
    sb = Sandbox(tmp_path, limits=Limits(nproc=16, time_s=20.0))
    if root:
        os.chown(tmp_path, uid, uid)
    forks = ("import os, time\nn = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(2)\n"
             "        os._exit(0)\n    n += 1\nprint('forked', n)\n")
    res = run(sb.run(f"id -u; grep CapEff /proc/self/status; cat /etc/shadow; "
                     f"python3 -c \"{forks}\""))
    lines = res.output.splitlines()
    assert lines[0] == str(uid) and lines[1].split()[1] == "0000000000000000", res.output
    assert "Permission denied" in lines[2], res.output
    # RLIMIT_NPROC counts the sandbox's processes (root's own user namespace per command);
    # as another user it counts all of that user's processes, so only the cap is certain
    forked = int(lines[3].split()[1]) if lines[3].startswith("forked ") else -1
    assert (5 if root else -1) < forked < 16, res.output


def test_limit_reasons_and_seccomp_program():
    assert limit_hit(152, "") == "cpu" and limit_hit(153, "") == "fsize"
    assert limit_hit(1, "MemoryError\n") == "memory" and limit_hit(0, "MemoryError") is None
    assert limit_hit(1, "boom") is None
    assert len(seccomp_program("x86_64")) == 12 * 8 and seccomp_program("riscv64") is None


TESTS = ("test_small", "test_one", "test_zero", "test_negative", "test_hundred")
FAKE = "".join(f"print('PASS {t}', flush=True)\n" for t in TESTS)
FORGE_FDS = ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'"
             + "".join(f"PASS {t}\\n" for t in TESTS) + "')\n    except OSError:\n"
             "        pass\n")


@pytest.mark.parametrize("plant", [
    # the module under test prints every PASS line, then ends the runner's process
    f"cat > rangesum.py <<'EOF'\n{FAKE}import os; os._exit(0)\nEOF",
    # the same at the runner's start, from the agent's home (a user site customisation,
    # and a sitecustomize beside it), writing to every descriptor it can find too
    "d=.local/lib/python3.11/site-packages; mkdir -p $d; cat > $d/usercustomize.py <<'EOF'\n"
    f"{FORGE_FDS}{FAKE}os._exit(0)\nEOF\ncp $d/usercustomize.py sitecustomize.py; "
    "python3 -c 'print(1)' | head -c 300",
])
def test_the_agent_cannot_fake_the_test_runner(plant):
    (first, last), _ = run(episode([reply(plant), reply("submit")]))
    assert first.info["exit_code"] == 0, first.observation
    if "rangesum.py" in plant:
        assert "PASS test_hundred" in last.info["test_output"]  # printed, not counted
    assert last.reward < 1.0 and not all(last.info["tests"].values()), last.info

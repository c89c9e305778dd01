"""`shell`: an agent works on a small coding task with shell commands in a sandbox.

A task is a folder (built-ins under `gyre_slurm/envs/tasks/`; or `tasks_dir=`):
- `task.yaml` (or `task.json`): `instruction` (text), `test_command` (a shell
  command), `tests` (the names of the tests, which the reward counts);
- `files/` (optional): copied into a fresh working directory at `reset`;
- `tests/`: copied into `<workdir>/.gyre_tests/` only when the episode is scored
  (replacing whatever the agent put there), with `gyre_runner.py` (see
  `tasks/gyre_runner.py`) beside it, so `python3 .gyre_tests/gyre_runner.py` runs them;
- `solution.sh` (optional, never shown to the agent): a reference solution, used by
  the tests to check that every task is solvable;
- `image` (optional, in the task file): a container image folder (relative to the
  task's) that every command and the tests run in, in the same sandbox with the same
  limits (`gyre_slurm.envs.container`: Charliecloud's ch-run).

Task ids are "shell/<task name>/<seed>" (`tasks_for_step` draws the names; the seed
does not change a task). `reset` makes the working directory `<base_dir>/<name>-XXXX`
(`base_dir`: a parameter; default a private temp dir) and returns the instruction with
the rules of the game.

Actions: the model's reply must hold exactly one ```bash (or ```sh) fenced block; its
content is the command, run by `bash -c` in the working directory (seen as
/home/agent) in a sandbox (`gyre_slurm.envs.sandbox`: only the system's directories,
read-only; no network; limits; files persist between commands, the shell's state does
not). The observation
is "<returncode>N</returncode>\n<output>\n...</output>". A reply with no block or
several runs nothing and its observation restates the format. A block whose command is
just `submit` ends the episode.

The episode ends (done=True), and is scored, on: `submit` (end_reason "submit"),
the `max_steps`-th reply (end_reason "max_steps"), or a command that exceeds a limit
(end_reason "limit", `info["limit"]` in "time" | "cpu" | "memory" | "fsize" |
"output" | "disk"; the observation says which; "disk": the commands added more than
`disk_mb`, 1024 by default, to the task's own files in the workdir). Scoring copies
the tests in, runs `test_command` in the same sandbox with the same limits, and reads
the lines
`PASS <name>` / `FAIL <name>` (anything may follow a colon) that it writes to the
descriptor named by $GYRE_RESULTS_FD (a pipe of its own: `gyre_runner.py` does this; a
task's own test command must too), never its output, which the code under test shares:
printing "PASS x" scores nothing. The scoring run loads nothing the agent left in its
home (no user site; HOME is elsewhere). Reward = (declared tests with a PASS and no
FAIL) / (declared tests). A test not reported (crash, limit) counts as failed.
Code under test still runs in the runner's process, so code written to tamper with the
runner itself (not merely print) is not ruled out.

External scaffolds (`gyre_slurm.agents.scaffold`) drive the same episode through
`execute(command)` (one command in the sandbox; a limit is reported, not an end; at
most `max_steps`) and `evaluate()` (the tests, once the scaffold has ended). The final `info` holds {"end_reason", "tests": {name: bool},
"num_passed", "num_tests", "test_output" (first 2000 chars), "test_limit"}; every
step's `info` holds {"step", "exit_code", "limit", "elapsed_s"} (exit_code None when
no command ran or it was killed). Earlier steps pay 0.0.

`close()` removes the working directory (`keep_workdir=True` keeps it, for debugging);
nothing a command started is still running after its step returns.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.common.yamltext import read_text, read_yaml, text_problem
from gyre_slurm.envs.base import StepResult, register_env
from gyre_slurm.envs.sandbox import (
    ISOLATIONS, Limits, Sandbox, default_sandbox_uid, disk_usage, ensure_bwrap)
from gyre_slurm.errors import CommandRefused, UserError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
RUNNER = "gyre_runner.py"
TESTS_SUBDIR = ".gyre_tests"
SUBMIT = "submit"
TEST_OUTPUT_CHARS = 2000
RESULTS_FD = "GYRE_RESULTS_FD"  # where a test command writes its PASS/FAIL lines
_BLOCK = re.compile(r"```(?:bash|sh)[ \t]*\n(.*?)```", re.DOTALL)
_RESULT = re.compile(r"^(PASS|FAIL) ([^\s:]+)", re.MULTILINE)

SYSTEM_PROMPT = """You are an agent working on a task in a Linux shell sandbox.
Each reply: think briefly, then give exactly ONE command in a fenced block:
```bash
COMMAND
```
Each command runs with bash in the task directory, in a fresh shell (cd and variables
do not carry over; files do). There is no network. Output is cut when long.
When the task is done, reply with a block holding only the word submit:
```bash
submit
```"""

FORMAT_HELP = ("No command was run: reply with exactly one ```bash fenced block holding the "
               "command (or just `submit` to finish).")


@dataclass(frozen=True)
class ShellTask:
    name: str
    root: Path
    instruction: str
    test_command: str
    tests: tuple[str, ...]
    image: Path | None = None  # a container image its commands and tests run in


def load_task(root: Path) -> ShellTask:
    """The task in folder `root` (task.yaml or task.json); `UserError` when malformed."""
    yml, jsn = root / "task.yaml", root / "task.json"
    if yml.is_file():
        data = read_yaml(yml, what=f"shell task {yml}")
    elif jsn.is_file():
        try:
            data = loads_json(read_text(jsn, what=f"shell task {jsn}"))
        except ValueError as exc:
            raise UserError(f"shell task {jsn} is not valid JSON: {exc}") from exc
    else:
        raise UserError(f"shell task {root}: no task.yaml or task.json")
    keys = {"instruction", "test_command", "tests"}
    if not isinstance(data, dict) or not keys <= set(data) <= keys | {"image"}:
        raise UserError(f"shell task {root}: the task file must have the keys "
                        f"{sorted(keys)} (and optionally image), got "
                        f"{sorted(data) if isinstance(data, dict) else data!r}")
    for key in ("instruction", "test_command"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise UserError(f"shell task {root}: `{key}` must be non-empty text, got "
                            f"{data[key]!r:.80}")
    tests = data["tests"]
    if (not isinstance(tests, list) or not tests or len(set(tests)) != len(tests)
            or not all(isinstance(t, str) and re.fullmatch(r"[^\s:]+", t) for t in tests)):
        raise UserError(f"shell task {root}: `tests` must be a non-empty list of distinct "
                        f"names without spaces or colons, got {tests!r}")
    if not (root / "tests").is_dir():
        raise UserError(f"shell task {root}: no tests/ folder")
    image = data.get("image")
    if image is not None and not (isinstance(image, str) and image.strip()):
        raise UserError(f"shell task {root}: `image` must be a path (a container image "
                        f"folder, relative to the task's), got {image!r}")
    texts = {"instruction": [data["instruction"]], "test_command": [data["test_command"]],
             "tests": tests, "image": [image] if image is not None else []}
    for key, values in texts.items():
        for problem in filter(None, map(text_problem, values)):
            raise UserError(f"shell task {root}: `{key}`: {problem}")
    return ShellTask(name=root.name, root=root, instruction=str(data["instruction"]).strip(),
                     test_command=str(data["test_command"]), tests=tuple(tests),
                     image=None if image is None else (root / image).resolve())


def task_names(tasks_dir: Path | str | None = None) -> list[str]:
    """The task folders of `tasks_dir` (default: the built-ins), sorted."""
    d = Path(tasks_dir) if tasks_dir is not None else TASKS_DIR
    if not d.is_dir():
        raise UserError(f"shell: tasks_dir {d} is not a directory")
    return sorted(p.name for p in d.iterdir()
                  if (p / "task.yaml").is_file() or (p / "task.json").is_file())


def extract_command(reply: str) -> str | None:
    """The command of a reply with exactly one ```bash/```sh block, else None."""
    blocks = _BLOCK.findall(reply)
    return blocks[0].strip() if len(blocks) == 1 else None


def score(output: str, tests: tuple[str, ...]) -> dict[str, bool]:
    """Each declared test: True when the output has `PASS name` and no `FAIL name`."""
    seen: dict[str, bool] = {}
    for verdict, name in _RESULT.findall(output):
        if name in tests:
            seen[name] = seen.get(name, True) and verdict == "PASS"
    return {t: seen.get(t, False) for t in tests}


_DEFAULT_BASE: list[Path] = []


def default_base_dir() -> Path:
    """A private temp dir (mode 0700) for this process's workdirs, removed at exit when
    empty."""
    if not _DEFAULT_BASE:
        d = Path(tempfile.mkdtemp(prefix="gyre-sandboxes-"))
        _DEFAULT_BASE.append(d)
        atexit.register(lambda: d.rmdir() if d.is_dir() and not any(d.iterdir()) else None)
    return _DEFAULT_BASE[0]


class ShellEnv:
    name = "shell"

    def __init__(self, *, tasks_dir: str | None = None, base_dir: str | None = None,
                 isolation: str = "bwrap", keep_workdir: bool = False, max_steps: int = 30,
                 time_s: float = 30.0, cpu_s: int = 30, memory_mb: int = 1024,
                 fsize_mb: int = 64, nproc: int = 128, output_bytes: int = 16_384,
                 disk_mb: int = 1024, sandbox_uid: int | None = None):
        if isolation not in ISOLATIONS:
            raise UserError(f"shell: isolation must be one of {ISOLATIONS} ('none' runs "
                            f"commands unisolated: trusted tasks only), got {isolation!r}")
        if max_steps < 1:
            raise UserError(f"shell: max_steps must be >= 1, got {max_steps}")
        self.tasks_dir = Path(tasks_dir) if tasks_dir is not None else TASKS_DIR
        self.names = task_names(self.tasks_dir)
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.isolation, self.keep_workdir, self.max_steps = isolation, keep_workdir, int(max_steps)
        self.limits = Limits(time_s=float(time_s), cpu_s=int(cpu_s), memory_mb=int(memory_mb),
                             fsize_mb=int(fsize_mb), nproc=int(nproc),
                             output_bytes=int(output_bytes), disk_mb=int(disk_mb))
        self.uid = default_sandbox_uid() if sandbox_uid is None else int(sandbox_uid)
        if isolation == "bwrap":
            ensure_bwrap()  # refuses to start without working isolation
        self.system_prompt = SYSTEM_PROMPT
        self.workdir: Path | None = None
        self._task: ShellTask | None = None
        self._sandbox: Sandbox | None = None
        self._steps = 0
        self._done = True

    async def reset(self, *, task_id: str, seed: int, run_seed: int | None = None) -> str:
        await self.close()
        self._task = load_task(self.tasks_dir / self._task_name(task_id))
        base = self.base_dir if self.base_dir is not None else default_base_dir()
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self._task.name}-", dir=base))
        if (self._task.root / "files").is_dir():
            shutil.copytree(self._task.root / "files", self.workdir, dirs_exist_ok=True,
                            symlinks=True)
        _chown_tree(self.workdir, self.uid if self.isolation == "bwrap" else os.geteuid())
        # disk_mb is what the commands may add: the task's own files come on top
        own_mb = -(-disk_usage(self.workdir, cap=1 << 60) // (1 << 20))
        limits = replace(self.limits, disk_mb=self.limits.disk_mb + own_mb)
        self._sandbox = Sandbox(self.workdir, limits=limits, isolation=self.isolation,
                                sandbox_uid=self.uid, image=self._task.image,
                                hide_paths=(str(base.resolve()), str(self.tasks_dir.resolve())))
        self._steps, self._done = 0, False
        return (f"{self._task.instruction}\n\nThe task files are in the current directory. "
                "Run one command per reply in a ```bash block; reply with a block holding "
                "only `submit` when done.")

    def _task_name(self, task_id: str) -> str:
        parts = task_id.split("/")
        name = parts[1] if len(parts) >= 2 and parts[0] == self.name else parts[0]
        if name not in self.names:
            raise UserError(f"shell: unknown task {task_id!r} (task name {name!r}); "
                            f"tasks in {self.tasks_dir}: {', '.join(self.names)}")
        return name

    async def step(self, action: str) -> StepResult:
        if self._done or self._sandbox is None:
            raise RuntimeError("shell: step() after the episode ended; call reset()")
        self._steps += 1
        info: dict[str, Any] = {"step": self._steps, "exit_code": None, "limit": None,
                                "elapsed_s": 0.0}
        command = extract_command(action)
        if command == SUBMIT:
            return await self._end("submit", "Submitted.", info)
        if command is None:
            observation = FORMAT_HELP
        else:
            res = await self._sandbox.run(command)
            info.update(exit_code=res.exit_code, limit=res.limit, elapsed_s=res.elapsed_s)
            observation = (f"<returncode>{res.exit_code}</returncode>\n"
                           f"<output>\n{res.output}</output>")
            if res.limit is not None:
                observation += f"\nThe command exceeded the {res.limit} limit: the episode ends."
                return await self._end("limit", observation, info)
        if self._steps >= self.max_steps:
            return await self._end("max_steps", observation, info)
        return StepResult(observation, 0.0, False, info)

    # -- an external scaffold's episode (gyre_slurm.agents.scaffold) ------------------
    async def execute(self, command: str) -> dict[str, Any]:
        """Run one command of an external scaffold in the task's sandbox (what `step`
        does with a reply's block): {"output", "returncode" (None: killed at a limit),
        "limit", "elapsed_s", "step"}. A limit is reported to the scaffold, which goes
        on; past `max_steps` commands, or after the episode ended, `CommandRefused`."""
        if self._done or self._sandbox is None:
            raise CommandRefused("the episode has ended: no more commands")
        if self._steps >= self.max_steps:
            raise CommandRefused(f"the episode's {self.max_steps} commands (max_steps) are "
                                 "used up; submit")
        self._steps += 1
        res = await self._sandbox.run(command)
        return {"output": res.output, "returncode": res.exit_code, "limit": res.limit,
                "elapsed_s": res.elapsed_s, "step": self._steps}

    async def evaluate(self) -> StepResult:
        """The scaffold has ended (its sandbox is gone): the task's tests decide the
        reward, run now, outside its reach."""
        if self._sandbox is None:
            raise RuntimeError("shell: evaluate() before reset()")
        return await self._end("scaffold_end", "", {"step": self._steps, "exit_code": None,
                                                    "limit": None, "elapsed_s": 0.0})

    async def _end(self, reason: str, observation: str, info: dict) -> StepResult:
        self._done = True
        results, output, limit = await self._run_tests()
        passed = sum(results.values())
        info.update(end_reason=reason, tests=results, num_passed=passed,
                    num_tests=len(results), test_output=output[:TEST_OUTPUT_CHARS],
                    test_limit=limit)
        return StepResult(observation, passed / len(results), True, info)

    async def _run_tests(self) -> tuple[dict[str, bool], str, str | None]:
        assert self._task is not None and self._sandbox is not None and self.workdir
        dest = self.workdir / TESTS_SUBDIR
        if dest.is_symlink() or dest.is_file():  # never follow what the agent made
            dest.unlink()
        elif dest.exists():
            _rmtree(dest)
        shutil.copytree(self._task.root / "tests", dest)
        shutil.copy2(TASKS_DIR / RUNNER, dest / RUNNER)
        # Results come back on a pipe of their own, not in the output the code under
        # test shares: printing "PASS x" scores nothing. Nothing the agent left in its
        # workdir (its HOME) is loaded first: no user site, no sitecustomize from there.
        rfd, wfd = os.pipe()
        try:
            res = await self._sandbox.run(self._task.test_command, pass_fds=(wfd,), env_extra={
                RESULTS_FD: str(wfd), "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1",
                "HOME": "/tmp" if self.isolation == "bwrap" else str(self.workdir)})
        finally:
            os.close(wfd)
        with os.fdopen(rfd, "rb") as results:
            verdicts = results.read(1 << 20).decode("utf-8", errors="replace")
        if res.limit == "disk":  # over the budget: nothing scores, whatever was reported
            verdicts = ""  # before the kill (the first check races a quick test run)
        return score(verdicts, self._task.tests), res.output, res.limit

    async def close(self) -> None:
        self._done = True
        self._sandbox = None
        if self.workdir is not None and not self.keep_workdir:
            _rmtree(self.workdir)
        self.workdir = None


def _chown_tree(root: Path, uid: int) -> None:
    if os.geteuid() != 0 or uid == 0:
        return
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), uid, uid)
    os.chown(root, uid, uid)


def _rmtree(path: Path) -> None:
    """Remove a tree the sandbox wrote (it may have made directories unwritable; root
    needs no help, another user first makes every directory its own rwx again)."""
    if not os.path.lexists(path):
        return
    if os.geteuid() != 0 and not path.is_symlink():
        os.chmod(path, 0o700)
        for dirpath, dirnames, _ in os.walk(path):  # top-down: fixed before entered
            for d in dirnames:
                p = os.path.join(dirpath, d)
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
    shutil.rmtree(path)


def shell_task_ids(params: dict[str, Any]) -> list[str]:
    """The task names `tasks_for_step` draws from, for the env's parameters."""
    return task_names(params.get("tasks_dir"))


register_env("shell", ShellEnv, task_names=shell_task_ids)

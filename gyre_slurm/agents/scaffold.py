"""An external scaffold as a `gyre run` agent: one sandboxed process per run.

    runner = ScaffoldRunner(cfg.agent.scaffold, run_dir=..., socket_path=...)
    result = await runner.run(env=env, task=task, run_id=..., key=gateway.open_run(run_id),
                              gateway=gateway, run_seed=...)

A run: `env.reset` gives the task; the scaffold (`ScaffoldConfig`: a command, or
mini-swe-agent) starts in a sandbox of its own with the run's own key and gateway URL;
each command it wants run goes through the gateway (`POST /runs/<id>/sandbox/exec`) to
`env.execute`, so it runs in the task's sandbox (no network, limits), never in the
scaffold's; when the scaffold exits (or is stopped at `timeout_s`), `env.evaluate()`
runs the task's check, outside the scaffold's reach, and its reward is the run's.

The scaffold's sandbox (bubblewrap, `isolation: bwrap`):
- network: a namespace of its own with only loopback; the run's gateway is relayed there
  from the gateway's Unix socket by `sandbox_gateway.py`, so OPENAI_BASE_URL is
  `http://127.0.0.1:<port>/runs/<run_id>/v1` and nothing else is reachable (not the
  engines, the control server, the rendezvous store, other hosts);
- filesystem: the system's directories and the scaffold's interpreter (its prefix and
  base prefix), read-only; its own writable home (`RUN_DIR/scaffolds/<run_id>/`, at
  /home/agent; removed once the run has ended ok, `keep_homes`); its `workdir`
  read-only at /opt/scaffold; gyre's two helper modules at /opt/gyre; never the run
  dir (the job secret, other runs, the call store) nor the task's files (it sees them
  only through commands);
- processes: private PID/IPC/UTS namespaces, uid nobody when started by root, no
  capabilities, a clean environment (OPENAI_BASE_URL, OPENAI_API_KEY = the run's key,
  GYRE_RUN_ID, GYRE_EXEC_URL, GYRE_TASK, the config's `env`), limits on address space,
  processes and file size, and everything it started dies with it; its home and its
  log hold at most `disk_mb` together (checked while it runs: past it the scaffold is
  stopped).
`isolation: none` runs the scaffold as a plain process (trusted programs only): it can
read whatever the job's user can, the job secret included.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_slurm.agents.external import mini_swe_agent_config
from gyre_slurm.common.fsio import write_bytes_atomic
from gyre_slurm.envs.base import run_reward
from gyre_slurm.envs.sandbox import (HIDDEN, SANDBOX_PATH, default_sandbox_uid, drop_argv,
                                     ensure_bwrap, system_mounts, watch_disk)
from gyre_slurm.errors import UserError

log = logging.getLogger(__name__)
HELPERS = Path(__file__).resolve().parent
RELAY, MINI_ENV = "sandbox_gateway.py", "gyre_env.py"
SANDBOX_PORT = 8000  # the relay's port on the sandbox's own loopback
HOME, OPT_GYRE, OPT_SCAFFOLD, RUN_SOCKET = ("/home/agent", "/opt/gyre", "/opt/scaffold",
                                            "/run/gyre")
KILL_GRACE_S = 5.0
LOG_TAIL = 2000


@dataclass(frozen=True)
class ScaffoldResult:
    status: str  # "ok" | "failed" | "timeout"
    exit_code: int | None
    error: str | None
    log_path: str


@functools.lru_cache(maxsize=16)
def python_dirs(python: str) -> tuple[str, ...]:
    """The folders an interpreter needs (its prefix and base prefix), to show read-only."""
    out = subprocess.run([python, "-c", "import sys, json; print(json.dumps([sys.prefix, "
                          "sys.base_prefix, sys.executable]))"], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        raise UserError(f"the scaffold's interpreter {python} does not start: "
                        f"{out.stderr[-500:]}")
    prefix, base, exe = json.loads(out.stdout)
    dirs = {os.path.realpath(p) for p in (prefix, base, os.path.dirname(os.path.dirname(exe)))}
    dirs |= {os.path.realpath(os.path.dirname(os.path.realpath(exe)))}
    return tuple(sorted(d for d in dirs if not _under(d, ("/usr", "/bin", "/lib"))))


@functools.lru_cache(maxsize=1)
def _helper_copies() -> Path:
    """Copies of the two helper modules in a folder the sandbox's user can read (the
    package itself may live where it cannot: a 0700 home), removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="gyre-scaffold-helpers-"))
    for name in (RELAY, MINI_ENV):
        shutil.copy(HELPERS / name, folder / name)
        os.chmod(folder / name, 0o644)
    os.chmod(folder, 0o755)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _ancestors(dirs: tuple[str, ...]) -> list[str]:
    """The folders above `dirs` that the sandbox lacks (bwrap would make them with the
    host's modes: /root is 0700), outermost first."""
    out: list[str] = []
    for d in dirs:
        parts = Path(d).parts
        for i in range(2, len(parts)):
            p = str(Path(*parts[:i]))
            if p not in out and not _under(p, ("/usr", "/etc", "/tmp", "/home", "/run")):
                out.append(p)
    return sorted(out, key=lambda p: p.count("/"))


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


class ScaffoldRunner:
    """Starts one scaffold per run (see the module docstring)."""

    def __init__(self, spec, *, python: str, run_dir: Path, socket_path: Path | None,
                 gateway_url: str):
        self.spec, self.python = spec, python
        self.run_dir, self.socket_path, self.gateway_url = Path(run_dir), socket_path, gateway_url
        self.bwrap = spec.isolation == "bwrap"
        if self.bwrap:
            ensure_bwrap()
            if socket_path is None:
                raise UserError("a sandboxed scaffold needs the gateway's Unix socket")
            self.python_dirs = python_dirs(python)
            self.helpers = _helper_copies()
        if spec.workdir is not None and not Path(spec.workdir).is_dir():
            raise UserError(f"agent.scaffold.workdir = {spec.workdir!r} is not a directory")
        self.uid = default_sandbox_uid()

    def urls(self, run_id: str) -> tuple[str, str]:
        """(OPENAI_BASE_URL, GYRE_EXEC_URL) as the scaffold sees them."""
        root = f"http://127.0.0.1:{SANDBOX_PORT}" if self.bwrap else self.gateway_url
        return f"{root}/runs/{run_id}/v1", f"{root}/runs/{run_id}/sandbox/exec"

    def home(self, run_id: str) -> Path:
        return self.run_dir / "scaffolds" / run_id

    async def after_run(self, run_id: str, *, ok: bool) -> None:
        """The run has ended: its home goes unless `keep_homes` keeps it (up to
        `disk_mb` each on the shared filesystem, thousands of runs a job); its log stays."""
        keep = self.spec.keep_homes
        if keep == "all" or (keep == "failed" and not ok):
            return
        try:
            await asyncio.to_thread(shutil.rmtree, self.home(run_id))
        except FileNotFoundError:
            pass
        except OSError as exc:  # left behind; the run and the job go on
            log.warning("scaffold home of %s not removed: %s", run_id, exc)

    def _command(self, run_id: str, task: str, home_seen: str) -> tuple[list[str], dict]:
        """The scaffold's argv and extra environment (mini-swe-agent: its config too)."""
        if self.spec.type == "command":
            return list(self.spec.command), {}
        base_url, _ = self.urls(run_id)
        config = mini_swe_agent_config(
            gateway_url=base_url.split("/runs/")[0], run_id=run_id, workdir=home_seen,
            step_limit=self.spec.step_limit)
        config["environment"] = {"environment_class": "gyre_env.GyreSandboxEnvironment",
                                 "cwd": home_seen}
        write_bytes_atomic(self.home(run_id) / "mini.yaml", json.dumps(config, indent=1).encode())
        helpers = OPT_GYRE if self.bwrap else str(HELPERS)
        return ([self.python, "-m", "minisweagent.run.mini", "-c", "mini_textbased.yaml",
                 "-c", f"{home_seen}/mini.yaml", "-t", task, "-o", f"{home_seen}/mini.traj.json"],
                {"PYTHONPATH": helpers, "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
                 "MSWEA_GLOBAL_CONFIG_DIR": f"{home_seen}/.mswea",
                 "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
                 "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1"})

    def argv_env(self, run_id: str, key: str, task: str) -> tuple[list[str], dict[str, str]]:
        home = self.home(run_id)
        seen = HOME if self.bwrap else str(home)
        command, extra = self._command(run_id, task, seen)
        base_url, exec_url = self.urls(run_id)
        env = {"PATH": SANDBOX_PATH, "HOME": seen, "LANG": "C.UTF-8", "TERM": "dumb",
               **self.spec.env_vars, **extra, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key,
               "GYRE_RUN_ID": run_id, "GYRE_EXEC_URL": exec_url, "GYRE_TASK": task}
        cwd = (OPT_SCAFFOLD if self.bwrap else self.spec.workdir) if self.spec.workdir else seen
        if not self.bwrap:
            return command, {**env, "GYRE_CWD": cwd}
        argv = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session",
                "--hostname", "sandbox", *system_mounts(), "--dev", "/dev", "--proc", "/proc"]
        for p in HIDDEN:
            argv += ["--tmpfs", p]
        for d in _ancestors(self.python_dirs):  # traversable by the sandbox's user
            argv += ["--perms", "0755", "--dir", d]
        for d in self.python_dirs:
            argv += ["--ro-bind", d, d]
        argv += ["--perms", "0755", "--dir", "/opt"]
        argv += ["--bind", str(home), HOME, "--ro-bind", str(self.helpers), OPT_GYRE,
                 "--ro-bind", str(self.socket_path.parent), RUN_SOCKET]
        if self.spec.workdir:
            argv += ["--ro-bind", str(Path(self.spec.workdir).resolve()), OPT_SCAFFOLD]
        # The environment is bwrap's own (`start` gives it exactly `env`), not --setenv:
        # a process's arguments are world-readable (/proc/PID/cmdline, `ps`) on a node
        # other users may share, its environment only to its own user.
        argv += ["--remount-ro", "/", "--chdir", cwd]
        if os.geteuid() == 0:
            argv += drop_argv(self.uid)
        mib = 1 << 20
        argv += ["prlimit", f"--as={self.spec.memory_mb * mib}", f"--nproc={self.spec.nproc}",
                 f"--fsize={min(1024, self.spec.disk_mb) * mib}", "--core=0", "--",
                 self.python, f"{OPT_GYRE}/{RELAY}", "--port", str(SANDBOX_PORT),
                 "--socket", f"{RUN_SOCKET}/{self.socket_path.name}", "--", *command]
        return argv, env

    def _prepare_home(self, run_id: str, task: str) -> Path:
        home = self.home(run_id)
        if home.exists():
            shutil.rmtree(home)
        home.mkdir(parents=True, mode=0o700)
        write_bytes_atomic(home / "TASK.md", task.encode())
        if self.bwrap and os.geteuid() == 0:
            for p in (home, home / "TASK.md"):
                os.chown(p, self.uid, self.uid)
        return home

    async def start(self, run_id: str, key: str, task: str) -> tuple[Any, Path]:
        home = self._prepare_home(run_id, task)
        argv, env = self.argv_env(run_id, key, task)
        log_path = self.run_dir / "logs" / f"scaffold-{run_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cwd = env.pop("GYRE_CWD", None) or str(home)
        with open(log_path, "ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        return proc, log_path

    async def wait(self, proc, log_path: Path, home: Path | None = None) -> ScaffoldResult:
        """Its end, its `timeout_s`, or its home (`home`, when given) and its log (what
        it prints, on the shared filesystem too) past `disk_mb`."""
        watch = asyncio.create_task(watch_disk(home, log_path, disk_mb=self.spec.disk_mb,
                                               proc=proc)
                                    if home is not None else asyncio.Event().wait())
        ended = asyncio.ensure_future(proc.wait())
        try:
            await asyncio.wait_for(asyncio.wait({ended, watch},
                                                return_when=asyncio.FIRST_COMPLETED),
                                   self.spec.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            await _stop(proc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return ScaffoldResult("timeout", proc.returncode, f"the scaffold ran past its "
                                  f"{self.spec.timeout_s:g} s and was stopped", str(log_path))
        finally:
            watch.cancel()
        if watch.done() and not watch.cancelled() and watch.result():  # home over disk_mb
            await _stop(proc)
            return ScaffoldResult("failed", proc.returncode, f"the scaffold's home {home} and "
                                  f"its log {log_path} held more than agent.scaffold.disk_mb = "
                                  f"{self.spec.disk_mb} MiB and it was stopped", str(log_path))
        code = await ended
        if code == 0:
            return ScaffoldResult("ok", 0, None, str(log_path))
        tail = log_path.read_bytes()[-LOG_TAIL:].decode(errors="replace")
        return ScaffoldResult("failed", code, f"the scaffold exited with code {code} (log "
                              f"{log_path}): ...{tail}", str(log_path))


async def _stop(proc) -> None:
    """The scaffold's whole process group (bwrap: its PID namespace dies with it)."""
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(proc.wait(), grace)
            return
        except asyncio.TimeoutError:
            continue


async def run_scaffold(runner: ScaffoldRunner, *, env, task, run_id: str, gateway,
                       run_seed: int | None, max_calls: int | None = None) -> dict[str, Any]:
    """One run of `task` with the scaffold; its run record (as the agent loop's) plus
    "scaffold" {status, exit_code, log}. The environment is the caller's to close."""
    t_start = time.time()
    record = {"run_id": run_id, "task_id": task.task_id, "reward": 0.0, "status": "failed",
              "num_calls": 0, "num_compactions": 0, "error": None, "t_start": t_start}
    kw = {} if run_seed is None else {"run_seed": run_seed}
    try:
        instruction = await env.reset(task_id=task.task_id, seed=task.seed, **kw)
    except Exception as exc:  # noqa: BLE001 - an env failure ends the run, not the job
        record.update(error=f"environment error: {type(exc).__name__}: {exc}", t_end=time.time())
        return record
    key = gateway.open_run(run_id, max_calls=max_calls)
    gateway.attach_exec(run_id, env.execute)
    try:
        proc, log_path = await runner.start(run_id, key, instruction)
        result = await runner.wait(proc, log_path, home=runner.home(run_id))
    finally:
        gateway.detach_exec(run_id)  # no command after the scaffold's end
    record.update(num_calls=gateway.calls_of(run_id),
                  scaffold={"status": result.status, "exit_code": result.exit_code,
                            "log": result.log_path})
    if result.status == "ok":  # the check, outside the scaffold's reach: it is gone
        try:
            final = await env.evaluate()
            reward = run_reward(final.reward, env_name=getattr(env, "name", "?"))
        except Exception as exc:  # noqa: BLE001 - an env failure ends the run, not the job
            record.update(error=f"environment error: {type(exc).__name__}: {exc}"[:4000])
        else:
            record.update(status="ok", reward=reward, tests=final.info.get("tests"))
    else:
        record.update(status=result.status, error=result.error)
    record["t_end"] = time.time()
    await runner.after_run(run_id, ok=record["status"] == "ok")
    return record


def gateway_socket_path(agent_cfg) -> Path | None:
    """A Unix socket for the gateway when a scaffold of `agent_cfg` (config AgentConfig)
    runs sandboxed (its only way to the gateway): in a fresh private folder, short
    enough for a socket path. The caller removes the folder at the end."""
    specs = [agent_cfg.scaffold, *agent_cfg.scaffold_per_task.values()]
    if not any(s.external and s.isolation == "bwrap" for s in specs):
        return None
    folder = Path(tempfile.mkdtemp(prefix="gyre-gw-"))
    os.chmod(folder, 0o711)  # the sandbox's user reaches the socket, lists nothing
    return folder / "gateway.sock"

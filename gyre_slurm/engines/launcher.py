"""Start and stop an embedded engine process; wait for it to be healthy.

`start_engine` runs `python -m gyre_slurm.engines.embedded ... --port 0 --ready-file F`
with stdout and stderr appended to `log_path`, and (unless `ready_timeout_s` is None)
blocks until the engine has written F = `{"host", "port", "pid", "base_url"}` (so call it
through `asyncio.to_thread` from an event loop). The ready file lives beside the log:
`<log_path>.ready.json`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gyre_slurm
from gyre_slurm.common import fsio
from gyre_slurm.common.fsio import loads_json
from gyre_slurm.engines.client import EngineClient, EngineError

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(gyre_slurm.__file__).resolve().parent.parent


def write_secret(path: str | Path) -> str:
    """A fresh random secret written to `path` (mode 0600, atomically); returns it."""
    secret = secrets.token_urlsafe(32)
    fsio.write_bytes_atomic(path, (secret + "\n").encode(), mode=0o600)
    return secret


def log_tail(path: Path, num_bytes: int = 4000, *, line_chars: int = 400) -> str:
    """A log's last `num_bytes` or so, each line cut to `line_chars`: a line can be longer
    than the whole tail (vLLM names its 300 supported architectures on the line that says
    the model's is not one), and its start is what says why."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * num_bytes))
            data = f.read()
    except OSError:
        return ""
    lines = [line if len(line) <= line_chars else line[:line_chars] + " [...]"
             for line in data.decode(errors="replace").splitlines()]
    out, size = [], 0
    for line in reversed(lines):
        size += len(line) + 1
        if size > num_bytes and out:
            break
        out.append(line)
    return "\n".join(reversed(out))


@dataclass
class EngineProcess:
    """A started engine: its process, log, and (once ready) address."""

    popen: subprocess.Popen
    log_path: Path
    ready_file: Path
    host: str
    port: int | None = None
    base_url: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_bytes: int = 4000) -> str:
        return log_tail(self.log_path, num_bytes)

    def wait_ready(self, timeout_s: float, cancel: threading.Event | None = None) -> str:
        """Block until the ready file appears; the base URL. EngineError if the process
        exits first, `timeout_s` passes or `cancel` is set (the process is then left
        running)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if cancel is not None and cancel.is_set():
                raise EngineError(f"engine start cancelled; log {self.log_path}")
            if self.ready_file.exists():
                self.info = loads_json(self.ready_file.read_text())
                self.port = int(self.info["port"])
                self.base_url = f"http://{self.host}:{self.port}"
                return self.base_url
            code = self.popen.poll()
            if code is not None:
                raise EngineError(f"engine exited with code {code} before serving; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise EngineError(f"engine not serving after {timeout_s:.0f} s; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("engine pid %d ignored SIGTERM for %.1f s: killing",
                            self.pid, timeout_s)
                self.popen.kill()
                self.popen.wait(timeout_s)
        return self.popen.returncode


def engine_command(*, model_dir: str | Path, host: str, weights_dir: str | Path,
                   version: int, secret_file: str | Path, ready_file: str | Path,
                   port: int = 0, python: str = sys.executable,
                   model_name: str = "gyre-policy", log_level: str = "INFO") -> list[str]:
    return [python, "-m", "gyre_slurm.engines.embedded", "--model-dir", str(model_dir),
            "--host", host, "--port", str(port), "--weights", str(weights_dir),
            "--version", str(version), "--secret-file", str(secret_file),
            "--ready-file", str(ready_file), "--model-name", model_name,
            "--log-level", log_level, "--parent-pid", str(os.getpid())]


def start_engine(*, model_dir: str | Path, host: str, weights_dir: str | Path,
                 version: int, secret_file: str | Path, log_path: str | Path,
                 python: str = sys.executable, port: int = 0,
                 model_name: str = "gyre-policy", log_level: str = "INFO",
                 ready_timeout_s: float | None = 120.0,
                 prefix: list[str] | tuple[str, ...] = (),
                 cancel: threading.Event | None = None) -> EngineProcess:
    """Start an engine process; with `ready_timeout_s`, wait until it serves (on a
    failure the process is stopped and EngineError carries its log tail; so it is
    when another thread sets `cancel` meanwhile)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ready_file = log_path.with_name(log_path.name + ".ready.json")
    ready_file.unlink(missing_ok=True)
    cmd = engine_command(model_dir=model_dir, host=host, weights_dir=weights_dir,
                         version=version, secret_file=secret_file, ready_file=ready_file,
                         port=port, python=python, model_name=model_name,
                         log_level=log_level)
    cmd = list(prefix) + cmd  # e.g. a container step (gyre_slurm.runtime.roles)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                 stderr=subprocess.STDOUT, env=env)
    proc = EngineProcess(popen=popen, log_path=log_path, ready_file=ready_file, host=host)
    log.info("started engine pid %d on %s (log %s)", popen.pid, host, log_path)
    if ready_timeout_s is not None:
        try:
            proc.wait_ready(ready_timeout_s, cancel)
        except BaseException:
            proc.stop(timeout_s=5.0)
            raise
    return proc


async def wait_healthy(client: EngineClient, *, timeout_s: float = 60.0,
                       process: EngineProcess | None = None,
                       interval_s: float = 0.1) -> dict[str, Any]:
    """Poll /health until the engine answers status "ok"; its health dict. EngineError
    after `timeout_s`, or as soon as `process` (when given) has exited."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        if process is not None and not process.alive():
            raise EngineError(f"engine pid {process.pid} exited with code "
                              f"{process.popen.returncode}:\n{process.log_tail()}")
        try:
            health = await client.health(timeout_s=min(5.0, max(0.1, timeout_s)))
            if health.get("status") == "ok":
                return health
            last = EngineError(f"engine status {health.get('status')!r}")
        except EngineError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise EngineError(f"{client.base_url} not healthy after {timeout_s:.0f} s: "
                              f"{last}")
        await asyncio.sleep(interval_s)

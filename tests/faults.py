"""Fault injection for end-to-end tests: find a run's processes from its run dir, kill or
stop them, wait for what the run records.

    agent_pid(run_dir, node)       the node agent's pid (events.jsonl: agent_registered)
    engine_pid(run_dir, node, k=0) the pid of node's k-th engine server (its ready file,
                                   logs/engine-node<N>-s<k>.log.ready.json; rewritten by
                                   a restart)
    coordinator_pid(run_dir)       the coordinator's pid (events.jsonl: start)
    vllm_pid(run_dir, node)        the pid of node's vLLM API server (the process that
                                   runs gyre_slurm.engines.vllm_serve on its address, not
                                   the supervisor that started it)
    rank_pids(run_dir, node)       the pids of node's training rank processes (their
                                   command line names the run's model dir and the node)
    kill(pid, sig=SIGKILL)         signal a process (gone already: False)
    stopped(pid), alive(pid)       its state in /proc (stopped: T; alive: not a zombie)
    wait_event(run_dir, kind, ...) the first event of `kind` (matching fields), waiting
    wait_for(predicate, ...)       poll until true
    status(run_dir)                status.json, or {} while it is not written
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.engines.vllm import SERVE_MODULE
from engine_helpers import START_S


def events(run_dir: Path, kind: str | None = None, **fields: Any) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    return [e for e in read_jsonl(path) if (kind is None or e["kind"] == kind)
            and all(e.get(k) == v for k, v in fields.items())]


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str,
             interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not seen within {timeout_s:g} s: {what}")


def wait_event(run_dir: Path, kind: str, *, timeout_s: float = 60.0, after: float = 0.0,
               **fields: Any) -> dict:
    """The first event of `kind` with these fields (and t >= `after`)."""
    return wait_for(lambda: next((e for e in events(run_dir, kind, **fields)
                                  if e["t"] >= after), None),
                    timeout_s=timeout_s, what=f"event {kind} {fields or ''} in {run_dir}")


def status(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def agent_pid(run_dir: Path, node: int) -> int:
    return wait_event(run_dir, "agent_registered", node=node)["pid"]


def coordinator_pid(run_dir: Path) -> int:
    return wait_event(run_dir, "start")["pid"]


def engine_pid(run_dir: Path, node: int, k: int = 0) -> int:
    ready = Path(run_dir) / "logs" / f"engine-node{node}-s{k}.log.ready.json"
    return json.loads(wait_for(lambda: ready.exists() and ready.read_text(), timeout_s=START_S,
                               what=str(ready)))["pid"]


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def _processes(match: Callable[[list[str]], bool]) -> list[int]:
    """Pids of the processes whose argv `match` accepts."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if match(argv):
            out.append(int(entry.name))
    return sorted(out)


def rank_pids(run_dir: Path, node: int) -> list[int]:
    return _processes(lambda argv: "gyre_slurm.train.rankproc" in argv
                      and _arg(argv, "--model-dir") == str(Path(run_dir) / "model")
                      and _arg(argv, "--node-index") == str(node))


def node_addr(run_dir: Path, node: int) -> str:
    url = wait_event(run_dir, "agent_registered", node=node)["url"]
    return url.split("//", 1)[1].rsplit(":", 1)[0]


def vllm_pid(run_dir: Path, node: int) -> int:
    addr = node_addr(run_dir, node)
    pids = wait_for(lambda: _processes(  # the server's argv: python -m SERVE_MODULE ...
        lambda argv: argv[1:3] == ["-m", SERVE_MODULE]  # (the supervisor's: python -c ...)
        and _arg(argv, "--host") == addr), timeout_s=300, what=f"node {node}'s vLLM server")
    return pids[0]


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def stopped(pid: int) -> bool:
    """Stopped by a signal (state T)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cmdline(pid: str | int) -> str:
    """A process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""

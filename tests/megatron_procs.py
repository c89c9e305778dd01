"""Test helper: N processes of the megatron environment, each a `MegatronWorker` behind
`python -m gyre_slurm.train.rankproc --backend megatron` (the node agent's rank
process), driven from the core environment."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class DriverError(RuntimeError):
    """A command failed in a driver process (the message holds its traceback)."""


class MegatronProcesses:
    """`n` driver processes, worker i with node_index i; close() (or `with`) ends them.
    Each process's stderr goes to `log_dir/megatron-<i>.log`."""

    def __init__(self, n: int, *, python: str, model_dir: Path, log_dir: Path,
                 start_timeout_s: float = 180.0, **worker_kwargs: Any):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   PYTHONUNBUFFERED="1")
        self.procs: list[subprocess.Popen] = []
        self.logs = [Path(log_dir) / f"megatron-{i}.log" for i in range(n)]
        self._answers: list[queue.Queue] = []
        try:
            for i in range(n):
                cmd = [python, "-m", "gyre_slurm.train.rankproc", "--backend", "megatron",
                       "--model-dir", str(model_dir), "--node-index", str(i)]
                for key, value in worker_kwargs.items():
                    cmd += [f"--{key.replace('_', '-')}", str(value)]
                with open(self.logs[i], "w") as log:
                    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, text=True, cwd=ROOT, env=env)
                self.procs.append(proc)
                q: queue.Queue = queue.Queue()
                threading.Thread(target=self._pump, args=(proc, q), daemon=True).start()
                self._answers.append(q)
            deadline = time.monotonic() + start_timeout_s
            self.pids = [self._recv(i, deadline)["pid"] for i in range(n)]
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _pump(proc: subprocess.Popen, q: queue.Queue) -> None:
        for line in proc.stdout:
            q.put(json.loads(line))
        q.put(None)

    def __enter__(self) -> MegatronProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tail(self, i: int) -> str:
        try:
            return "\n".join(self.logs[i].read_text().splitlines()[-40:])
        except OSError:
            return ""

    def _recv(self, i: int, deadline: float) -> Any:
        try:
            msg = self._answers[i].get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"megatron process {i} did not answer in time; log tail:\n"
                               f"{self._tail(i)}") from None
        if msg is None:
            raise DriverError(f"megatron process {i} exited ({self.procs[i].poll()}); "
                              f"log tail:\n{self._tail(i)}")
        if "error" in msg:
            raise DriverError(f"megatron process {i} failed: {msg['error']}\n"
                              f"{msg.get('traceback', '')}")
        return msg.get("result")

    def call(self, calls: dict[int, tuple[str, dict[str, Any]]], *,
             timeout_s: float = 120.0) -> dict[int, Any]:
        """Run `{process: (method, kwargs)}` concurrently; results by process."""
        for i, (method, kw) in calls.items():
            self.procs[i].stdin.write(json.dumps({"id": 1, "method": method, "args": kw},
                                                 default=str) + "\n")
            self.procs[i].stdin.flush()
        deadline = time.monotonic() + timeout_s
        results, errors = {}, []
        for i in calls:  # read every answer, so that none is left for the next call
            try:
                results[i] = self._recv(i, deadline)
            except DriverError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return results

    def close(self, *, timeout_s: float = 10.0) -> None:
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        self.procs = []

"""Local worker processes, each holding one `TrainerWorker`, driven by commands.

Used by the tests, the handoff benchmark and the embedded (no-Slurm) launcher, where
"nodes" are local processes. Protocol over one `multiprocessing` pipe per process
(spawn context): the parent sends `(method, kwargs)`; the child calls the worker's
method (or one of `EXTRA_OPS`) and answers `("ok", result)` or `("error", traceback)`;
`None` asks the child to exit. Commands to several workers are sent first and answered
after, since collectives block until every member arrives.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Mapping
from typing import Any

def _all_reduce_sum(worker, *, value: float) -> float:
    from gyre_slurm.train import dist as gdist

    return gdist.all_reduce_sum(value)


def _broadcast_text(worker, *, text: str | None, src: int) -> str | None:
    from gyre_slurm.train import dist as gdist

    return gdist.broadcast_text(text, src=src)


def _gather_bytes(worker, *, payload: bytes, dst: int) -> list[bytes] | None:
    from gyre_slurm.train import dist as gdist

    return gdist.gather_bytes(payload, dst=dst)


EXTRA_OPS = {"all_reduce_sum": _all_reduce_sum, "broadcast_text": _broadcast_text,
             "gather_bytes": _gather_bytes}


def _serve(conn, kwargs: dict[str, Any], num_threads: int) -> None:
    import torch

    from gyre_slurm.train.worker import TrainerWorker

    torch.set_num_threads(num_threads)
    worker = TrainerWorker(**kwargs)
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, kw = msg
        try:
            fn = EXTRA_OPS.get(method)
            result = fn(worker, **kw) if fn else getattr(worker, method)(**kw)
            conn.send(("ok", result))
        except Exception:  # noqa: BLE001 - the parent re-raises it
            conn.send(("error", traceback.format_exc()))
    conn.close()


class WorkerError(RuntimeError):
    """A command failed in a worker process (the message holds its traceback)."""


class WorkerProcesses:
    """`n` local processes, worker i with node_index i; close() (or `with`) ends them."""

    def __init__(self, n: int, *, num_threads: int = 1, start_timeout_s: float = 120.0,
                 **worker_kwargs: Any):
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, daemon=True,
                                   args=(child, dict(worker_kwargs, node_index=i), num_threads))
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self.pids = [self._recv(i, time.monotonic() + start_timeout_s) for i in range(n)]
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._procs)

    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _recv(self, i: int, deadline: float) -> Any:
        if not self._conns[i].poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"worker {i} did not answer in time")
        try:
            status, value = self._conns[i].recv()
        except EOFError:
            raise WorkerError(f"worker {i} exited (code {self._procs[i].exitcode})") from None
        if status == "error":
            raise WorkerError(f"worker {i} failed:\n{value}")
        return value

    def call(self, calls: Mapping[int, tuple[str, dict[str, Any]]], *,
             timeout_s: float = 120.0) -> dict[int, Any]:
        """Run `{worker: (method, kwargs)}` concurrently; results by worker."""
        for i, (method, kw) in calls.items():
            self._conns[i].send((method, kw))
        deadline = time.monotonic() + timeout_s
        return {i: self._recv(i, deadline) for i in calls}

    def call_all(self, method: str, *, timeout_s: float = 120.0, **kw: Any) -> dict[int, Any]:
        return self.call({i: (method, kw) for i in range(len(self))}, timeout_s=timeout_s)

    def close(self, *, timeout_s: float = 5.0) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

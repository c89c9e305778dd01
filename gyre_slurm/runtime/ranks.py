"""The training ranks of one node, run as processes of their own (`train.rankproc`).

The node agent holds one `RankProcesses` when its trainer cannot live inside it (see
`train.rankproc`). `call(method, args)` sends one request to every local rank and waits
for all answers: collectives span the ranks, so they must be in flight together. A rank
that answers an error, exits, or says nothing valid fails the call with its log's tail.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # importing Megatron, building a model: minutes on a busy node
LINE_LIMIT = 64 << 20


class RankError(RuntimeError):
    pass


class RankProcesses:
    def __init__(self, *, commands: list[list[str]], envs: list[dict], log_paths: list[Path]):
        self.commands, self.envs, self.log_paths = commands, envs, log_paths
        self.procs: list[asyncio.subprocess.Process] = []
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self.commands)

    def _tail(self, i: int, num_bytes: int = 3000) -> str:
        try:
            return self.log_paths[i].read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    async def start(self) -> None:
        for cmd, env, log_path in zip(self.commands, self.envs, self.log_paths):
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=log_file, env=env, limit=LINE_LIMIT)
            self.procs.append(proc)
            log.info("started training rank pid %d (log %s)", proc.pid, log_path)
        await asyncio.gather(*(self._read(i, None, READY_TIMEOUT_S)
                               for i in range(len(self.procs))))

    async def _read(self, i: int, rid: int | None, timeout_s: float | None) -> dict:
        proc = self.procs[i]
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        except asyncio.TimeoutError as exc:
            raise RankError(f"training rank pid {proc.pid} silent for {timeout_s:.0f} s; "
                            f"log {self.log_paths[i]}:\n{self._tail(i)}") from exc
        if not line:
            code = await proc.wait()
            raise RankError(f"training rank pid {proc.pid} exited with code {code}; "
                            f"log {self.log_paths[i]}:\n{self._tail(i)}")
        try:
            answer = json.loads(line)
        except ValueError as exc:
            raise RankError(f"training rank pid {proc.pid} wrote {line[:200]!r}, not an "
                            f"answer; log {self.log_paths[i]}") from exc
        if rid is not None and answer.get("id") != rid:
            raise RankError(f"training rank pid {proc.pid} answered request "
                            f"{answer.get('id')}, expected {rid}")
        if "error" in answer:
            raise RankError(f"training rank pid {proc.pid}: {answer['error']}\n"
                            f"{answer.get('traceback', '')[-2000:]}")
        return answer.get("result") or {}

    async def call(self, method: str, args: list[dict], *,
                   timeout_s: float | None = None) -> list[dict]:
        """One request per local rank (`args[i]` for rank i), answers in rank order."""
        if len(args) != len(self.procs):
            raise ValueError(f"{len(args)} argument sets for {len(self.procs)} ranks")
        async with self._lock:
            rid = next(self._ids)
            for proc, a in zip(self.procs, args):
                if proc.returncode is not None:
                    raise RankError(f"training rank pid {proc.pid} has exited "
                                    f"(code {proc.returncode})")
                proc.stdin.write((json.dumps({"id": rid, "method": method, "args": a})
                                  + "\n").encode())
            await asyncio.gather(*(p.stdin.drain() for p in self.procs))
            return list(await asyncio.gather(*(self._read(i, rid, timeout_s)
                                               for i in range(len(self.procs)))))

    async def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs:
            if proc.returncode is None and proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("training rank pid %d did not exit: killing", proc.pid)
                proc.kill()
                await proc.wait()


def rank_envs(count: int, *, gpus: int, base: dict | None = None) -> list[dict]:
    """One environment per local rank: its GPU (from the step's CUDA_VISIBLE_DEVICES, or
    the node's GPU index) and one OpenMP thread on CPU."""
    base = dict(os.environ if base is None else base)
    visible = [d for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    envs = []
    for i in range(count):
        env = dict(base, PYTHONUNBUFFERED="1")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = visible[i] if i < len(visible) else str(i)
        else:
            env.setdefault("OMP_NUM_THREADS", "1")
        envs.append(env)
    return envs

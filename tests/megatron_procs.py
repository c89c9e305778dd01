"""Test helper: N processes of the megatron environment, each a `MegatronWorker` behind
`python -m gyre_slurm.train.rankproc --backend megatron` (the node agent's rank
process), driven from the core environment."""

from __future__ import annotations

import dataclasses
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


class Cluster:
    """A test's coordinator over driver processes (`MegatronProcesses`) of one model:
    `world(members, ...)` joins them to a new generation of the store at `port`."""

    def __init__(self, procs: MegatronProcesses, *, host: str, port: int, gens, model_dir,
                 weights, family: str = "", call_timeout_s: float = 180.0):
        self.p, self.host, self.port, self.gens = procs, host, port, gens
        self.family, self.model_dir, self.weights = family, model_dir, weights
        self.call_timeout_s = call_timeout_s
        self.timings: dict[str, list[float]] = {}

    def on(self, members, method, **kw):
        t0 = time.perf_counter()
        out = self.p.call({m: (method, kw) for m in members}, timeout_s=self.call_timeout_s)
        self.timings.setdefault(method, []).append(time.perf_counter() - t0)
        return out

    def world(self, members, tp=None, pp=None, **kw):
        """Every member joins a new generation (layout changes in `tp`, `pp` and `kw`:
        expert_parallel, precision, ...); returns join timings by member."""
        from gyre_slurm.train.dist import WorldSpec

        spec = dataclasses.asdict(WorldSpec(next(self.gens), len(members), self.host,
                                            self.port))
        layout = {k: v for k, v in (("tensor_parallel", tp), ("pipeline_parallel", pp))
                  if v is not None}
        t0 = time.perf_counter()
        out = self.p.call({m: ("join", dict(spec=spec, rank=r, src_rank=0, **layout, **kw))
                           for r, m in enumerate(members)}, timeout_s=self.call_timeout_s)
        self.timings.setdefault("rebuild", []).append(time.perf_counter() - t0)
        return out

    def one(self, members, method, **kw):
        """A call whose result must be the same on every member."""
        out = self.on(members, method, **kw)
        values = list(out.values())
        assert all(v == values[0] for v in values), out
        return values[0]


# ---- tiny models of every family, and one set of processes per family -------------------

VOCAB = 300  # not a multiple of 128: Megatron pads the vocabulary, the export cuts it
MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def make_test_model(root: Path, family: str, *, seed: int, tied: bool = False):
    """(model_dir, weights_dir, transformers model) of a tiny `family` model: 2 layers, 4
    heads of 16, 2 KV heads (GQA); qwen3_moe: 8 experts of 32, top-2. Norms and biases
    are perturbed so that a mix-up shows, and the router is sharpened so that float
    noise between engines never flips a token's top-2 experts. `tied`: with
    tie_word_embeddings (its checkpoint without lm_head.weight)."""
    import json

    import torch

    from gyre_slurm.models import tiny

    key = f"{family}_tied" if tied else family
    model_dir = tiny.make_model_dir(root / key, family=family, vocab_size=VOCAB,
                                    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                    max_positions=128, num_experts=8, experts_per_token=2)
    if tied:
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config,
                                                           "tie_word_embeddings": True}))
    model = tiny.new_model(model_dir, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):
                p.mul_(40.0)
    return model_dir, tiny.save_weights(model, root / f"{key}-w0"), model


class ClusterPool:
    """`get(family)`: a `Cluster` of `n` processes for that family's model, one family
    alive at a time (starting 4 Megatron processes takes ~10 s on 2 cores)."""

    def __init__(self, *, models: dict, python: str, log_root: Path, host: str, port: int,
                 gens, n: int = 4, call_timeout_s: float = 180.0, **worker_kwargs):
        self.models, self.python, self.log_root = models, python, Path(log_root)
        self.host, self.port, self.gens, self.n = host, port, gens, n
        self.call_timeout_s, self.worker_kwargs = call_timeout_s, worker_kwargs
        self.alive: dict[str, Cluster] = {}

    def get(self, family: str) -> Cluster:
        if family not in self.alive:
            self.close()
            model_dir, weights, _ = self.models[family]
            log_dir = self.log_root / f"logs-{family}"
            log_dir.mkdir(parents=True, exist_ok=True)
            procs = MegatronProcesses(self.n, python=self.python, model_dir=model_dir,
                                      log_dir=log_dir, **self.worker_kwargs)
            self.alive[family] = Cluster(procs, host=self.host, port=self.port,
                                         gens=self.gens, model_dir=model_dir, weights=weights,
                                         family=family, call_timeout_s=self.call_timeout_s)
        return self.alive[family]

    def close(self) -> None:
        for family in list(self.alive):
            self.alive.pop(family).p.close()

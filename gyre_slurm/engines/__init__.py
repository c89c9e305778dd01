"""Rollout engines: the interface the rest of gyre uses to run inference servers.

The interface is a launcher plus an async client; `embedded` (the tiny local model,
`gyre_slurm.models.tiny`) implements it today, a vLLM adapter will implement the same
HTTP protocol later.

Start (blocking; from an event loop use `await asyncio.to_thread(start_engine, ...)`):

    secret = write_secret(run_dir / "engine.secret")          # 0600 file
    proc = start_engine(model_dir=..., host="127.0.10.1",
                        weights_dir=tiny.weights_dir(run_dir, 0), version=0,
                        secret_file=run_dir / "engine.secret", log_path=...)
    client = EngineClient(proc.base_url, secret)

Health:     `await wait_healthy(client, timeout_s=60, process=proc)`;
            `await client.health()` -> {"status": "ok"|"released", "policy_version",
            "active"}.
Generate:   `await client.generate(prompt_ids, max_tokens=N, temperature=1.0,
            stop_token_ids=[...], seed=None)` -> {"output_ids", "output_logprobs",
            "finish_reason": "stop"|"length", "policy_version"}; output_logprobs[i] is the
            sampling log-probability of output_ids[i] (temperature applied; T=0 is greedy
            and reports T=1 log-probabilities); a stop token ends the output and is
            included in it.
Load:       `await client.load_weights(weights_dir, version)`: in place, after the
            generations in flight (which finish under, and report, the old version).
Release:    `await client.release()` frees the model (generate answers 503, health says
            "released"); `await client.resume(weights_dir, version)` loads it again.
Stop:       `await client.close()`; `proc.stop(timeout_s)` (SIGTERM, then SIGKILL).

Failures raise `EngineError` (`.status`: HTTP status, 0 when unreachable).
"""

from gyre_slurm.engines.client import EngineClient, EngineError
from gyre_slurm.engines.launcher import (
    EngineProcess, engine_command, start_engine, wait_healthy, write_secret,
)

__all__ = ["EngineClient", "EngineError", "EngineProcess", "engine_command", "make_client",
           "start_engine", "wait_healthy", "write_secret"]


def make_client(kind: str, base_url: str, secret: str, *, release_mode: str = "pause"):
    """The client of an engine of `kind` ("embedded" or "vllm"): one interface. Both
    engines know their own policy version (vLLM through its weight-version label)."""
    if kind == "vllm":
        from gyre_slurm.engines.vllm_client import VllmClient

        return VllmClient(base_url, secret, sleep_mode=release_mode == "sleep")
    if kind != "embedded":
        raise ValueError(f"unknown engine kind {kind!r}")
    return EngineClient(base_url, secret)

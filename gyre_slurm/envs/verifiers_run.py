"""One run of a verifiers environment against a gyre run's gateway URL.

Runs in the verifiers role environment (`tools/role-env verifiers`), not in gyre's: it
imports only the standard library and verifiers, and is started by path by
`gyre_slurm.envs.verifiers_env` (one process per run):

    OPENAI_API_KEY=<the run's key> python verifiers_run.py --environment ID \\
        [--env-args JSON] --example K --base-url URL/runs/<run_id>/v1 --model NAME \\
        [--max-tokens N] [--temperature T] --results-fd FD

It loads the environment (`verifiers.load_environment(ID, **args)`: an installed
environment package, or a module on PYTHONPATH with `load_environment`), takes example
K of its training dataset (K modulo its size; the eval dataset when it has no training
set), runs one rollout with the environment's own loop (`env.run_rollout`: multi-turn,
its `env_response`, tools and stop conditions; every model call goes to the run's URL
with the run's key, so the gateway records it as this run's calls) and scores it with
the environment's rubric. It writes one JSON object to FD (never to stdout, which is
the environment's log): {"reward", "metrics" (the rubric's, num_turns included),
"example_id", "stop_condition", "is_truncated", "error", "policy_error"}. An error that
is the policy's own doing (an empty or unparsable answer, a malformed tool call: what
the model wrote, `POLICY_ERRORS`) ends the rollout as verifiers does, and the rubric's
score stands: the run is trained with it; any other error (the environment raised, a
model call failed) fails the run. An environment whose rubric scores a whole group at
once (group rewards) is refused: gyre's runs end one by one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

# verifiers' errors that say what the model wrote, not that something broke
POLICY_ERRORS = ("InvalidModelResponseError", "EmptyModelResponseError", "ToolParseError")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--environment", required=True)
    p.add_argument("--env-args", default="{}")
    p.add_argument("--example", type=int, required=True)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--results-fd", type=int, required=True)
    return p.parse_args(argv)


def pick_example(env, k: int) -> dict:
    """Row k (modulo the dataset's size) of the environment's dataset, as a rollout input."""
    try:
        dataset = env.get_dataset()
    except ValueError:  # no training set: the eval set
        dataset = env.get_eval_dataset()
    if len(dataset) == 0:
        raise ValueError("the environment's dataset is empty")
    index = k % len(dataset)
    row = dict(dataset[index])
    row.setdefault("example_id", index)
    return row


async def one_rollout(args: argparse.Namespace) -> dict:
    import verifiers as vf
    from verifiers.types import ClientConfig

    env = vf.load_environment(args.environment, **json.loads(args.env_args))
    if env.requires_group_rollouts:
        raise ValueError(f"environment {args.environment!r} scores whole groups (group "
                         "rewards); gyre scores each run as it ends: use a per-rollout rubric")
    row = pick_example(env, args.example)
    sampling = {k: v for k, v in dict(env.sampling_args).items() if v not in ({}, None)}
    if args.max_tokens is not None:
        sampling["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    client = ClientConfig(api_key_var="OPENAI_API_KEY", api_base_url=args.base_url,
                          max_retries=0)
    out = await env.run_rollout(row, client, args.model, sampling)
    reward = float(out.get("reward") or 0.0)
    error = out.get("error")
    kind = error.get("error") if isinstance(error, dict) else None
    if isinstance(error, dict):
        error = f"{kind}: {error.get('message')}"
    # a NaN or infinite score goes back as it is (JSON's NaN, Infinity): the parent
    # fails the run on it (envs.base.run_reward) rather than training a made-up 0
    return {"reward": reward,
            "metrics": {k: float(v) for k, v in (out.get("metrics") or {}).items()
                        if isinstance(v, (int, float))},
            "example_id": row["example_id"],
            "stop_condition": out.get("stop_condition"),
            "is_truncated": bool(out.get("is_truncated")),
            "error": None if error is None else str(error),
            "policy_error": kind in POLICY_ERRORS}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with os.fdopen(args.results_fd, "w") as results:
        try:
            result = asyncio.run(one_rollout(args))
        except Exception as exc:  # noqa: BLE001 - reported to gyre as the run's error
            result = {"reward": 0.0, "error": f"{type(exc).__name__}: {exc}"[:2000],
                      "failed": True}
        results.write(json.dumps(result))
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())

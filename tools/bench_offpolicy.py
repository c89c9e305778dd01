#!/usr/bin/env python3
"""Measurement (figures, not a test): the off-policy losses on the learnable task with
stale trajectories and a visibly mismatched sampler.

    tools/gyre-env python tools/bench_offpolicy.py [--steps 16] [--temperature 0.5]
        [--losses ppo_clip,tis,masked_is,decoupled,gspo] [--seed 0] [--out DIR]
        [--plot OUT.png] [--report DIR]

Runs `gyre run configs/tiny.yaml` (4 virtual nodes, the tiny model, the `learnable`
task with two turns, so that a run's calls can be served by different policy
versions) once per loss, with `training.max_staleness` 4 and the rollout servers
sampling at `--temperature` while the trainer scores at temperature 1: the recorded
sampling logprobs are those of the tempered distribution, a sampler/trainer mismatch
of known size. One more run, ppo_clip at temperature 1, is the no-noise reference.
Every run has the same config and seed but its loss (the tasks per step are the same;
the samples differ as soon as the policies do).

Prints, from each run dir's metrics.jsonl: (1) the mismatch of the reference and of the
noisy uncorrected run, per policy lag, which shows the noise; (2) per step, each loss's
mean reward and mean |logp trainer - logp sampler| side by side; (3) per loss, the
reward of the first and last steps, the mismatch, the k3 KL, the share of tokens
clipped / truncated / dropped, the lag histogram and how many runs spanned versions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gyre_slurm.common.fsio import read_jsonl  # noqa: E402
from gyre_slurm.runtime.metrics import read_metrics  # noqa: E402
from gyre_slurm.train.loss import LOSS_NAMES  # noqa: E402

BASE = ["training.max_staleness=4", "workload.prompts_per_step=4", "workload.group_size=8",
        "agent.max_turns=2",
        "agent.env_params={turns: 2, tool_mean_s: 1.0, tool_sigma: 1.0, tool_max_s: 8.0}"]


def run(run_dir: Path, sets: list[str], *, timeout_s: float) -> float:
    args = [sys.executable, "-m", "gyre_slurm", "run", str(ROOT / "configs" / "tiny.yaml"),
            "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    t0 = time.monotonic()
    proc = subprocess.run(args, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name}: gyre run failed:\n{proc.stderr[-3000:]}")
    return time.monotonic() - t0


def mean_of(lines: list[dict], key: str, steps=None) -> float | None:
    vals = [m[key] for m in lines[steps or slice(None)] if m.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def fmt(x, spec=".3f") -> str:
    return "  -  " if x is None else format(x, spec)


def lag_tokens(lines: list[dict]) -> Counter:
    hist: Counter = Counter()
    for m in lines:
        hist.update({int(k): v for k, v in (m.get("staleness/lag_hist") or {}).items()})
    return hist


def by_lag(lines: list[dict], what: str) -> dict[int, float]:
    """Token-weighted mean over the run of mismatch/lag<L>/<what>, per lag L."""
    num, den = Counter(), Counter()
    for m in lines:
        for key, value in m.items():
            if key.startswith("mismatch/lag") and key.endswith(f"/{what}") and value is not None:
                lag = int(key.split("/")[1][3:])
                n = m.get(f"mismatch/lag{lag}/tokens", 0)
                num[lag] += value * n
                den[lag] += n
    return {lag: num[lag] / den[lag] for lag in sorted(den) if den[lag]}


def print_noise(runs: dict[str, list[dict]], reference: str, noisy: str, temp: float) -> None:
    print("\n(1) the sampler noise, seen: mean |logp trainer - logp sampler| and KL (k3) per "
          "token, by policy lag (token-weighted over the run)")
    for name, label in ((reference, "sampler at temperature 1.0 (reference)"),
                        (noisy, f"sampler at temperature {temp:g}")):
        abs_lag, k3_lag = by_lag(runs[name], "abs_mean"), by_lag(runs[name], "kl_k3")
        lags = ", ".join(f"lag {k}: {abs_lag[k]:.4f} / {k3_lag.get(k, 0):.5f}" for k in abs_lag)
        print(f"  {label:40s} all: {fmt(mean_of(runs[name], 'mismatch/abs_mean'), '.4f')} / "
              f"{fmt(mean_of(runs[name], 'mismatch/kl_k3'), '.5f')}; {lags}")


def print_side_by_side(runs: dict[str, list[dict]], names: list[str]) -> None:
    print("\n(2) per step: mean reward | mean |logp trainer - sampler|")
    print("step " + "".join(f"{n:>19s}" for n in names))
    steps = max(len(runs[n]) for n in names)
    for i in range(steps):
        row = []
        for n in names:
            m = runs[n][i] if i < len(runs[n]) else {}
            row.append(f"{fmt(m.get('reward/mean'))} | {fmt(m.get('mismatch/abs_mean'))}")
        print(f"{i:4d} " + "".join(f"{r:>19s}" for r in row))


def print_summary(runs: dict[str, list[dict]], names: list[str], walls: dict) -> None:
    print("\n(3) per run: reward first 3 / last 3 steps (rise), mismatch, KL k3, clipped / "
          "truncated / dropped share, tokens by lag, runs spanning versions, wall time")
    for n in names:
        lines = runs[n]
        first, last = mean_of(lines, "reward/mean", slice(0, 3)), \
            mean_of(lines, "reward/mean", slice(-3, None))
        rise = None if first is None or last is None else last - first
        lags = lag_tokens(lines)
        total = sum(lags.values()) or 1
        print(f"  {n:18s} reward {fmt(first)} -> {fmt(last)} ({fmt(rise, '+.3f')}); "
              f"|d| {fmt(mean_of(lines, 'mismatch/abs_mean'), '.4f')}, "
              f"k3 {fmt(mean_of(lines, 'mismatch/kl_k3'), '.5f')}; "
              f"clip {fmt(mean_of(lines, 'train/clip_frac'), '.1%')}, "
              f"trunc {fmt(mean_of(lines, 'train/is_truncated_frac'), '.1%')}, "
              f"drop {fmt(mean_of(lines, 'train/is_dropped_frac'), '.1%')}; lag "
              + " ".join(f"{k}:{v / total:.0%}" for k, v in sorted(lags.items()))
              + f"; multi-version runs {fmt(mean_of(lines, 'staleness/multi_version_run_frac'), '.0%')}"
              f"; {walls[n]:.0f} s")


def plot(runs: dict[str, list[dict]], names: list[str], out: Path, title: str) -> None:
    """Reward and mismatch per step, one line per run, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n in names:
        steps = [m["step"] for m in runs[n]]
        style = {"color": "black", "ls": "--"} if n == "reference" else {}
        left.plot(steps, [m.get("reward/mean") for m in runs[n]], label=n, **style)
        right.plot(steps, [m.get("mismatch/abs_mean") for m in runs[n]], label=n, **style)
    left.set(xlabel="step", ylabel="mean reward", title="reward per step")
    right.set(xlabel="step", ylabel="mean |logp trainer - logp sampler|",
              title="mismatch on trained tokens per step")
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--losses", default=",".join(LOSS_NAMES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="keep the run dirs here")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--plot", type=Path, default=None, help="also draw the curves (PNG)")
    p.add_argument("--report", type=Path, default=None,
                   help="print (and plot) the run dirs of an earlier --out DIR, run nothing")
    args = p.parse_args()
    losses = [x for x in args.losses.split(",") if x]
    unknown = set(losses) - set(LOSS_NAMES)
    if unknown:
        p.error(f"unknown loss(es) {sorted(unknown)}; choose from {', '.join(LOSS_NAMES)}")
    out = args.report or args.out or Path(tempfile.mkdtemp(prefix="gyre-offpolicy-"))
    common = BASE + [f"workload.num_steps={args.steps}", f"seed={args.seed}"]
    plan = {"reference": common + ["agent.temperature=1.0"]}
    plan.update({loss: common + [f"agent.temperature={args.temperature}",
                                 f"loss.kind={loss}"] for loss in losses})
    runs, walls = {}, {}
    for name, sets in plan.items():
        if args.report is None:
            walls[name] = run(out / name, sets, timeout_s=args.timeout_s)
        else:  # the run dirs of an earlier measurement
            walls[name] = next((e["wall_s"] for e in read_jsonl(out / name / "events.jsonl")
                                if e["kind"] == "finish"), float("nan"))
        runs[name] = read_metrics(out / name)
        print(f"{name}: {len(runs[name])} steps in {walls[name]:.0f} s ({out / name})",
              flush=True)
    print(f"\nlearnable task, tiny model, {args.steps} steps x 32 runs (4 prompts x 8), two "
          f"turns, training.max_staleness 4, seed {args.seed}; sampler temperature "
          f"{args.temperature:g} against a temperature-1 fp32 trainer")
    noisy = "ppo_clip" if "ppo_clip" in runs else losses[0]
    print_noise(runs, "reference", noisy, args.temperature)
    names = ["reference"] + losses
    print_side_by_side(runs, names)
    print_summary(runs, names, walls)
    if args.plot:
        plot(runs, names, args.plot, f"learnable task, max_staleness 4, sampler temperature "
             f"{args.temperature:g} (reference: 1.0), seed {args.seed}")
        print(f"\ncurves: {args.plot}")
    return 0


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)

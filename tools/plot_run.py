#!/usr/bin/env python3
"""Draw a run's reward curve and cell-role timeline from its events.jsonl (`gyre report`
draws more: this stays for the figure of docs/runtime.md).

    tools/gyre-env python tools/plot_run.py RUN_DIR OUT.png [--chance 0.198]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gyre_slurm.common.fsio import read_jsonl  # noqa: E402
from gyre_slurm.monitor.model import role_segments  # noqa: E402
from gyre_slurm.sim.report import ROLE_COLORS  # noqa: E402


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--chance", type=float, default=None, help="draw the chance level")
    args = p.parse_args()
    events = list(read_jsonl(args.run_dir / "events.jsonl"))
    steps = [e for e in events if e["kind"] == "step"]
    segs, wall = role_segments(events)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), gridspec_kw={"height_ratios": [3, 2]})
    ax1.plot([e["step"] for e in steps], [e["mean_reward"] for e in steps], marker="o", ms=3)
    if args.chance is not None:
        ax1.axhline(args.chance, ls="--", color="grey", label=f"chance {args.chance}")
        ax1.legend(loc="upper left")
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean reward")
    ax1.set_title(f"{args.run_dir.name}: reward per step")
    for cell, t0, t1, label in segs:
        ax2.broken_barh([(t0, max(t1 - t0, 0.05))], (cell - 0.4, 0.8),
                        facecolors=ROLE_COLORS.get(label, "#7f7f7f"))
    ax2.set_yticks(sorted({s[0] for s in segs}))
    ax2.invert_yaxis()
    ax2.set_xlim(0, wall)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("cell")
    handoffs = sum(1 for e in events if e["kind"] == "handoff")
    ax2.set_title(f"cell roles (green rollout, blue train, orange/light draining, purple loading): {handoffs} handoffs")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)

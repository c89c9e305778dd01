"""`gyre report`: one PNG of a whole run, from its events.jsonl and status.json.

Panels: (1) cell roles over time (seconds since `start`; segments from
`model.role_segments`, colours of gyre_slurm/sim/report.py ROLE_COLORS); (2) waterlevel
(status.json waterlevel_history: runs in flight + queued over the runs a cell serves,
rollout.runs_per_node x cluster.cell_nodes: demand in cells) with the rollout-cell count;
(3) mean reward per step with the mean spread within a group as a band (`step` events'
training signals, `model.step_metrics`); (4) throughput per step: trajectories/s and
tokens/s over the time since the previous step (`model.step_rates`); (5) trainer/sampler
mismatch per step (mean |logp difference|, overall and per policy lag, and the k3 KL
estimate); (6) entropy of the trained tokens and gradient norm; (7) the share of the
trained tokens the loss clipped, truncated or dropped.
"""

from __future__ import annotations

from pathlib import Path

from gyre_slurm.errors import UserError
from gyre_slurm.monitor import model
from gyre_slurm.sim.report import ROLE_COLORS, save_figure


def draw_roles(ax, events: list[dict]) -> float:
    segs, wall = model.role_segments(events)
    for cell, t0, t1, label in segs:
        ax.broken_barh([(t0, max(t1 - t0, 0.05))], (cell - 0.4, 0.8),
                       facecolors=ROLE_COLORS.get(label, "#7f7f7f"))
    ax.set_yticks(sorted({s[0] for s in segs}))
    ax.invert_yaxis()
    ax.set_xlim(0, max(wall, 1e-3))
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("cell")
    handoffs = sum(1 for e in events if e["kind"] == "handoff")
    ax.set_title(f"cell roles (green rollout, blue train, orange/light draining, purple "
                 f"loading): {handoffs} handoffs")
    return wall


def draw_waterlevel(ax, snap: model.Snapshot, *, span_s: float) -> None:
    hist = (snap.status or {}).get("waterlevel_history", [])
    shift = (snap.coord_t0 or 0.0) - (snap.start_t or snap.coord_t0 or 0.0)
    ts = [w["t"] + shift for w in hist]  # samples count from t0; the timeline from start
    ax.plot(ts, [w.get("waterlevel", 0.0) for w in hist], color="#ff7f0e", label="waterlevel")
    ax.step(ts, [w.get("rollout_cells", 0) for w in hist], where="post", color="#2ca02c",
            alpha=0.6, label="rollout cells")
    ax.set_xlabel("seconds since start (status.json keeps the last 300 samples)")
    ax.set_ylabel("cells")
    ax.set_title("waterlevel: runs in flight + queued, in cells' worth of runs; "
                 "and rollout cells")
    if hist:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlim(0, max(span_s, 1e-3))


def _series(steps: list[dict], key: str) -> tuple[list, list]:
    pts = [(m["step"], m[key]) for m in steps if m.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def draw_rewards(ax, events: list[dict]) -> None:
    metrics = model.step_metrics(events)
    if metrics:  # mean reward, and the mean spread within a group as a band
        xs, mean = _series(metrics, "reward/mean")
        spread = dict(zip(*_series(metrics, "reward/group_std_mean")))
        ax.plot(xs, mean, marker="o", ms=3, label="mean reward")
        ax.fill_between(xs, [m - spread.get(x, 0.0) for x, m in zip(xs, mean)],
                        [m + spread.get(x, 0.0) for x, m in zip(xs, mean)], alpha=0.2,
                        label="± spread within a group")
        ax.legend(loc="lower right", fontsize=8)
    else:  # run dirs from before the training signals
        steps = [e for e in events if e["kind"] == "step"]
        ax.plot([e["step"] for e in steps], [e.get("mean_reward", 0) for e in steps],
                marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("mean reward per step")


def draw_mismatch(ax, events: list[dict]) -> None:
    """Mean |logp trainer - logp sampler| per step, overall and per policy lag; the k3
    KL estimate on the right axis."""
    metrics = model.step_metrics(events)
    lags = sorted({k.split("/")[1] for m in metrics for k in m
                   if k.startswith("mismatch/lag") and k.endswith("/abs_mean")},
                  key=lambda lag: int(lag[3:]))
    ax.plot(*_series(metrics, "mismatch/abs_mean"), color="black", marker="o", ms=3,
            label="all tokens")
    for lag in lags:
        ax.plot(*_series(metrics, f"mismatch/{lag}/abs_mean"), marker=".", ms=3, alpha=0.8,
                label=f"lag {lag[3:]}")
    ax.set_xlabel("step")
    ax.set_ylabel("mean |logp trainer - sampler|", fontsize=9)
    ax2 = ax.twinx()
    ax2.plot(*_series(metrics, "mismatch/kl_k3"), color="#d62728", ls="--", label="KL k3")
    ax2.set_ylabel("KL k3", color="#d62728")
    if metrics:
        ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax.set_title("trainer/sampler mismatch on trained tokens, by policy lag;\nKL(sampler || "
                 "trainer) k3 dashed", fontsize=10)


def draw_training(ax, events: list[dict]) -> None:
    """Entropy of the trained tokens; the gradient norm on the right."""
    metrics = model.step_metrics(events)
    ax.plot(*_series(metrics, "train/entropy"), marker="o", ms=3, label="entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("entropy (nats)")
    ax2 = ax.twinx()
    ax2.plot(*_series(metrics, "train/grad_norm"), color="#9467bd", ls="--")
    ax2.set_ylabel("grad norm", color="#9467bd")
    ax.set_title("entropy of trained tokens; grad norm", fontsize=10)


def draw_corrections(ax, events: list[dict]) -> None:
    """Share of the trained tokens the loss clipped, truncated or dropped."""
    metrics = model.step_metrics(events)
    for key, label in (("train/clip_frac", "clipped (zero gradient)"),
                       ("train/is_truncated_frac", "weight truncated at the cap"),
                       ("train/is_dropped_frac", "dropped (out of the band)")):
        ax.plot(*_series(metrics, key), marker=".", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("share of trained tokens")
    if metrics:
        ax.legend(loc="upper left", fontsize=7)
    ax.set_title("what the loss clipped, truncated, dropped", fontsize=10)


def draw_throughput(ax, events: list[dict]) -> None:
    rates = model.step_rates(events)
    xs = [r["step"] for r in rates]
    ax.bar(xs, [r["tokens_per_s"] for r in rates], color="#1f77b4", alpha=0.7,
           label="tokens/s")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["trajectories_per_s"] for r in rates], color="#2ca02c", marker="o",
             ms=3, label="trajectories/s")
    ax2.set_ylabel("trajectories/s")
    ax.set_title("throughput per step (wall time since the previous step;\n"
                 "streamed steps can finish in bursts)", fontsize=10)


def figure(run_dir: Path):
    """The report's matplotlib figure of a run dir (close it with plt.close)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    snap = model.load(run_dir)
    kinds = {e["kind"] for e in snap.events}
    if not {"start", "layout"} <= kinds:
        raise UserError(f"{run_dir / 'events.jsonl'} has no start/layout events yet "
                        "(nothing to report: has the run started?)")
    fig = plt.figure(figsize=(15, 13))
    grid = fig.add_gridspec(4, 2, height_ratios=[3, 2, 2, 2])
    wall = draw_roles(fig.add_subplot(grid[0, :]), snap.events)
    draw_waterlevel(fig.add_subplot(grid[1, :]), snap, span_s=wall)
    draw_rewards(fig.add_subplot(grid[2, 0]), snap.events)
    draw_throughput(fig.add_subplot(grid[2, 1]), snap.events)
    last = grid[3, :].subgridspec(1, 3, width_ratios=[4, 3, 3], wspace=0.55)
    draw_mismatch(fig.add_subplot(last[0]), snap.events)
    draw_training(fig.add_subplot(last[1]), snap.events)
    draw_corrections(fig.add_subplot(last[2]), snap.events)
    fig.suptitle(f"{run_dir.name}: policy {(snap.status or {}).get('policy', '?')}")
    fig.tight_layout()
    return fig


def write_report(run_dir: Path, out: Path) -> None:
    save_figure(figure(run_dir), out, dpi=100)

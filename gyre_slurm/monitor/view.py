"""The `gyre status` frame: one rich renderable built from a `model.Snapshot`.

Sections, top to bottom: header (run dir, policy, version/num_steps, elapsed, age of
status.json: yellow when > 10 s old and not final, red when > 60 s), step progress bar with
ETA, one row per cell (role in the simulator's colours, runs served, last 40 s of roles as
R/T/-), failures in red (kept high so they fit a small screen), waterlevel sparkline
(status.json waterlevel_history), throughput and busy figures (see model.py), run counts,
the last step's training signals (loss, clip fraction, entropy, grad norm, reward and its
spread per group, trainer/sampler mismatch by policy lag, staleness), recent rewards, the
latest events with their reasons.
"""

from __future__ import annotations

import math


from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gyre_slurm.monitor import model
from gyre_slurm.sim.report import ROLE_COLORS

SPARK = "▁▂▃▄▅▆▇█"
STRIP_S = 40
SHOWN_KINDS = ("decision", "decision_dropped", "handoff", "handoff_cancelled", "step",
               "checkpoint", "resume", "finish", "start", "weights_loaded", "weights_streamed",
               *model.FAILURE_KINDS)


def role_style(role: str, target: str | None = None) -> str:
    if role in ("draining", "loading") and target:
        return ROLE_COLORS.get(f"{role}->{target}", "magenta")
    return ROLE_COLORS.get(role, "white")


def sparkline(values: list[float], *, width: int = 60) -> str:
    values = values[-width:]
    if not values:
        return ""
    values = [v if math.isfinite(v) else 0.0 for v in values]  # a diverged step: NaN
    top = max(values) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))]
                   for v in values)


def header(snap: model.Snapshot) -> Text:
    st = snap.status
    text = Text()
    text.append(f"{snap.run_dir}: ", style="bold")
    if st is None:
        return text.append("waiting for status.json", style="yellow")
    age = snap.now - st.get("t", snap.now)
    final = bool(st.get("final"))
    text.append(f"policy {st.get('policy', '?')}, version {st.get('version', '?')}/"
                f"{st.get('num_steps', '?')}, {st.get('elapsed_s', 0):.0f}s elapsed, ")
    style = "green" if final or age <= 10 else ("yellow" if age <= 60 else "bold red")
    text.append(f"status {age:.0f}s old" + (" (final)" if final else
                                             " (stale)" if age > 10 else ""), style=style)
    return text


def progress(snap: model.Snapshot) -> Table:
    p = model.step_progress(snap)
    grid = Table.grid(padding=(0, 1))
    total = p["total"] or 0
    eta = f", ETA {p['eta_s']:.0f}s" if p["eta_s"] is not None else ""
    grid.add_row(Text(f"step {p['done']}/{total or '?'}"),
                 ProgressBar(total=max(total, 1), completed=min(p["done"], total or 0), width=40),
                 Text(f"{100 * p['done'] / total:.0f}%{eta}" if total else ""))
    return grid


def cells_table(snap: model.Snapshot, segs: list, span_s: float) -> Table:
    table = Table(box=None, padding=(0, 1), show_edge=False)
    for col in ("cell", "role", "runs", f"last {STRIP_S}s (R rollout, T train, - handoff)"):
        table.add_column(col, no_wrap=True)
    last_handoff_t = max((e["t"] for e in snap.of_kind("handoff")), default=0.0)
    fresh = bool(snap.status) and not snap.status.get("final") and \
        snap.status.get("t", 0.0) >= last_handoff_t
    for c in snap.status.get("cells", []) if snap.status else []:
        role, target = c.get("role", "?"), c.get("target")
        label = f"{role} -> {target}" if target else role
        strip = model.role_strip(segs, c["cell"], span_end_s=span_s, width=STRIP_S)
        if strip and fresh:  # now: a handoff under way shows in status.json first
            strip = strip[:-1] + model.ROLE_CHARS.get(role, "-")
        table.add_row(Text(f"cell {c['cell']} [{','.join(c.get('nodes', []))}]"),
                      Text(label, style=role_style(role, target)), Text(str(c.get("runs", 0))),
                      strip_text(strip))
    return table


def strip_text(strip: str) -> Text:
    text = Text()
    for ch in strip:
        text.append(ch, style={"R": ROLE_COLORS["rollout"], "T": ROLE_COLORS["train"],
                               "-": "#ff7f0e", "X": "red"}.get(ch, ""))
    return text


def figures(snap: model.Snapshot, segs: list, span_s: float) -> Group:
    st = snap.status or {}
    hist = [w.get("waterlevel", 0.0) for w in st.get("waterlevel_history", [])]
    wl = st.get("waterlevel") or {}
    lines = [Text(f"waterlevel {sparkline(hist)} now {wl.get('waterlevel', 0):.2f} cells "
                  f"({wl.get('in_flight', 0)} in flight, {wl.get('queued', 0)} queued, "
                  f"{wl.get('rollout_cells', 0)} rollout / {wl.get('train_cells', 0)} train "
                  "cells)")]
    tp = model.throughput(snap)
    b = model.busy(snap, segs, span_s)
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    lines.append(Text(f"throughput (last {tp['window_s']:.0f}s): rollout "
                      f"{tp['runs_per_min']:.1f} runs/min, train {tp['tokens_per_s']:.1f} "
                      "tokens/s"))
    occupancy = model.rollout_occupancy(st, model.cell_capacity(snap.run_dir))
    lines.append(Text(f"busy: in-role {pct(b['in_role'])} of cell time, train compute "
                      f"{pct(b['train_compute'])} of wall time, rollout slots "
                      f"{pct(occupancy)} full"))
    if st.get("runs"):
        lines.append(Text("runs: " + ", ".join(f"{k} {v}" for k, v in st["runs"].items())))
    train = st.get("train") or {}
    if train:
        lines.append(Text(f"train world: generation {train.get('generation')}, nodes "
                          f"{train.get('members')}, {train.get('ready_tokens')} tokens ready"))
    lines += training_lines(model.step_metrics(snap.events))
    return Group(*lines)


def _num(value, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def training_lines(steps: list[dict]) -> list[Text]:
    """The last step's training signals, and the mismatch per step as a sparkline."""
    if not steps:
        return []
    m = steps[-1]
    lags = sorted((k.split("/")[1][3:], m[k]) for k in m
                  if k.startswith("mismatch/lag") and k.endswith("/abs_mean"))
    hist = m.get("staleness/lag_hist") or {}
    trend = [s.get("mismatch/abs_mean") or 0.0 for s in steps]
    return [
        Text(f"training (step {m['step']}): loss {_num(m.get('train/loss'))}, clip "
             f"{_num(m.get('train/clip_frac'), '.1%')}, entropy {_num(m.get('train/entropy'))}, "
             f"grad norm {_num(m.get('train/grad_norm'))}, reward {_num(m.get('reward/mean'))} "
             f"(group spread {_num(m.get('reward/group_std_mean'))}), "
             f"{m.get('train/tokens')} tokens"),
        Text(f"mismatch |logp trainer - sampler|: mean {_num(m.get('mismatch/abs_mean'))}, max "
             f"{_num(m.get('mismatch/abs_max'))}, KL(k3) {_num(m.get('mismatch/kl_k3'))}; by lag "
             + (", ".join(f"{lag}: {_num(v)}" for lag, v in lags) or "n/a")
             + f"; per step {sparkline(trend, width=30)}"),
        Text("staleness: tokens by lag " + (", ".join(f"{k}: {v}" for k, v in hist.items())
                                            or "n/a")
             + f", runs spanning versions {_num(m.get('staleness/multi_version_run_frac'), '.0%')}"
             f", widest span {_num(m.get('staleness/run_span_max'), 'd')}")]


def describe(snap: model.Snapshot, e: dict) -> Text:
    """One event as a line: +seconds since start, kind, and its reasons/figures."""
    base = snap.start_t or snap.coord_t0 or 0.0
    kind = e["kind"]
    when = f"+{snap.to_unix(e) - base:7.1f}s "
    if kind == "decision":
        body = f"decision cell {e.get('cell')} -> {e.get('to')} ({e.get('cause')}, " \
               f"drain {e.get('drain')}): {e.get('reason', '')}"
    elif kind == "decision_dropped":
        body = f"decision cell {e.get('cell')} -> {e.get('to')} ({e.get('cause')}) not " \
               f"carried out: {e.get('why')}"
    elif kind == "handoff_cancelled":
        body = f"handoff {e.get('direction')} of cells {e.get('cells')} cancelled after " \
               f"{e.get('drain_s', 0):.2f}s of drain"
    elif kind == "handoff":
        body = f"handoff {e.get('direction')} cells {e.get('cells')} in " \
               f"{e.get('total_s', 0):.2f}s (drain {e.get('drain_s', 0):.2f}s)"
    elif kind == "step":
        body = f"step {e.get('step')} -> version {e.get('version')}: mean reward " \
               f"{e.get('mean_reward', 0):.3f}, {e.get('trajectories')} trajectories, " \
               f"{e.get('tokens')} tokens"
    elif kind == "run_end":
        body = f"run {e.get('run_id')} {e.get('status')}: {e.get('error')}"
    else:
        extra = {k: v for k, v in e.items() if k not in ("t", "kind")}
        body = f"{kind} " + ", ".join(f"{k}={round(v, 3) if isinstance(v, float) else v}"
                                      for k, v in list(extra.items())[:4])
    bad = kind in model.FAILURE_KINDS or kind == "run_end"
    return Text(when + body, style="bold red" if bad else "", no_wrap=True, overflow="ellipsis")


def frame(snap: model.Snapshot, *, events_shown: int = 10) -> Group:
    parts = [header(snap)]
    if snap.status is None and not snap.events:
        return Group(*parts)
    segs, span_s = model.segments(snap)
    parts += [progress(snap), cells_table(snap, segs, span_s)]
    fails = model.failures(snap)
    if fails:  # above the figures: what went wrong must fit on a small screen
        parts.append(Text(f"FAILURES ({len(fails)}):", style="bold red"))
        parts += [describe(snap, e) for e in fails[-5:]]
    parts.append(figures(snap, segs, span_s))
    rewards = (snap.status or {}).get("rewards", [])[-5:]
    if rewards:
        parts.append(Text("rewards: " + ", ".join(
            f"step {r['step']} {r['mean_reward']:.3f}" for r in rewards)))
    shown = [e for e in snap.events if e["kind"] in SHOWN_KINDS][-events_shown:]
    parts.append(Text("latest events:", style="bold"))
    parts += [describe(snap, e) for e in shown] or [Text("  (none yet)")]
    return Group(*parts)

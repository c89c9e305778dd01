"""Turning simulation results into the JSON object, a terminal table and a PNG."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from gyre_slurm.common.fsio import check_can_write, write_bytes_atomic
from gyre_slurm.errors import UserError
from gyre_slurm.sim.engine import SimResult

ROLE_COLORS = {
    "rollout": "#2ca02c", "train": "#1f77b4",
    "draining->train": "#ffbb78", "draining->rollout": "#aec7e8",
    "loading->train": "#9467bd", "loading->rollout": "#c5b0d5",
    "failed": "#d62728",
}


def to_json(*, name: str, comparison: dict) -> dict[str, Any]:
    bound = comparison["bound"]
    lb = bound["lower_bound_s"]
    results: dict[str, SimResult] = comparison["results"]
    policies = {}
    for pname, res in results.items():
        entry = res.summary()
        entry["ratio_to_lower_bound"] = round(res.makespan_s / lb, 4)
        entry["trajectories_per_step"] = sorted(set(res.trajectories_per_step))
        policies[pname] = entry
    out = {
        "preset": name,
        "lower_bound_s": round(lb, 1),
        "work_bound_s": round(bound["work_bound_s"], 1),
        "critical_path_s": round(bound["critical_path_s"], 1),
        "best_async_split": comparison["best_async_split"],
        "policies": policies,
    }
    elastic = results["elastic"].makespan_s
    out["elastic_speedup"] = {
        f"vs_{other}": round(results[other].makespan_s / elastic, 4)
        for other in ("colocate", "async", "async-even") if other in results
    }
    return out


def print_table(summary: dict, console=None) -> None:
    from rich.table import Table

    lb = summary["lower_bound_s"]
    table = Table(title=f"{summary['preset']}: lower bound {lb / 3600:.2f} h "
                        f"(work {summary['work_bound_s'] / 3600:.2f} h, critical path "
                        f"{summary['critical_path_s'] / 3600:.2f} h); " + (
                            f"best async split {summary['best_async_split']} rollout cells"
                            if summary["best_async_split"] is not None else
                            "no async split (a model replica needs every cell)"))
    for col in ("policy", "hours", "x bound", "vs elastic", "busy", "handoffs", "migrated"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    elastic = summary["policies"]["elastic"]["makespan_s"]
    for name, p in summary["policies"].items():
        table.add_row(name, f"{p['makespan_s'] / 3600:.2f}", f"{p['ratio_to_lower_bound']:.3f}",
                      f"{p['makespan_s'] / elastic:.3f}", f"{p['busy_fraction']:.1%}",
                      str(p["handoffs"]), str(p["migrations"]))
    (console or _console_for(table)).print(table)


def _console_for(table):
    """A terminal's own width; elsewhere (a pipe, a file: rich would assume 80 columns
    and cut the cells) the table's natural width, so that nothing is cut."""
    import sys

    from rich.console import Console
    from rich.measure import Measurement

    if sys.stdout.isatty():
        return Console()
    wide = Console(width=100_000)
    return Console(width=Measurement.get(wide, wide.options, table).maximum)


def check_plot_path(path: str, *, option: str = "--plot") -> str:
    """The image format `path` names, checked before any simulation: a suffix matplotlib
    writes, in a folder that exists (else a UserError saying which, naming `option`)."""
    from matplotlib.figure import Figure

    target = Path(path)
    fmt = target.suffix.lstrip(".").lower()
    formats = sorted(Figure().canvas.get_supported_filetypes())
    if fmt not in formats:
        raise UserError(f"{option} {path}: name the image with one of the suffixes "
                        f"{', '.join('.' + f for f in formats)} (e.g. timelines.png)")
    folder = target.parent
    if not folder.is_dir():
        raise UserError(f"{option} {path}: the folder {folder} does not exist; create it or "
                        f"name another")
    check_can_write(folder, what=f"{option} {path}: the folder", purpose="the image")
    return fmt


def plot_timelines(results: dict[str, SimResult], path: str, *, title: str,
                   names: tuple[str, ...] = ("elastic", "colocate", "async")) -> None:
    """One panel per policy, one strip per cell, coloured by role over time (hours)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = tuple(n for n in names if n in results)
    num_cells = 1 + max(c for r in results.values() for c, *_ in r.timeline)
    horizon_h = max(results[n].makespan_s for n in names) / 3600
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.2 + 0.28 * num_cells * len(names)),
                             sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        res = results[name]
        for cell, t0, t1, label in res.timeline:
            ax.broken_barh([(t0 / 3600, (t1 - t0) / 3600)], (cell - 0.4, 0.8),
                           facecolors=ROLE_COLORS.get(label, "#7f7f7f"), linewidth=0)
        ax.set_ylim(-0.6, num_cells - 0.4)
        ax.set_xlim(0, horizon_h * 1.01)
        ax.invert_yaxis()
        ax.set_ylabel("cell")
        ax.set_title(f"{name}: {res.makespan_s / 3600:.2f} h, busy {res.busy_fraction:.0%}, "
                     f"{res.handoffs} handoffs", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("hours")
    handles = [Patch(color=c, label=l) for l, c in ROLE_COLORS.items() if l != "failed"]
    fig.legend(handles=handles, loc="upper right", ncol=3, fontsize=8)
    fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    save_figure(fig, path, dpi=110)


def save_figure(fig, path: str | Path, *, dpi: int) -> None:
    """Write `fig` to `path` in the format its suffix names (`check_plot_path`, done up
    front), whole or not at all (rendered in memory, then renamed into place, as every
    file here), and close it."""
    import matplotlib.pyplot as plt

    image = io.BytesIO()
    fig.savefig(image, dpi=dpi, format=Path(path).suffix.lstrip(".").lower())
    plt.close(fig)
    write_bytes_atomic(path, image.getvalue())

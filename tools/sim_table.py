#!/usr/bin/env python3
"""Print the simulator tables of docs/scheduler.md (markdown) for every published-setting preset.

  tools/gyre-env python tools/sim_table.py      (or: source tools/env.sh; python tools/...)

Speedups are makespan ratios (other / elastic). "Published" columns are the figures in
DESIGN 1; a dash where none was published for that setting.
"""

from __future__ import annotations

import sys

from gyre_slurm.config.presets import preset_path
from gyre_slurm.config.schema import load_config
from gyre_slurm.sim.runner import compare

PRESETS = ("terminalbench-122b", "deepswe-122b", "nl2repo-122b", "nl2repo-2.4t")
PUBLISHED = {  # elastic speedup vs colocate, vs async (DESIGN 1)
    "terminalbench-122b": ("up to 1.85", "up to 1.43"),
    "deepswe-122b": ("-", "-"),
    "nl2repo-122b": ("-", "-"),
    "nl2repo-2.4t": ("1.21", "1.78"),
}
ABLATIONS = ("elastic-nostream", "elastic-nofloor", "elastic-naive", "async-stream")


def main(presets=PRESETS) -> None:
    rows, ablation_rows = [], []
    for name in presets:
        cfg = load_config(preset_path(name))
        out = compare(cfg)
        lb = out["bound"]["lower_bound_s"]
        r = {k: v.makespan_s for k, v in out["results"].items()}
        e = r["elastic"]
        pub_c, pub_a = PUBLISHED.get(name, ("-", "-"))
        rows.append(
            f"| {name} | {e / 3600:.1f} h | {r['colocate'] / e:.2f}x | {pub_c} | "
            f"{r['async'] / e:.2f}x ({out['best_async_split']}/{cfg.cluster.num_cells}) | "
            f"{r['async-even'] / e:.2f}x | {pub_a} | {e / lb:.3f} | {r['colocate'] / lb:.3f} | "
            f"{r['async'] / lb:.3f} |")
        ablation_rows.append(f"| {name} | " + " | ".join(
            f"{r[a] / e:.3f}" for a in ABLATIONS) + " |")
        print(f"done {name}", file=sys.stderr)
    print("| preset | elastic | vs colocate | published | vs async, best split (R/cells) "
          "| vs async, even | published | elastic / bound | colocate / bound | async / bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| preset (makespan / elastic's) | " + " | ".join(ABLATIONS) + " |")
    print("|---|" + "---|" * len(ABLATIONS))
    print("\n".join(ablation_rows))


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or PRESETS)

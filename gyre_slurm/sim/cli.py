"""`gyre sim`: compare elastic, colocate and async on a workload.

  gyre sim --preset NAME [--json] [--plot FILE.png] [--set KEY=VALUE ...]
  gyre sim --workload FILE.yaml ...
  gyre sim --preset NAME --sweep cell_nodes=4,8 [--slurm [--slurm-arg K=V ...]]

With `--slurm`, each point of a sweep runs as one task of a Slurm job array (submitit;
`gyre_slurm.sim.array`), and the results come back here in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

from gyre_slurm.common.yamltext import load_yaml
from gyre_slurm.config.cli import add_set_argument
from gyre_slurm.config.presets import preset_names, preset_path
from gyre_slurm.config.schema import GyreConfig, load_config
from gyre_slurm.errors import UserError
from gyre_slurm.sim.report import check_plot_path, plot_timelines, print_table, to_json
from gyre_slurm.sim.runner import compare


SLURM_DIR = Path("runs") / "sim-sweeps"


def register(subparsers) -> None:
    p = subparsers.add_parser("sim", help="simulate the policies on a workload and compare them")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"a shipped workload: {', '.join(preset_names())}")
    src.add_argument("--workload", type=Path, help="a workload file (the config schema)")
    add_set_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    p.add_argument("--plot", metavar="FILE.png", help="draw each policy's cell roles over time")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...",
                   help="repeat for each value of one key (e.g. cell_nodes=4,8)")
    p.add_argument("--no-ablations", action="store_true", help="only elastic, colocate, async")
    p.add_argument("--slurm", action="store_true",
                   help="run the sweep's points as a Slurm job array (submitit)")
    p.add_argument("--slurm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a submitit/sbatch parameter of the array, e.g. partition=cpu or "
                        "time=30 (minutes) (repeatable)")
    p.add_argument("--slurm-dir", type=Path, default=None,
                   help="where the array's scripts, logs and results go (a shared folder; "
                        f"default {SLURM_DIR})")
    p.set_defaults(func=run)


def check_slurm_options(args: argparse.Namespace) -> None:
    """--slurm runs a sweep's points as a job array: without --sweep, or its options
    without it, the command would quietly run here instead."""
    if args.slurm and not args.sweep:
        raise UserError("--slurm runs the points of a sweep as a Slurm job array: add "
                        "--sweep KEY=V1,V2,... (one comparison runs here, without --slurm)")
    given = [name for name, value in (("--slurm-arg", args.slurm_arg),
                                      ("--slurm-dir", args.slurm_dir)) if value]
    if given and not args.slurm:
        names = " and ".join(given)
        raise UserError(f"{names} {'goes' if len(given) == 1 else 'go'} with --slurm (a "
                        f"sweep run as a Slurm job array); add --slurm, or leave {names} out")


def run(args: argparse.Namespace) -> int:
    check_slurm_options(args)
    path = preset_path(args.preset) if args.preset else args.workload
    name = args.preset or Path(args.workload).stem
    if args.sweep:
        if args.plot:
            raise UserError("--plot draws one comparison's timelines; it does not go with "
                            "--sweep (run the point you want to see without --sweep)")
        return run_sweep(args, path, name)
    if args.plot:
        check_plot_path(args.plot)  # before the simulation, not after it
    cfg = load_config(path, args.overrides)
    comparison = compare(cfg, ablations=not args.no_ablations, base_dir=Path(path).parent)
    summary = to_json(name=name, comparison=comparison)
    if args.plot:
        plot_timelines(comparison["results"], args.plot, title=f"gyre sim: {name}")
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        print_table(summary)
        if args.plot:
            print(f"timelines written to {args.plot}")
    return 0


def sweep_key(key: str) -> str:
    """`cell_nodes` -> `cluster.cell_nodes`: a short key names the one section holding it
    (a top-level key, `seed`, is its own path)."""
    if "." in key:
        return key
    hints = typing.get_type_hints(GyreConfig)
    if key in hints and not dataclasses.is_dataclass(hints[key]):
        return key
    owners = [name for name, tp in hints.items() if dataclasses.is_dataclass(tp)
              and key in {f.name for f in dataclasses.fields(tp)}]
    if len(owners) != 1:
        where = f"in {', '.join(owners)}" if owners else "in no section"
        raise UserError(f"--sweep {key}: that key is {where}; give the full KEY.PATH")
    return f"{owners[0]}.{key}"


def run_sweep(args: argparse.Namespace, path: Path, name: str) -> int:
    key, sep, values = args.sweep.partition("=")
    if not sep or not values:
        raise UserError(f"--sweep {args.sweep!r}: expected KEY=V1,V2,...")
    full = sweep_key(key.strip())
    values = [v.strip() for v in values.split(",")]
    for value in values:  # every point's config is checked before anything runs
        load_config(path, list(args.overrides) + [f"{full}={value}"])
    if args.slurm:
        from gyre_slurm.sim.array import sweep_on_slurm

        points = sweep_on_slurm(path, name=name, key=full, values=values,
                                overrides=args.overrides, ablations=not args.no_ablations,
                                folder=args.slurm_dir or SLURM_DIR,
                                slurm_args=args.slurm_arg)
    else:
        points = [sweep_point(path, name=name, key=full, value=v, overrides=args.overrides,
                              ablations=not args.no_ablations) for v in values]
    if not args.json:
        for summary in points:
            print_table(summary)
    if args.json:
        json.dump({"preset": name, "sweep": full, "points": points}, sys.stdout)
        sys.stdout.write("\n")
    return 0



def sweep_point(path: Path, *, name: str, key: str, value: str, overrides: list[str],
                ablations: bool) -> dict:
    """One point of a sweep: the comparison with `key=value`, as `to_json` gives it."""
    cfg = load_config(path, list(overrides) + [f"{key}={value}"])
    comparison = compare(cfg, ablations=ablations, base_dir=Path(path).parent)
    summary = to_json(name=f"{name} {key}={value}", comparison=comparison)
    summary["value"] = load_yaml(value, what=f"--sweep {key}={value}")
    return summary

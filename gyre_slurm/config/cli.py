"""`gyre config CONFIG [--set KEY=VALUE ...]`: print the resolved config."""

from __future__ import annotations

import argparse

from gyre_slurm.config.loader import dump_yaml
from gyre_slurm.config.presets import resolve
from gyre_slurm.config.schema import load_config


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config value, e.g. --set cluster.num_nodes=8 (repeatable)",
    )


def register(subparsers) -> None:
    parser = subparsers.add_parser("config", help="print the resolved config")
    parser.add_argument("config", help="a config file, or the name of a preset")
    add_set_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(resolve(args.config), args.overrides)
    print(dump_yaml(cfg), end="")
    return 0

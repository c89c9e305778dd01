"""`gyre config CONFIG [--set KEY=VALUE ...]`: print the resolved config.
`gyre config keys [SECTION]`: every key with its type, default and description."""

from __future__ import annotations

import argparse

from gyre_slurm.config.keys import describe, iter_keys
from gyre_slurm.config.loader import dump_yaml
from gyre_slurm.config.presets import resolve
from gyre_slurm.config.schema import GyreConfig, load_config
from gyre_slurm.errors import UserError


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config value, e.g. --set cluster.num_nodes=8 (repeatable)",
    )


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config", help="print the resolved config, or every key with its description",
        description="Print a config resolved with every default (`gyre config FILE|PRESET`), "
                    "or describe the keys (`gyre config keys [SECTION]`).",
        epilog="`gyre config keys` lists every section and key: type, default, what it does.")
    parser.add_argument("config", help="a config file, the name of a preset, or `keys`")
    parser.add_argument("section", nargs="?",
                        help="with `keys`: a section (or key path prefix) to list")
    add_set_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.config == "keys":
        print(describe(keys_under(args.section)), end="")
        return 0
    if args.section is not None:
        raise UserError(f"unexpected argument {args.section!r} (a SECTION goes with "
                        f"`gyre config keys`)")
    cfg = load_config(resolve(args.config), args.overrides)
    print(dump_yaml(cfg), end="")
    return 0


def keys_under(prefix: str | None):
    keys = iter_keys(GyreConfig)
    if not prefix:
        return keys
    chosen = [k for k in keys if k.path == prefix or k.path.startswith((prefix + ".", prefix + "[]."))]
    if not chosen:
        sections = ", ".join(k.path for k in keys if k.is_section and "." not in k.path)
        raise UserError(f"no key or section {prefix!r}; sections: {sections}")
    return chosen

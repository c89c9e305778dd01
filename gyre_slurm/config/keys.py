"""Every key of the config, walked from the dataclasses: its path, type, default and
description (`gyre config keys`, and the tests that every key is described)."""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

from gyre_slurm.config.loader import HELP


@dataclass(frozen=True, kw_only=True)
class Key:
    path: str  # cluster.num_nodes, workload.duration.mean_s
    type: str
    default: Any
    help: str
    is_section: bool


def iter_keys(cls: type, prefix: str = "") -> list[Key]:
    """Sections and keys of the dataclass `cls`, depth first, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        path, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.append(Key(path=path, type="section", default=None,
                           help=f.metadata.get(HELP, ""), is_section=True))
            out += iter_keys(tp, prefix=f"{path}.")
            continue
        item = _item_dataclass(tp)
        if item is not None:  # a list of mappings (workload.phases): describe an item's keys
            out.append(Key(path=path, type=f"list of {item.__name__}", default=f.default,
                           help=f.metadata.get(HELP, ""), is_section=True))
            out += iter_keys(item, prefix=f"{path}[].")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        out.append(Key(path=path, type=_type_name(tp), default=default,
                       help=f.metadata.get(HELP, ""), is_section=False))
    return out


def _item_dataclass(tp: Any) -> type | None:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    text = str(tp) if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "").replace("NoneType", "None")


def describe(keys: list[Key], *, width: int = 88) -> str:
    """A readable listing: each section's line, then its keys with default and text."""
    lines = []
    for k in keys:
        if k.is_section:
            lines += ["", f"{k.path}: {' '.join(k.help.split())}"]
            continue
        default = "null" if k.default is None else repr(k.default) \
            if not isinstance(k.default, bool) else str(k.default).lower()
        head = f"  {k.path} ({k.type}, default {default})"
        lines.append(head)
        lines += textwrap.wrap(k.help, width=width, initial_indent="      ",
                               subsequent_indent="      ")
    return "\n".join(lines).lstrip("\n") + "\n"

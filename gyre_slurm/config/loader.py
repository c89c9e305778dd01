"""Strict loading of YAML into frozen dataclasses.

The dataclasses are the schema. Loading fails, with a `ConfigError` that names the key
path, on: an unknown key (with the closest valid key and the list of valid keys), a
value of the wrong type (expected vs actual), or a value a `__post_init__` check refuses.
`--set a.b=value` overrides are applied to the raw mapping before loading, so they go
through the same checks. Values of overrides are parsed as YAML scalars (`4`, `0.5`,
`true`, `[1, 2]`).

A section's `__post_init__` raises `FieldError(key, message)`: loading reports it as
`section.key message` with the full key path (`workload.duration.mean_s must be > 0`).
A schema declares each field with `key(default, "description")`. A class with a
`RENAMED` mapping (old key path -> what replaced it) refuses those keys by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from gyre_slurm.common.values import is_finite_number, is_int, is_number
from gyre_slurm.common.yamltext import load_yaml, read_yaml, text_problem
from gyre_slurm.errors import ConfigError, UserError

T = TypeVar("T")


HELP = "help"  # the metadata key of a config field's description


def key(default: Any = dataclasses.MISSING, help: str = "", *,
        factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its description (`gyre config keys` prints it)."""
    assert help, "every config key needs a description"
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={HELP: help})
    return dataclasses.field(default=default, metadata={HELP: help})


class FieldError(ValueError):
    """A section's value refused by its own check; `key` is the field's name in the
    section (loading prefixes the section's path)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}{_sep(message)}{message}")
        self.key, self.message = key, message


def _sep(message: str) -> str:
    """A message that goes on with the key (`[2].from_step = ...`, `: ...`) follows it
    without a space: `workload.phases[2].from_step`, as every other key is written."""
    return "" if message[:1] in "[.:" else " "


# Every key of seconds (its name ends in `_s`) is at most this: about 32 years, longer
# than any job. A time past it means "never", which no key takes, and a thread's wait or
# a socket's timeout of 1e300 s is an OverflowError in the runtime.
MAX_SECONDS = 1e9
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = read_yaml(path, what=str(path))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except UserError as exc:  # not UTF-8, not YAML, or a YAML bomb
        raise ConfigError(str(exc)) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `a.b.c=value` applied."""
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        shown = repr(item) if len(item) <= 120 else f"{item[:100]!r}... ({len(item):,} characters)"
        if not sep or not key.strip():
            raise ConfigError(f"--set {shown}: expected KEY.PATH=VALUE, e.g. cluster.num_nodes=8")
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {shown}: {part!r} is a value, not a section")
            node = child
        try:
            node[parts[-1]] = load_yaml(raw, what=f"--set {shown}: the value") \
                if raw.strip() else ""
        except UserError as exc:
            raise ConfigError(str(exc)) from exc
    return out


def from_dict(cls: type[T], data: Any, *, path: str = "") -> T:
    """Build dataclass `cls` from a mapping, strictly."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<top>'}: expected a mapping, got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    moved = _renamed(data, getattr(cls, "RENAMED", {}), fields)
    if moved:
        raise ConfigError("; ".join(moved) + " (`gyre config keys` lists every key)")
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key_message(path, str(key), list(fields)))
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, path=_join(path, name))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except FieldError as exc:
        raise ConfigError(f"{_join(path, exc.key)}{_sep(exc.message)}{exc.message}") from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path or '<top>'}: {exc}") from exc


def to_dict(obj: Any) -> Any:
    """The plain-data form of a config (for YAML/JSON output)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=None)


def _convert(tp: Any, value: Any, *, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path=path)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(tp, value, path=path)
    if origin is Literal:
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            close = difflib.get_close_matches(str(value), [str(a) for a in get_args(tp)],
                                              n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: expected one of {choices}, got {value!r}{hint}")
        return value
    if origin in (tuple, list):
        return _convert_sequence(tp, value, path=path)
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_describe(value)}")
        return {
            _convert(key_tp, k, path=path): _convert(val_tp, v, path=_join(path, str(k)))
            for k, v in value.items()
        }
    return _convert_scalar(tp, value, path=path)


def _convert_union(tp: Any, value: Any, *, path: str) -> Any:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, path=path)
        except ConfigError as exc:
            errors.append(str(exc))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {'; or '.join(errors)}")


def _convert_sequence(tp: Any, value: Any, *, path: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list, got {_describe(value)}")
    args = get_args(tp)
    if get_origin(tp) is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected a list of {len(args)}, got {len(value)} items")
        return tuple(_convert(a, v, path=f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    item_tp = args[0] if args else Any
    items = [_convert(item_tp, v, path=f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if get_origin(tp) is tuple else items


def _convert_scalar(tp: Any, value: Any, *, path: str) -> Any:
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads `1e9` as a string; take it as meant
        if not is_number(value):
            raise ConfigError(f"{path}: expected a number, got {_describe(value)}")
        if not is_finite_number(value):  # no key means "never" or "none" by .inf/.nan
            got = f"an integer of {len(str(value))} digits" if is_int(value) else value
            raise ConfigError(f"{path}: expected a finite number, got {got}")
        if path.endswith("_s") and abs(float(value)) > MAX_SECONDS:
            raise ConfigError(f"{path} must be <= {MAX_SECONDS:g} (seconds: about 32 years, "
                              f"longer than any job; check its unit), got {float(value):g}")
        return float(value)
    if tp is int:
        if not is_int(value):
            raise ConfigError(f"{path}: expected an integer, got {_describe(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_describe(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_describe(value)}")
        problem = text_problem(value)
        if problem:
            raise ConfigError(f"{path}: {problem}")
        return value
    raise TypeError(f"config schema uses an unsupported type {tp!r} at {path}")


def _renamed(data: dict, renamed: dict[str, str], fields: dict) -> list[str]:
    """Keys of an older layout in `data` (`section.key` or a whole section), each with
    what replaced it."""
    out = []
    for section, values in data.items():
        found = [f"{section}.{k}" for k in values if f"{section}.{k}" in renamed] \
            if isinstance(values, dict) else []
        out += [f"{old} is now {renamed[old]}" for old in found]
        if not found and section not in fields and section in renamed:
            out.append(f"{section} is {renamed[section]}")
    return out


def _unknown_key_message(path: str, key: str, valid: list[str]) -> str:
    where = _join(path, key)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean {_join(path, close[0])!r}?" if close else ""
    return f"unknown key {where!r}.{hint} Valid keys here: {', '.join(valid)}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data

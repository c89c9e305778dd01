"""YAML from users (config files, `--set` values, task files), loaded safely.

`yaml.safe_load` builds no objects but plain data; what it does not stop is a document
that is small as text and huge as data: anchors and aliases (`&a`, `*a`) share one
list many times over, nine levels of nine aliases make 387 million values from 400 bytes,
and whatever walks the result (a schema check, a dump) then runs for ever. `load_yaml`
counts the values as the data would be walked, aliases expanded, and refuses past
MAX_VALUES; an ordinary anchor that saves repeating a section passes. A document nested
deeper than PyYAML's recursive composer goes (about a thousand levels) is a UserError too,
not the RecursionError it raises, and so is a scalar PyYAML cannot build (an integer of
more than 4,300 digits, a date with a 13th month): not the ValueError it raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gyre_slurm.errors import UserError

MAX_VALUES = 100_000  # a whole config is a few hundred; a task file's tests, a few hundred
MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a mapping with a key given twice: PyYAML keeps the
    last silently, so `num_nodes: 4` and a later `num_nodes: 8` in one section ran with 8
    and no word. Keys a merge (`<<: *base`) brings in may be overridden, as YAML says."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    again = key in first
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if again:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found the key {key!r} again (first on line {first[key]}): YAML "
                        f"would keep only the last; remove one", key_node.start_mark)
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def text_problem(value: str) -> str | None:
    """Why `value` is not text every program and file takes, or None. YAML's "\\ud800"
    and JSON's "\\ud800" make a lone surrogate (no UTF-8 holds it: a file, an environment
    variable, a path, a tokenizer's input); "\\0" a NUL (ends a C string: an argument,
    a path)."""
    if "\0" in value:
        return f"{value[:60]!r} holds a NUL character (\\0): remove it"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"{value[:60]!r} holds a lone surrogate ({value[exc.start]!r}), which is not "
                f"text: write the character itself, or escape it as \\U0001F600 (YAML takes "
                f"no surrogate pairs)")
    return None


def load_yaml(text: str, *, what: str) -> Any:
    """The data of `text`; a UserError naming `what` if it is not YAML (or gives a key
    twice in one mapping) or is too large."""
    try:
        data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise UserError(f"{what} is not valid YAML: {exc}") from exc
    except RecursionError:  # PyYAML composes nested collections recursively
        raise UserError(f"{what} nests its lists or mappings too deeply to load "
                        f"(hundreds of levels); flatten it") from None
    except ValueError as exc:  # a scalar PyYAML matched but cannot build: an integer
        # past Python's 4,300 digits, a date like 2024-13-45 (month 13)
        raise UserError(f"{what} is not valid YAML: a value cannot be read: {exc}") from None
    check_size(data, what=what)
    return data


def check_size(data: Any, *, what: str) -> None:
    seen, stack = 0, [data]
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise UserError(f"{what} holds more than {MAX_VALUES:,} values once its YAML "
                            f"aliases (*name) are expanded; write the data out, or fewer "
                            f"aliases of aliases")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


MAX_TEXT_BYTES = 64 << 20  # a config or a task file is kilobytes


def read_text(path: Path, *, what: str) -> str:
    """A text file's content as UTF-8; a UserError naming `what` if it is not, or if it
    holds more than MAX_TEXT_BYTES (read no further: /dev/zero or a runaway pipe would
    never end; a pipe of a config, `gyre run <(make-config)`, still reads)."""
    with open(path, "rb") as f:
        data = f.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise UserError(f"{what} holds more than {MAX_TEXT_BYTES >> 20} MB; a config or "
                        f"task file is a few kilobytes of YAML or JSON: check the path")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} is not UTF-8 text (byte {exc.start}: "
                        f"{exc.object[exc.start:exc.start + 1]!r})") from exc


def read_yaml(path: Path, *, what: str) -> Any:
    """`load_yaml` of a file's UTF-8 text, errors naming `what`."""
    return load_yaml(read_text(path, what=what), what=what)

"""Writes to the shared filesystem: every file appears whole or not at all.

`write_json_atomic` / `write_bytes_atomic`: temp name in the same directory, fsync,
rename over the target. `append_jsonl`: one line per event, written with a single
`write` on an O_APPEND descriptor and flushed (a reader may see a torn last line after a
crash and must skip it; `read_jsonl` does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int = 0o644) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_json_atomic(path: str | Path, obj: Any, *, mode: int = 0o644) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), mode=mode)


def append_jsonl(path: str | Path, obj: Any) -> None:
    line = (json.dumps(obj, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Whole lines only: a torn last line (no newline, or bad JSON) is skipped."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return
    for raw in data.split(b"\n")[:-1]:
        try:
            yield json.loads(raw)
        except json.JSONDecodeError:
            continue

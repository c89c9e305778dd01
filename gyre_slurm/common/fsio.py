"""Writes to the shared filesystem: every file appears whole or not at all.

`write_json_atomic` / `write_bytes_atomic`: temp name in the same directory, fsync,
rename over the target; on any failure (disk full included) the temp file is removed and
the target keeps its old content. `append_jsonl`: one line per event, written with a
single `write` on an O_APPEND descriptor; a line that would follow a torn one (a crash
cut the previous writer mid-line) starts on a new line, so it stays whole.

`make_folder` creates a folder (a run dir, an output's folder) or says, as a
`UserError`, why it cannot (a file in the way, no permission): before a job starts
anything.

`loads_json` is `json.loads` for anything read from outside the process (files on the
shared filesystem, a model directory, a server's reply): too deep a nesting is a
ValueError (`JSONTooDeep`), not a RecursionError that escapes every handler.

Reading (`read_jsonl`): whole lines only. A torn LAST line (no newline: a writer died
mid-write) is the normal crash case and is skipped quietly (debug log). A bad line with
a newline after it is corruption: it is skipped, never used, and reported loudly (a
warning naming the file, line number and byte offset; `on_bad` receives a `BadLine` for
the caller to record). `drop_torn_tail` cuts a torn last line off before a new writer
(a resumed job) appends after it.

Disk full: `is_disk_full` recognises ENOSPC / EDQUOT / EFBIG (also in the text of an
error that crossed a process boundary); `DiskFull` is the error to raise, naming what
was being written, where, how much was needed when known, and the free space on that
file system.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_slurm.errors import UserError

log = logging.getLogger(__name__)

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "File too large")


# -- writing -------------------------------------------------------------------------
class JSONTooDeep(ValueError):
    """JSON nested deeper than Python's decoder recurses: bad input like any other."""


def loads_json(data: str | bytes | bytearray) -> Any:
    """`json.loads`, where JSON nested too deeply to decode (a few thousand brackets) is a
    ValueError like any other bad JSON: Python's decoder raises RecursionError for it,
    which no reader's `except ValueError` caught (a hostile file or response crashed the
    reader instead of being reported as bad)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise JSONTooDeep("JSON nested too deeply to decode (thousands of levels of "
                          "brackets): not a file or message of ours") from None


def write_all(fd: int, data: bytes | memoryview) -> int:
    """Write every byte (a short write is continued; its failure raises)."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int = 0o644) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # never a half file left behind, under any name
        if isinstance(exc, OSError) and is_disk_full(exc):
            raise DiskFull(what=f"writing {path.name}", path=path, needed=len(data),
                           cause=exc) from exc
        raise


def write_json_atomic(path: str | Path, obj: Any, *, mode: int = 0o644) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), mode=mode)


def fsync_dir(path: str | Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_jsonl(path: str | Path, obj: Any) -> None:
    line = (json.dumps(obj, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)  # read: the last byte
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # after a torn line: ours starts whole on its own line
        write_all(fd, line)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(what="appending a record", path=Path(path), needed=len(line),
                           cause=exc) from exc
        raise
    finally:
        os.close(fd)


# -- reading -------------------------------------------------------------------------
@dataclass(frozen=True)
class BadLine:
    """A line of a JSON-lines file that is not a JSON object: corrupt, skipped."""

    path: str
    line: int  # 1-based
    offset: int  # byte offset of the line's start
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: line {self.line} (byte offset {self.offset}): {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "offset": self.offset,
                "reason": self.reason}


def parse_jsonl(data: bytes, *, path: str, start_line: int = 1, start_offset: int = 0,
                on_bad: Callable[[BadLine], None] | None = None,
                check: Callable[[dict], str | None] | None = None) -> Iterator[dict]:
    """The JSON objects of `data`'s newline-terminated lines (a trailing fragment is
    ignored: the caller decides whether it is a torn tail). Bad lines are reported, and
    so are objects that `check` refuses (it returns what is wrong with one, or None)."""
    pos, number = 0, start_line
    while (end := data.find(b"\n", pos)) >= 0:
        raw = data[pos:end]
        try:
            obj = json.loads(raw)
            reason = None if isinstance(obj, dict) else f"not a JSON object: {raw[:60]!r}"
            if reason is None and check is not None and (why := check(obj)):
                reason = f"{why}: {raw[:60]!r}"
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, an integer
            # past Python's 4,300 digits (a plain ValueError), nested too deep
            obj, reason = None, f"corrupt line ({exc}): {raw[:60]!r}"
        if reason is None:
            yield obj
        elif raw.strip():  # an empty line carries nothing to lose
            bad = BadLine(path, number, start_offset + pos, reason)
            log.warning("%s: skipped", bad)
            if on_bad is not None:
                on_bad(bad)
        pos, number = end + 1, number + 1


def read_jsonl(path: str | Path, *, on_bad: Callable[[BadLine], None] | None = None,
               check: Callable[[dict], str | None] | None = None) -> Iterator[dict]:
    """Whole lines only: a torn last line (no newline) is skipped quietly; a corrupt
    line before it (or an object `check` refuses) is skipped and reported (see the
    module docstring)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return
    yield from parse_jsonl(data, path=str(path), on_bad=on_bad, check=check)
    tail = data[data.rfind(b"\n") + 1:]
    if tail:
        log.debug("%s: torn last line at byte offset %d (%d bytes) skipped", path,
                  len(data) - len(tail), len(tail))


def drop_torn_tail(path: str | Path) -> tuple[int, int] | None:
    """Cut a torn last line (bytes after the last newline) off the file: call only
    while no writer appends. Returns (offset, bytes dropped), or None if it was whole."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return None
    with open(path, "rb") as f:
        back = min(size, 1 << 20)
        f.seek(size - back)
        chunk = f.read(back)
    if chunk.endswith(b"\n"):
        return None
    cut = chunk.rfind(b"\n")
    offset = size - back + cut + 1 if cut >= 0 else (0 if back == size else None)
    if offset is None:  # a last "line" over 1 MiB with no newline: not a torn JSON line
        return None
    os.truncate(path, offset)
    return offset, size - offset


# -- disk full -----------------------------------------------------------------------
def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return True
    text = str(exc)
    return any(t in text for t in DISK_FULL_TEXTS)


def mount_of(path: str | Path) -> tuple[str, str]:
    """(mount point, file system type) of the file system holding `path`."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    fstype = "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[1].replace("\\040", " ") == str(p):
                fstype = fields[2]  # the last one mounted there is the one in use
    except OSError:
        pass
    return str(p), fstype


def free_bytes(path: str | Path) -> int | None:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


class DiskFull(UserError):
    """A write failed for lack of space. The message says what, where, how much was
    needed when known, and the free space on the file system (and where it is mounted)."""

    def __init__(self, *, what: str, path: str | Path, needed: int | None = None,
                 cause: BaseException | None = None, after: str = ""):
        self.path, self.needed = Path(path), needed
        self.mount, self.fstype = mount_of(path)
        self.free = free_bytes(path)
        need = f"needed about {_mb(needed)}, " if needed else ""
        free = f"{_mb(self.free)} free" if self.free is not None else "free space unknown"
        text = " ".join(str(cause).split()) if cause is not None else ""
        why = f" ({text[:300]})" if text else ""
        super().__init__(
            f"disk full: {what} at {path}{why}: {need}{free} on {self.mount} "
            f"({self.fstype}); free space on {self.mount}{after}")


def make_folder(path: str | Path, *, what: str = "--run-dir", purpose: str = "the run") -> Path:
    """Create the folder `path` (with its parents) for `purpose`, or say why it cannot be
    (`what` names the option or thing the user gave), before anything starts: a path
    that is a file, lies under a file, or cannot be written is the user's to fix, not a
    traceback from deep in the job."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{what} {path} is a file, not a folder: name a folder for "
                        f"{purpose}") from None
    except NotADirectoryError:
        raise UserError(f"{what} {path}: a part of that path is a file, not a folder; "
                        f"name a folder for {purpose}") from None
    except PermissionError:
        raise UserError(f"{what} {path}: permission denied creating it; name a folder you "
                        f"can write for {purpose}") from None
    except OSError as e:
        raise UserError(f"{what} {path}: cannot create it ({e.strerror or e}); name a "
                        f"folder you can write for {purpose}") from None
    check_can_write(path, what=what, purpose=purpose)
    return path


def check_can_write(folder: str | Path, *, what: str, purpose: str) -> None:
    """Make and remove an empty file in `folder`, or raise a UserError saying why it
    cannot be done. `os.access` is not what the file system does: root passes every
    access check, yet /proc, /sys or a read-only mount refuse a new file there."""
    folder = Path(folder)
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".gyre-probe-")
    except PermissionError:
        raise UserError(f"{what} {folder} is not writable by this user; name a folder you "
                        f"can write for {purpose}") from None
    except OSError as e:
        raise UserError(f"{what} {folder}: a file cannot be made there "
                        f"({e.strerror or e}); name a folder you can write for "
                        f"{purpose}") from None
    os.close(fd)
    os.unlink(name)


def check_output_file(path: str | Path, *, what: str = "-o",
                      example: str = "out.jsonl") -> Path:
    """A file the command is about to write whole: not a folder, in a folder that is made
    here (as `make_folder`) or refused with the reason, before any work is done."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder: name a file to write (e.g. "
                        f"{path / example})")
    make_folder(path.parent, what=f"{what} {path}: its folder", purpose="the output")
    return path


def existing_run_dir(path: str | Path) -> Path:
    """A run dir a command reads: it must be a folder that exists (else a UserError
    saying which of the two it is not)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"run dir {path} is not a folder: it is a file, not a run dir"
                        if path.exists() else f"run dir {path} does not exist")
    return path

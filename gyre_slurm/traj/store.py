"""The call store: append-only binary segments under RUN_DIR/calls/.

Each writer process owns one segment, `calls/<writer_id>.seg`; there are no locks across
processes. Readers poll the segments while writers append.

Segment = FILE_MAGIC (8 bytes: b"GYRSEG" + version 0x0001), then records:

    head  "<4sII"   magic b"GCAL", body length in bytes, zlib.crc32(body)
    body  "<iiIIIqddHHI"  call, parent_call (-1: none), shared_len, num_new, num_out,
                    policy_version, t_start, t_end, len(run_id), len(finish_reason),
                    len(extra JSON)
          run_id, finish_reason, extra JSON (UTF-8), zero padding to 4 bytes
          new_ids int32[num_new], output_ids int32[num_out], output_logprobs float32[num_out]

all little-endian. A record is one `write` to an O_APPEND descriptor, so it is written
whole or torn at the end of the file; its length and CRC make a torn or corrupt record
detectable. A reader never returns such a record: at the tail of a live segment it waits
(the writer may be mid-write); with `final=True`, or when a valid record follows, it
reports a `TornRecord` (file, offset, and the run/call when the header can be read) and
skips it. A writer reopening its segment after a crash truncates a torn tail first.

Write failures (disk full above all): a failed `append` cuts the segment back to its
last whole record, so no half call is ever left (a reader, or a later writer, never
meets it), and raises `DiskFull` (or `CallStoreFailed` for other I/O errors) naming the
segment, the run and call, the bytes needed and the free space. The writer is then
failed for good: `error` holds the error and every later `append` raises it again; the
job is expected to stop on it (nothing recorded before it is lost: a resumed job opens
a new segment, and its readers read both).

A call costs 64 bytes + its names + 4 B per new prompt token + 8 B per output token.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gyre_slurm.errors import JobFailed, UserError
from gyre_slurm.common.fsio import DiskFull, is_disk_full, loads_json, write_all
from gyre_slurm.traj.delta import CallDelta
from gyre_slurm.traj.encode import DeltaEncoder
from gyre_slurm.traj.records import (
    BadRecord, CallRecord, Loaded, RecordError, RunCollector, check_ids, parse_call,
)

log = logging.getLogger(__name__)

FILE_MAGIC = b"GYRSEG\x00\x01"
REC_MAGIC = b"GCAL"
HEAD = struct.Struct("<4sII")
FIXED = struct.Struct("<iiIIIqddHHI")
SEGMENT_SUFFIX = ".seg"
MAX_BODY_BYTES = 1 << 31
_WRITER_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True)
class TornRecord:
    """Bytes of a segment that hold no valid record."""

    file: str
    offset: int
    num_bytes: int
    reason: str
    run_id: str | None = None
    call: int | None = None

    def to_error(self) -> RecordError:
        return RecordError(self.file, f"offset {self.offset}", self.run_id, self.call,
                           f"{self.reason} ({self.num_bytes} bytes skipped)")


@dataclass(frozen=True)
class PollResult:
    calls: tuple[tuple[CallDelta, str, int], ...]  # (call, segment file, offset)
    torn: tuple[TornRecord, ...]


def encode_record(d: CallDelta) -> bytes:
    run_id, finish = d.run_id.encode(), d.finish_reason.encode()
    extra = json.dumps(d.extra, separators=(",", ":")).encode() if d.extra else b""
    names = run_id + finish + extra
    pad = -(FIXED.size + len(names)) % 4
    body = b"".join([
        FIXED.pack(d.call, d.parent_call, d.shared_len, len(d.new_ids), len(d.output_ids),
                   d.policy_version, d.t_start, d.t_end, len(run_id), len(finish), len(extra)),
        names, b"\0" * pad,
        np.ascontiguousarray(d.new_ids, dtype="<i4").tobytes(),
        np.ascontiguousarray(d.output_ids, dtype="<i4").tobytes(),
        np.ascontiguousarray(d.output_logprobs, dtype="<f4").tobytes(),
    ])
    return HEAD.pack(REC_MAGIC, len(body), zlib.crc32(body)) + body


def _peek_names(body: bytes) -> tuple[str | None, int | None]:
    """Best effort (run_id, call) from a possibly torn body (a corrupt one may name a
    run wrongly; a torn tail, the usual case, names it right)."""
    if len(body) < FIXED.size:
        return None, None
    fields = FIXED.unpack_from(body)
    end = FIXED.size + fields[8]
    run_id = body[FIXED.size:end].decode(errors="replace") if len(body) >= end else None
    return run_id, fields[0]


def decode_body(body: bytes | memoryview) -> CallDelta:
    """A `CallDelta` from a record body whose CRC matched; ValueError if inconsistent."""
    (call, parent, shared, num_new, num_out, version, t_start, t_end,
     n_run, n_finish, n_extra) = FIXED.unpack_from(body)
    pos = FIXED.size
    run_id = bytes(body[pos:pos + n_run]).decode()
    finish = bytes(body[pos + n_run:pos + n_run + n_finish]).decode()
    extra_raw = bytes(body[pos + n_run + n_finish:pos + n_run + n_finish + n_extra])
    pos += n_run + n_finish + n_extra
    pos += -pos % 4
    if pos + 4 * num_new + 8 * num_out != len(body):
        raise ValueError("record lengths do not add up")
    arr = np.frombuffer(body, dtype="<i4", count=num_new + num_out, offset=pos)
    logprobs = np.frombuffer(body, dtype="<f4", count=num_out, offset=pos + 4 * arr.size)
    extra = loads_json(extra_raw) if extra_raw else {}
    return CallDelta(run_id, call, parent, shared, arr[:num_new], arr[num_new:], logprobs,
                     version, t_start, t_end, finish, extra)


def _parse_at(buf: bytes, pos: int) -> tuple[CallDelta | None, int, str]:
    """(record, its size, "") or (None, 0, why not); why "incomplete" means the buffer
    ends before the record does."""
    if len(buf) - pos < HEAD.size:
        return None, 0, "incomplete"
    magic, size, crc = HEAD.unpack_from(buf, pos)
    if magic != REC_MAGIC or size < FIXED.size or size > MAX_BODY_BYTES:
        return None, 0, "bad record header"
    end = pos + HEAD.size + size
    if end > len(buf):
        return None, 0, "incomplete"
    body = memoryview(buf)[pos + HEAD.size:end]  # no copy: arrays are views of `buf`
    if zlib.crc32(body) != crc:
        return None, 0, "CRC mismatch"
    try:
        return decode_body(body), end - pos, ""
    except (ValueError, UnicodeDecodeError) as exc:
        return None, 0, f"undecodable record: {exc}"


def scan(buf: bytes, start: int, *, file: str, final: bool
         ) -> tuple[list[tuple[CallDelta, str, int]], list[TornRecord], int]:
    """Records of `buf` from `start`: (calls, torn stretches, offset to resume at)."""
    calls, torn, pos = [], [], start
    while pos < len(buf):
        rec, size, why = _parse_at(buf, pos)
        if rec is not None:
            calls.append((rec, file, pos))
            pos += size
            continue
        nxt = pos + 1
        while (nxt := buf.find(REC_MAGIC, nxt)) >= 0 and _parse_at(buf, nxt)[0] is None:
            nxt += 1
        if nxt < 0 and not final:
            break  # maybe a record still being written
        end = len(buf) if nxt < 0 else nxt
        run_id, call = (_peek_names(buf[pos + HEAD.size:end])
                        if buf[pos:pos + 4] == REC_MAGIC else (None, None))
        torn.append(TornRecord(file, pos, end - pos, why if why != "incomplete"
                               else "torn record (file ends inside it)", run_id, call))
        pos = end
    return calls, torn, pos


def segment_path(run_dir: str | os.PathLike, writer_id: str) -> Path:
    if not _WRITER_ID.match(writer_id):
        raise UserError(f"writer id {writer_id!r}: use 1-128 of A-Z a-z 0-9 _ . -")
    return Path(run_dir) / "calls" / f"{writer_id}{SEGMENT_SUFFIX}"


class CallStoreFailed(JobFailed):
    """The call store could not record a call (an I/O error other than disk full)."""


class CallStoreWriter:
    """Appends one process's calls to its own segment. fsync policy: after a record when
    `fsync_interval_s` has passed since the last fsync (0: every record; None: only on
    `flush`/`close`). Data is visible to readers as soon as `append` returns."""

    def __init__(self, run_dir: str | os.PathLike, writer_id: str, *,
                 fsync_interval_s: float | None = 1.0, vocab_size: int | None = None):
        self.path = segment_path(run_dir, writer_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync_interval_s = fsync_interval_s
        self.vocab_size = vocab_size
        self._encoder = DeltaEncoder()
        self.error: BaseException | None = None  # set once an append failed: see module doc
        self._fd = -1
        self._recover()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._last_sync = time.monotonic()
        self.num_bytes = self.path.stat().st_size

    def _recover(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            buf = self.path.read_bytes()
            if buf[:len(FILE_MAGIC)] != FILE_MAGIC:
                raise UserError(f"{self.path}: not a call segment (bad magic)") from None
            _, torn, _ = scan(buf, len(FILE_MAGIC), file=str(self.path), final=True)
            if torn and torn[-1].offset + torn[-1].num_bytes == len(buf):
                log.warning("%s: truncating a torn tail at offset %d (%d bytes)",
                            self.path, torn[-1].offset, torn[-1].num_bytes)
                os.truncate(self.path, torn[-1].offset)
            return
        try:
            write_all(fd, FILE_MAGIC)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if is_disk_full(exc):
                raise DiskFull(what="creating a call segment", path=self.path,
                               needed=len(FILE_MAGIC), cause=exc) from exc
            raise
        else:
            os.close(fd)

    def append(self, record: CallRecord | dict[str, Any]) -> CallDelta:
        """Store one call (a `CallRecord` or a dict of docs/runtime.md); returns its stored form.
        Raises `self.error` once a write has failed (see the module docstring)."""
        if self.error is not None:
            raise self.error
        if not isinstance(record, CallRecord):
            record = parse_call(record, vocab_size=self.vocab_size)
        delta = self._encoder.encode(record, remember=False)
        try:  # the shared prefix was checked with its parent
            check_ids(delta.new_ids, name="prompt_ids", vocab_size=self.vocab_size)
            check_ids(delta.output_ids, name="output_ids", vocab_size=self.vocab_size)
            if len(delta.output_ids) != len(delta.output_logprobs):
                raise ValueError(f"{len(delta.output_ids)} output_ids but "
                                 f"{len(delta.output_logprobs)} output_logprobs")
        except ValueError as exc:
            raise BadRecord(str(exc), run_id=record.run_id, call=record.call) from None
        data = encode_record(delta)
        try:
            write_all(self._fd, data)  # a short write is finished, never left torn
        except OSError as exc:
            self._fail(exc, what=f"recording call {delta.call} of run {delta.run_id!r}",
                       needed=len(data))
        self.num_bytes += len(data)
        self._encoder.remember(delta)
        interval = self.fsync_interval_s
        if interval is not None and time.monotonic() - self._last_sync >= interval:
            self.flush()
        return delta

    def forget(self, run_id: str) -> None:
        """A run is over: drop the tree kept to choose its calls' parents."""
        self._encoder.forget(run_id)

    def _fail(self, exc: OSError, *, what: str, needed: int | None) -> None:
        """Cut the segment back to its last whole record, then fail for good."""
        try:
            os.ftruncate(self._fd, self.num_bytes)
        except OSError as cut:  # a reader then sees a torn tail, skipped as such
            log.error("%s: could not cut a failed write back to offset %d: %s", self.path,
                      self.num_bytes, cut)
        after = ("; the call store takes no more calls: stop the job, free space, then "
                 f"continue with --resume (every call recorded before offset "
                 f"{self.num_bytes} of this segment is whole and kept)")
        if is_disk_full(exc):
            self.error = DiskFull(what=what, path=self.path, needed=needed, cause=exc,
                                  after=after)
        else:
            self.error = CallStoreFailed(f"{what} at {self.path} offset {self.num_bytes}: "
                                         f"{exc}{after}")
        log.error("%s", self.error)
        raise self.error from exc

    def flush(self) -> None:
        """Make every recorded call durable (also after a failed append: the whole
        records before it are kept)."""
        try:
            os.fsync(self._fd)
        except OSError as exc:
            if self.error is not None:
                raise self.error from exc
            self._fail(exc, what="syncing the call segment", needed=None)
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.flush()
            except (OSError, DiskFull, CallStoreFailed):
                if self.error is None:
                    raise
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> CallStoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CallStoreReader:
    """Polls every segment of RUN_DIR/calls/ for records appended since the last poll."""

    def __init__(self, run_dir: str | os.PathLike):
        self.calls_dir = Path(run_dir) / "calls"
        self._offsets: dict[Path, int] = {}

    def segments(self) -> list[Path]:
        if not self.calls_dir.is_dir():
            return []
        return sorted(self.calls_dir.glob(f"*{SEGMENT_SUFFIX}"))

    def _poll_one(self, path: Path, final: bool) -> tuple[list, list[TornRecord]]:
        base = self._offsets.get(path, 0)
        with open(path, "rb") as f:
            f.seek(base)
            buf = f.read()
        if base == 0:
            if len(buf) < len(FILE_MAGIC) and (not final or not buf):
                return [], []
            if buf[:len(FILE_MAGIC)] != FILE_MAGIC:
                self._offsets[path] = len(buf)
                return [], [TornRecord(str(path), 0, len(buf), "not a call segment")]
        start = len(FILE_MAGIC) if base == 0 else 0
        calls, torn, end = scan(buf, start, file=str(path), final=final)
        self._offsets[path] = base + end
        calls = [(d, f, off + base) for d, f, off in calls]
        torn = [TornRecord(t.file, t.offset + base, t.num_bytes, t.reason, t.run_id, t.call)
                for t in torn]
        return calls, torn

    def poll(self, *, final: bool = False) -> PollResult:
        """New complete records. `final=True` (no writer is still appending) reports and
        skips an incomplete tail instead of waiting for it."""
        calls, torn = [], []
        for path in self.segments():
            c, t = self._poll_one(path, final)
            calls.extend(c)
            torn.extend(t)
        return PollResult(tuple(calls), tuple(torn))


def _collect(collector: RunCollector[CallDelta], items: list[tuple[CallDelta, str, int]],
             torn: Iterable[TornRecord], vocab_size: int | None) -> None:
    for t in torn:
        err = t.to_error()
        collector.error(file=err.file, where=err.where, run_id=err.run_id, call=err.call,
                        reason=err.reason)
    for d, file, off in items:
        try:
            check_ids(d.new_ids, name="new prompt ids", vocab_size=vocab_size)
            check_ids(d.output_ids, name="output_ids", vocab_size=vocab_size)
        except ValueError as exc:
            collector.error(file=file, where=f"offset {off}", run_id=d.run_id, call=d.call,
                            reason=str(exc))
            continue
        collector.add(d, run_id=d.run_id, call=d.call, file=file, where=f"offset {off}")


def load_store(run_dir: str | os.PathLike, *,
               vocab_size: int | None = None) -> Loaded[CallDelta]:
    """Every finished call in the store, grouped by run; torn records, ids out of vocab
    and bad call numbering become errors (a torn record whose run is known leaves that
    run out). Parent references are checked by `delta.check_run`."""
    result = CallStoreReader(run_dir).poll(final=True)
    collector: RunCollector[CallDelta] = RunCollector()
    _collect(collector, list(result.calls), result.torn, vocab_size)
    return collector.finish(call_of=lambda d: d.call)


class RunBuffer:
    """Follows a live store: `poll` reads what writers appended since the last poll and
    keeps each run's calls; `take(run_id)` hands out a finished run (once its run record
    says it is over) with its numbering checked. A torn record whose run is known is an
    error of that run; one of an unknown run is returned by `poll` for the caller to log.
    Call `poll(final=True)` only once every writer has stopped."""

    def __init__(self, run_dir: str | os.PathLike, *, vocab_size: int | None = None):
        self.reader = CallStoreReader(run_dir)
        self.vocab_size = vocab_size
        self._items: dict[str, list[tuple[CallDelta, str, int]]] = {}
        self._torn: dict[str, list[TornRecord]] = {}

    def poll(self, *, final: bool = False) -> list[TornRecord]:
        result = self.reader.poll(final=final)
        for item in result.calls:
            self._items.setdefault(item[0].run_id, []).append(item)
        unknown = []
        for t in result.torn:
            if t.run_id is None:
                log.warning("call store: %s (skipped)", t.to_error())
                unknown.append(t)
            else:
                self._torn.setdefault(t.run_id, []).append(t)
        return unknown

    def run_ids(self) -> list[str]:
        return sorted(self._items.keys() | self._torn.keys())

    def take(self, run_id: str) -> Loaded[CallDelta]:
        """The run's calls so far (and forget them): `runs` holds it unless it is bad."""
        collector: RunCollector[CallDelta] = RunCollector()
        _collect(collector, self._items.pop(run_id, []), self._torn.pop(run_id, []),
                 self.vocab_size)
        return collector.finish(call_of=lambda d: d.call)

"""Call and run records (docs/runtime.md), their validation, and per-run error collection.

Call record, one JSON object per line (the gateway writes one per model call):

    {"run_id": "q17-r3", "call": 4, "prompt_ids": [...], "output_ids": [...],
     "output_logprobs": [...], "policy_version": 12, "t_start": 0.0, "t_end": 1.5,
     "finish_reason": "stop"}

`call` counts from 0 in call order within a run; `output_logprobs[i]` is the sampling
log-probability of `output_ids[i]` under `policy_version`. Keys beyond these are kept
in `CallRecord.extra` and written back unchanged. In memory, ids are int32 arrays and
logprobs float32 arrays (a JSON logprob is rounded to float32 once, on parsing; every
later conversion is exact).

Run record: {"run_id", "task_id", "reward", "status": "ok|failed|timeout", "reason"?,
...}. Only a run with status "ok" becomes training data.

A bad record never stops a file: it becomes a `RecordError` naming the file, the place
(line or byte offset), the run and the call, and its whole run is left out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from gyre_slurm.common.values import is_finite_number, is_int
from gyre_slurm.errors import UserError

log = logging.getLogger(__name__)

ID_LIMIT = 2**31  # ids are stored as int32; a vocab can be no larger
# What the call store's fixed header holds (traj/store.py FIXED): a call index as int32,
# the policy version as int64, run_id and finish_reason as UTF-8 of at most 65,535 bytes.
MAX_CALL = 2**31 - 1
MAX_VERSION = 2**63 - 1
MAX_NAME_BYTES = 2**16 - 1
CALL_KEYS = (
    "run_id", "call", "prompt_ids", "output_ids", "output_logprobs",
    "policy_version", "t_start", "t_end", "finish_reason",
)
RUN_STATUSES = ("ok", "failed", "timeout")
EMPTY_IDS = np.zeros(0, dtype=np.int32)
EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)


def token_digest(token_ids: Iterable[int] | np.ndarray) -> str:
    """A trajectory's fingerprint in the run's records (the `microbatch` event's
    `digests`, which outlive its micro-batch file): the first 16 hex digits of the
    SHA-1 of its token ids as little-endian int64."""
    return hashlib.sha1(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:16]


class BadRecord(UserError):
    """One record that cannot be used; `run_id` and `call` are None when unknown."""

    def __init__(self, reason: str, *, run_id: str | None = None, call: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.run_id = run_id
        self.call = call


@dataclass(frozen=True)
class RecordError:
    """Why a record (and so its run) was left out: where it is, whose it is, what is wrong."""

    file: str
    where: str  # "line 12", "offset 4096", or "" for a whole run
    run_id: str | None
    call: int | None
    reason: str
    kind: str = "record"  # "record": bad or inconsistent data; "status": run not ok

    def __str__(self) -> str:
        place = f"{self.file}:{self.where}" if self.where else self.file
        who = f"run {self.run_id!r}" if self.run_id is not None else "unknown run"
        if self.call is not None:
            who += f" call {self.call}"
        return f"{place}: {who}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "call": self.call, "file": self.file,
                "where": self.where, "reason": self.reason, "kind": self.kind}


@dataclass(frozen=True, eq=False)
class CallRecord:
    """One model call with its full prompt (the JSONL form)."""

    run_id: str
    call: int
    prompt_ids: np.ndarray  # int32
    output_ids: np.ndarray  # int32
    output_logprobs: np.ndarray  # float32, one per output id
    policy_version: int
    t_start: float = 0.0
    t_end: float = 0.0
    finish_reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        obj = {
            "run_id": self.run_id, "call": self.call,
            "prompt_ids": self.prompt_ids.tolist(), "output_ids": self.output_ids.tolist(),
            "output_logprobs": f32_list(self.output_logprobs),
            "policy_version": self.policy_version, "t_start": self.t_start,
            "t_end": self.t_end, "finish_reason": self.finish_reason,
        }
        obj.update(self.extra)
        return obj


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    task_id: str
    reward: float
    status: str
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def f32_list(arr: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back to the same float32."""
    return [float(str(x)) for x in np.asarray(arr, dtype=np.float32)]


def _require(cond: bool, reason: str, run_id: str | None, call: int | None) -> None:
    if not cond:
        raise BadRecord(reason, run_id=run_id, call=call)


def id_array(values: Any, *, name: str, vocab_size: int | None = None) -> np.ndarray:
    """A list of token ids as int32, or ValueError saying what is wrong with it."""
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise ValueError(f"{name} must be a list of integers")
    arr = np.asarray(values)
    if arr.size == 0:
        return EMPTY_IDS
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a list of integers")
    check_ids(arr, name=name, vocab_size=vocab_size)
    return arr.astype(np.int32, copy=False)


def check_ids(arr: np.ndarray, *, name: str, vocab_size: int | None = None) -> None:
    """ValueError when an id is negative or not below `vocab_size` (default: 2**31)."""
    if arr.size == 0:
        return
    limit = ID_LIMIT if vocab_size is None else vocab_size
    low, high = int(arr.min()), int(arr.max())
    if low < 0:
        pos = int(np.argmax(arr < 0))
        raise ValueError(f"{name}[{pos}] = {low} is negative")
    if high >= limit:
        pos = int(np.argmax(arr >= limit))
        raise ValueError(f"{name}[{pos}] = {int(arr[pos])} is out of vocab (size {limit})")


LOGPROB_SLACK = 1e-3  # float rounding of a token drawn with probability 1 (log p = 0)


def logprob_array(values: Any, *, name: str) -> np.ndarray:
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise ValueError(f"{name} must be a list of numbers")
    if len(values) == 0:
        return EMPTY_LOGPROBS
    try:
        with np.errstate(over="ignore"):  # past float32's range: inf, refused below
            arr = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers") from None
    except OverflowError:  # an integer past a float's range (JSON has no limit)
        raise ValueError(f"{name} must be a list of finite numbers") from None
    if arr.ndim != 1 or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be a list of finite numbers")
    if arr.max() > LOGPROB_SLACK:  # the importance ratio would divide by a probability > 1
        pos = int(np.argmax(arr > LOGPROB_SLACK))
        raise ValueError(f"{name}[{pos}] = {float(arr[pos]):g} is above 0: a log-probability "
                         f"is at most 0 (the sampler's log p of the token it drew)")
    return arr


def _name_ok(text: str) -> bool:
    """At most MAX_NAME_BYTES of UTF-8, with no lone surrogate (JSON's "\\ud800" decodes
    to one, and no UTF-8 file can hold it)."""
    try:
        return len(text.encode("utf-8")) <= MAX_NAME_BYTES
    except UnicodeEncodeError:
        return False


def _header(obj: Any) -> tuple[str, int]:
    if not isinstance(obj, dict):
        raise BadRecord("a call record must be a JSON object")
    run_id = obj.get("run_id")
    _require(isinstance(run_id, str) and run_id != "", "run_id must be a non-empty string",
             None, None)
    _require(_name_ok(run_id), f"run_id must be at most {MAX_NAME_BYTES:,} bytes of UTF-8 (no "
             f"lone surrogate such as \\ud800)", run_id[:64].encode(
                 "utf-8", "backslashreplace").decode(), None)
    call = obj.get("call")
    _require(is_int(call) and 0 <= call <= MAX_CALL,
             f"call must be an integer from 0 to {MAX_CALL}", run_id, None)
    return run_id, call


def parse_call(obj: Any, *, vocab_size: int | None = None) -> CallRecord:
    """A validated `CallRecord` from a decoded JSON object, or `BadRecord`."""
    run_id, call = _header(obj)
    missing = [k for k in ("prompt_ids", "output_ids", "output_logprobs", "policy_version")
               if k not in obj]
    _require(not missing, f"missing {', '.join(missing)}", run_id, call)
    try:
        prompt = id_array(obj["prompt_ids"], name="prompt_ids", vocab_size=vocab_size)
        output = id_array(obj["output_ids"], name="output_ids", vocab_size=vocab_size)
        logprobs = logprob_array(obj["output_logprobs"], name="output_logprobs")
    except ValueError as exc:
        raise BadRecord(str(exc), run_id=run_id, call=call) from None
    _require(len(output) == len(logprobs),
             f"{len(output)} output_ids but {len(logprobs)} output_logprobs", run_id, call)
    version = obj["policy_version"]
    _require(is_int(version) and 0 <= version <= MAX_VERSION,
             f"policy_version must be an integer from 0 to {MAX_VERSION}", run_id, call)
    times = [obj.get(k, 0.0) for k in ("t_start", "t_end")]
    _require(all(is_finite_number(t) for t in times),
             "t_start and t_end must be finite numbers", run_id, call)
    finish = obj.get("finish_reason", "")
    _require(isinstance(finish, str) and _name_ok(finish),
             f"finish_reason must be a string of at most {MAX_NAME_BYTES:,} bytes of UTF-8 "
             f"(no lone surrogate such as \\ud800)", run_id, call)
    extra = {k: v for k, v in obj.items() if k not in CALL_KEYS}
    return CallRecord(run_id, call, prompt, output, logprobs, version,
                      float(times[0]), float(times[1]), finish, extra)


def parse_run(obj: Any) -> RunRecord:
    """A validated `RunRecord` from a decoded JSON object, or `BadRecord`."""
    if not isinstance(obj, dict):
        raise BadRecord("a run record must be a JSON object")
    run_id = obj.get("run_id")
    _require(isinstance(run_id, str) and run_id != "", "run_id must be a non-empty string",
             None, None)
    status = obj.get("status")
    _require(status in RUN_STATUSES, f"status must be one of {'|'.join(RUN_STATUSES)}",
             run_id, None)
    task_id = obj.get("task_id")
    _require(isinstance(task_id, (str, int)) and not isinstance(task_id, bool),
             "task_id must be a string", run_id, None)
    reward = obj.get("reward", 0.0 if status != "ok" else None)
    _require(is_finite_number(reward), "reward must be a finite number", run_id, None)
    reason = obj.get("reason", obj.get("error", ""))
    extra = {k: v for k, v in obj.items()
             if k not in ("run_id", "task_id", "reward", "status", "reason")}
    return RunRecord(run_id, str(task_id), float(reward), status, str(reason or ""), extra)


_RUN_ID = re.compile(r'"run_id"\s*:\s*"((?:[^"\\]|\\.)*)"')
_CALL = re.compile(r'"call"\s*:\s*(\d+)')


def _peek(line: str) -> tuple[str | None, int | None]:
    """Best effort (run_id, call) of a line that is not valid JSON (e.g. torn)."""
    run = _RUN_ID.search(line)
    call = _CALL.search(line)
    run_id = None
    if run:
        try:
            run_id = json.loads(f'"{run.group(1)}"')
        except json.JSONDecodeError:
            run_id = None
    return run_id, int(call.group(1)) if call else None


def iter_json_lines(lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object or BadRecord) for each non-blank line. A line that is
    not JSON (a torn last line, say) still names its run and call when they can be read,
    so that the run is left out rather than trained without that call."""
    for num, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield num, json.loads(line)
        except json.JSONDecodeError as exc:
            run_id, call = _peek(line)
            yield num, BadRecord(f"not JSON: {exc.msg} at column {exc.colno}",
                                 run_id=run_id, call=call)
        except ValueError as exc:  # an integer past Python's 4,300 digits
            run_id, call = _peek(line)
            yield num, BadRecord(f"not a record: {exc}", run_id=run_id, call=call)
        except RecursionError:  # nested deeper than Python decodes: no record of ours
            run_id, call = _peek(line)
            yield num, BadRecord("not a record: JSON nested too deep to decode",
                                 run_id=run_id, call=call)


T = TypeVar("T")


@dataclass(frozen=True)
class Loaded(Generic[T]):
    """Good runs (calls sorted by call number) and the errors that left the others out."""

    runs: dict[str, list[T]]
    errors: list[RecordError]


class RunCollector(Generic[T]):
    """Groups call-like items by run, checking call numbers: within one file a run's calls
    appear in increasing order; over all files each number appears once and they run
    0..n-1. Any error leaves its whole run out (the other runs are kept)."""

    def __init__(self) -> None:
        self._items: dict[str, list[T]] = {}
        self._seen: dict[str, dict[int, str]] = {}  # run -> call -> "file:where"
        self._last: dict[tuple[str, str], int] = {}  # (run, file) -> last call number
        self._bad: set[str] = set()
        self.errors: list[RecordError] = []

    def error(self, *, file: str, where: str, run_id: str | None, call: int | None,
              reason: str) -> None:
        self.errors.append(RecordError(file, where, run_id, call, reason))
        if run_id is not None:
            self._bad.add(run_id)

    def add(self, item: T, *, run_id: str, call: int, file: str, where: str) -> None:
        seen = self._seen.setdefault(run_id, {})
        if call in seen:
            reason = f"duplicate call number {call} (first at {seen[call]})"
            self.error(file=file, where=where, run_id=run_id, call=call, reason=reason)
            return
        last = self._last.get((run_id, file), -1)
        if call < last:
            reason = f"call {call} comes after call {last}: out of order"
            self.error(file=file, where=where, run_id=run_id, call=call, reason=reason)
        seen[call] = f"{file}:{where}"
        self._last[(run_id, file)] = max(call, last)
        self._items.setdefault(run_id, []).append(item)

    def finish(self, *, call_of: Any) -> Loaded[T]:
        runs: dict[str, list[T]] = {}
        for run_id, items in self._items.items():
            if run_id in self._bad:
                continue
            items = sorted(items, key=call_of)
            gap = next((i for i, it in enumerate(items) if call_of(it) != i), None)
            if gap is not None:
                where = self._seen[run_id][call_of(items[gap])]
                self.error(file=where.rsplit(":", 1)[0], where="", run_id=run_id, call=gap,
                           reason=f"call {gap} is missing (calls must count 0..n-1)")
                continue
            runs[run_id] = items
        return Loaded(runs, self.errors)


def collect_calls(lines: Iterable[str], *, file: str, vocab_size: int | None = None,
                  transform: Callable[[CallRecord], Any] | None = None) -> Loaded[Any]:
    """Parse JSONL call records; bad ones become errors that leave their run out. Each
    good record is kept as `transform(record)` (default: the record itself), applied in
    file order, so a caller can keep a compact form (e.g. `encode.DeltaEncoder.encode`)."""
    collector: RunCollector[Any] = RunCollector()
    for num, obj in iter_json_lines(lines):
        where = f"line {num}"
        try:
            if isinstance(obj, BadRecord):
                raise obj
            rec = parse_call(obj, vocab_size=vocab_size)
        except BadRecord as exc:
            run_id, call = exc.run_id, exc.call
            if run_id is None and isinstance(obj, dict) and isinstance(obj.get("run_id"), str):
                run_id = obj["run_id"]
            collector.error(file=file, where=where, run_id=run_id, call=call,
                            reason=exc.reason)
            continue
        item = rec if transform is None else transform(rec)
        collector.add(item, run_id=rec.run_id, call=rec.call, file=file, where=where)
    return collector.finish(call_of=lambda r: r.call)


def collect_runs(lines: Iterable[str], *, file: str) -> tuple[dict[str, RunRecord],
                                                            list[RecordError]]:
    """Parse JSONL run records: (records by run id, errors). A repeated run id is an
    error and the run is left out."""
    runs: dict[str, RunRecord] = {}
    errors: list[RecordError] = []
    dup: set[str] = set()
    for num, obj in iter_json_lines(lines):
        try:
            if isinstance(obj, BadRecord):
                raise obj
            rec = parse_run(obj)
        except BadRecord as exc:
            errors.append(RecordError(file, f"line {num}", exc.run_id, None, exc.reason))
            continue
        if rec.run_id in runs or rec.run_id in dup:
            errors.append(RecordError(file, f"line {num}", rec.run_id, None,
                                      "duplicate run record"))
            dup.add(rec.run_id)
            runs.pop(rec.run_id, None)
            continue
        runs[rec.run_id] = rec
    return runs, errors

"""Record the suite's per-test durations for the scheduler (tests/schedule.py).

    tools/test --durations=0 -vv ... > LOG      # any run, whole suite or part
    python tools/test_durations.py LOG [LOG...]  # rewrites tests/durations.json

Reads pytest's "slowest durations" lines (`12.34s call tests/x.py::t[p]`), sums setup,
call and teardown per test and merges them into
tests/durations.json: a test in the logs gets its new figure, the others keep theirs
(pytest hides those under 5 ms unless -vv: they count schedule.DEFAULT_S).
Prints the per-file sums, longest first, and the longest-first packing's modelled wall
time on 1-4 workers (a plain list-scheduling model: no start-up, no contention).
"""

from __future__ import annotations

import heapq
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DURATIONS = ROOT / "tests" / "durations.json"
# the node id is the rest of the line: a parametrized id may hold spaces ("[a b]")
LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")


def parse(text: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[m.group(3)] += float(m.group(1))
    return dict(out)


def makespan(costs: list[float], workers: int) -> float:
    """Longest first onto the least-loaded worker (what xdist does with units in order)."""
    loads = [0.0] * workers
    heapq.heapify(loads)
    for c in sorted(costs, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + c)
    return max(loads)


def main(logs: list[str]) -> None:
    from gyre_slurm.errors import UserError

    if not logs or logs[0] in ("-h", "--help"):
        print(__doc__)
        return
    missing = [log for log in logs if not Path(log).is_file()]
    if missing:
        raise UserError(f"no such log: {', '.join(missing)} (give the output of "
                        f"`tools/test --durations=0 -vv`)")
    merged = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    for log in logs:
        merged.update(parse(Path(log).read_text(errors="replace")))
    merged = {k: round(v, 2) for k, v in sorted(merged.items())  # gone files dropped
              if (ROOT / k.split("::", 1)[0]).exists()}
    tmp = DURATIONS.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=0) + "\n")
    tmp.replace(DURATIONS)
    per_file: dict[str, float] = defaultdict(float)
    for nodeid, s in merged.items():
        per_file[nodeid.split("::", 1)[0]] += s
    total = sum(per_file.values())
    print(f"{len(merged)} tests, {total:.0f} s in all, {len(per_file)} files")
    for path, s in sorted(per_file.items(), key=lambda kv: -kv[1])[:20]:
        print(f"{s:8.1f}  {path}")
    for w in (1, 2, 3, 4):
        print(f"files as units, {w} workers: {makespan(list(per_file.values()), w):.0f} s")


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main, sys.argv[1:])

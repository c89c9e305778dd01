"""How the suite's tests are packed onto pytest-xdist workers (a pytest plugin).

`tools/test` runs the whole suite on xdist workers with GYRE_TEST_PACK=1: then xdist hands
each worker one *unit* at a time, in the order below, and a unit never spans two workers.
This plugin decides the units and their order (`tests/conftest.py` imports its hooks):

- A unit is one test file, so that its module fixtures (an engine, a whole `gyre run`
  checked by several tests) are made once; except that a file's tests marked slow and its
  other tests are units apart (the *light* unit: `path#light`), and that in the few files
  whose slow tests take longer than `SPLIT_OVER_S` the slow tests are units of their own.
  Tests that share a module- or class-scoped fixture always stay one unit, in file order.
- The units run longest first (their tests' recorded durations summed, from
  `tests/durations.json`), so that a long file never starts last while the other worker
  idles (longest-processing-time-first packing). `--dist loadfile` alone runs the files
  in xdist's order, by number of tests, which says little here (one `gyre run` outlasts a
  hundred unit tests).
- With GYRE_TEST_HEAVY_WORKERS=H, the workers past the first H take light units (and solo
  ones, below) only, and the first H take the slow ones first. The slow tests are mostly
  waiting on the processes they start (a whole suite used 142% of 2 cores on 2 workers):
  a third worker that runs the unit tests beside them fills the idle core without a third
  engine or cluster competing for memory and CPU (3 workers taking any unit thrashed
  here). The light workers run at nice +10, so that they take the idle core, not the slow
  tests' share. Tests marked both slow and `solo` (all their work in the test's own
  process: no engine, world, cluster or job, e.g. the simulator's property tests) make
  *solo* units: the light workers take them once their light units are done (they idled
  the last ~10 minutes of a suite), the heavy ones only when idle with no other slow
  unit left.

How: each worker orders its collection (`pytest_collection_modifyitems`) and writes the
units it made to a file the controller named (`workerinput`); the controller's scheduler
(`pytest_xdist_make_scheduler`: xdist's loadscope scheduler, without its reorder) reads
the units from it. xdist's own `--dist loadgroup` would carry a unit in each test's node
id, but with pytest 9 (node ids are `Node._id`) xdist 3.8's renaming no longer applies:
the marks were silently ignored.

`tools/test_durations.py LOG` rewrites `tests/durations.json` from a run's
`--durations=0` output (`GYRE_TEST_DURATIONS` names another file). A test it does not
know counts `DEFAULT_S`. Nothing here changes what a test checks or whether it runs: only
where and when.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

DURATIONS = Path(os.environ.get("GYRE_TEST_DURATIONS")
                 or Path(__file__).resolve().parent / "durations.json")
SPLIT_OVER_S = 150.0
DEFAULT_S = 0.5  # also the tests pytest's --durations hides (under 5 ms)
SHARED_SCOPES = ("module", "class", "package")


def _durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def _shared_fixtures(item: pytest.Item) -> set[str]:
    """The module/class/package-scoped fixtures this test uses (session ones are made once
    per worker whatever the packing)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    out = set()
    for name, defs in info.name2fixturedefs.items():
        if defs and defs[-1].scope in SHARED_SCOPES:
            out.add(name)
    return out


def _split_file(items: list[pytest.Item]) -> list[list[pytest.Item]]:
    """A file's tests in units: tests sharing a module/class-scoped fixture together
    (transitively, union-find), each other test alone; in file order."""
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_user: dict[str, int] = {}
    for i, item in enumerate(items):
        for name in _shared_fixtures(item):
            j = first_user.setdefault(name, i)
            parent[find(i)] = find(j)
    units: dict[int, list[pytest.Item]] = defaultdict(list)
    for i, item in enumerate(items):
        units[find(i)].append(item)
    return list(units.values())


def _slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def _kind(group: list[pytest.Item]) -> str:
    """light: no test marked slow; solo: its slow tests are all marked solo too; slow."""
    slow = [it for it in group if _slow(it)]
    if not slow:
        return "light"
    return "solo" if all(it.get_closest_marker("solo") for it in slow) else "slow"


KINDS = ("slow", "solo", "light")


def plan(items: list[pytest.Item], durations: dict[str, float]) -> list[tuple[str, list, str]]:
    """(unit name, items, kind) longest first; a pure function of the collection and
    durations. A unit's kind is `_kind`'s: a file's slow, solo and light tests are units
    apart unless they share a fixture."""
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[item.nodeid.split("::", 1)[0]].append(item)

    def cost(unit: list[pytest.Item]) -> float:
        return sum(durations.get(it.nodeid, DEFAULT_S) for it in unit)

    units: list[tuple[str, list, str]] = []
    for path, file_items in by_file.items():
        groups = _split_file(file_items)
        for kind in KINDS:
            part = [g for g in groups if _kind(g) == kind]
            if not part:
                continue
            name = path if len(part) == len(groups) else f"{path}#{kind}"
            members = {id(it) for g in part for it in g}
            whole = [it for it in file_items if id(it) in members]  # in file order
            if cost(whole) <= SPLIT_OVER_S:
                units.append((name, whole, kind))
            else:
                units.extend((f"{name}#{k}", g, kind) for k, g in enumerate(part))
    units.sort(key=lambda u: -cost(u[1]))  # stable: equal costs keep collection order
    return units


def _packing(config: pytest.Config) -> bool:
    return (os.environ.get("GYRE_TEST_PACK") == "1" and not hasattr(config, "workerinput")
            and config.getvalue("dist") in ("loadfile", "loadscope"))


def _heavy_workers() -> int | None:
    heavy = os.environ.get("GYRE_TEST_HEAVY_WORKERS")
    return int(heavy) if heavy else None


def _is_light_worker(workerid: str, heavy: int | None) -> bool:
    return heavy is not None and int(workerid.removeprefix("gw")) >= heavy


LIGHT_NICE = 10


def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", None)
    if worker and worker.get("gyre_units") and _is_light_worker(worker["workerid"],
                                                                 _heavy_workers()):
        os.nice(LIGHT_NICE)  # it runs on what the slow tests leave idle, not against them
    if _packing(config):
        config._gyre_units = Path(tempfile.mkdtemp(prefix="gyre-units-")) / "units.json"


def pytest_unconfigure(config: pytest.Config) -> None:
    units = getattr(config, "_gyre_units", None)
    if units is not None:
        shutil.rmtree(units.parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest -p no:xdist must still run
def pytest_configure_node(node) -> None:  # the controller, before a worker starts
    units = getattr(node.config, "_gyre_units", None)
    if units is not None:
        node.workerinput["gyre_units"] = str(units)


class PackedScheduling(LoadScopeScheduling):
    """xdist's loadscope scheduler, its scopes being the units the workers wrote; the
    workers past the first `heavy` take light units, then solo ones (none of the other
    slow tests, which start engines, worlds and clusters), and the others prefer the slow
    units that are not solo."""

    def __init__(self, config: pytest.Config, log, units: Path, heavy: int | None) -> None:
        super().__init__(config, log)
        self._units_file, self._units = units, None
        self._kinds: dict[str, str] = {}
        self._heavy = heavy

    def _read_units(self) -> None:
        if self._units is None:  # read once all workers have collected (and written it)
            data = json.loads(self._units_file.read_text())
            self._units = data["units"]
            self._kinds = data["kinds"]

    def _first(self, kind: str) -> str | None:
        """The first unit in the queue of `kind` (one of KINDS)."""
        return next((s for s in self.workqueue if self._kinds.get(s, "slow") == kind), None)

    def _split_scope(self, nodeid: str) -> str:
        self._read_units()
        return self._units.get(nodeid) or nodeid.split("::", 1)[0]

    def _light_only(self, node) -> bool:
        return _is_light_worker(node.workerinput["workerid"], self._heavy)

    def _has_light_workers(self) -> bool:
        return self._heavy is not None and len(self.nodes) > self._heavy

    def _next_scope(self, node) -> str | None:
        """The unit `node` takes next, in the queue's order: a light worker the first light
        unit, or once none is left the first solo one; a heavy worker the first slow unit
        that is not solo, or once none is left and only when idle (not as the next unit it
        queues), the first unit of any kind. None: nothing for it now."""
        self._read_units()
        if not self._has_light_workers():
            return next(iter(self.workqueue))
        if self._light_only(node):
            return self._first("light") or self._first("solo")
        heavy = self._first("slow")
        if heavy is not None or self._pending_of(self.assigned_work.get(node, {})):
            return heavy
        return next(iter(self.workqueue))

    def _assign_work_unit(self, node) -> None:
        scope = self._next_scope(node)
        if scope is None:  # a light worker with no light or solo unit left is done
            if self._light_only(node) and not self._pending_of(self.assigned_work.get(node, {})):
                node.shutdown()
            return
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    units = getattr(config, "_gyre_units", None)
    if units is None:
        return None
    config.option.loadscopereorder = False  # our order, not xdist's by number of tests
    return PackedScheduling(config, log, units, _heavy_workers())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = getattr(config, "workerinput", {}).get("gyre_units")
    if not path:
        return
    ordered, names, kinds = [], {}, {}
    for name, unit, kind in plan(items, _durations()):
        for item in unit:
            ordered.append(item)
            names[item.nodeid] = name
        kinds[name] = kind
    items[:] = ordered
    tmp = Path(f"{path}.{os.getpid()}.tmp")  # every worker writes the same: atomic
    tmp.write_text(json.dumps({"units": names, "kinds": kinds}))
    tmp.replace(path)

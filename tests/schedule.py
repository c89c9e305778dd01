"""How the suite's tests are packed onto pytest-xdist workers (a pytest plugin).

`tools/test` runs the whole suite on xdist workers with GYRE_TEST_PACK=1: then xdist hands
each worker one *unit* at a time, in the order below, and a unit never spans two workers.
This plugin decides the units and their order (`tests/conftest.py` imports its hooks):

- A unit is one test file, so that its module fixtures (an engine, a whole `gyre run`
  checked by several tests) are made once; except in the few files that take longer than
  `SPLIT_OVER_S` on their own, which are split into their tests, keeping together the
  tests that share a module- or class-scoped fixture (they stay one unit, in file order).
- The units run longest first (their tests' recorded durations summed, from
  `tests/durations.json`), so that a long file never starts last while the other worker
  idles (longest-processing-time-first packing). `--dist loadfile` alone runs the files
  in xdist's order, by number of tests, which says little here (one `gyre run` outlasts a
  hundred unit tests).

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


def plan(items: list[pytest.Item], durations: dict[str, float]) -> list[tuple[str, list]]:
    """(unit name, items) longest first; a pure function of the collection and durations."""
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[item.nodeid.split("::", 1)[0]].append(item)

    def cost(unit: list[pytest.Item]) -> float:
        return sum(durations.get(it.nodeid, DEFAULT_S) for it in unit)

    units: list[tuple[str, list]] = []
    for path, file_items in by_file.items():
        if cost(file_items) <= SPLIT_OVER_S:
            units.append((path, file_items))
            continue
        for k, unit in enumerate(_split_file(file_items)):
            units.append((f"{path}#{k}", unit))
    units.sort(key=lambda u: -cost(u[1]))  # stable: equal costs keep collection order
    return units


def _packing(config: pytest.Config) -> bool:
    return (os.environ.get("GYRE_TEST_PACK") == "1" and not hasattr(config, "workerinput")
            and config.getvalue("dist") in ("loadfile", "loadscope"))


def pytest_configure(config: pytest.Config) -> None:
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
    """xdist's loadscope scheduler, its scopes being the units the workers wrote."""

    def __init__(self, config: pytest.Config, log, units: Path) -> None:
        super().__init__(config, log)
        self._units_file, self._units = units, None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:  # read once all workers have collected (and written it)
            self._units = json.loads(self._units_file.read_text())
        return self._units.get(nodeid) or nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    units = getattr(config, "_gyre_units", None)
    if units is None:
        return None
    config.option.loadscopereorder = False  # our order, not xdist's by number of tests
    return PackedScheduling(config, log, units)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = getattr(config, "workerinput", {}).get("gyre_units")
    if not path:
        return
    ordered, names = [], {}
    for name, unit in plan(items, _durations()):
        for item in unit:
            ordered.append(item)
            names[item.nodeid] = name
    items[:] = ordered
    tmp = Path(f"{path}.{os.getpid()}.tmp")  # both workers write the same: atomic
    tmp.write_text(json.dumps(names))
    tmp.replace(path)

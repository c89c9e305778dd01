"""CI runs every tier: under CI a skipped test is a failed one (a pytest plugin).

`tests/conftest.py` imports these hooks. CI mode is the environment variable `CI` set to
anything but "", "0", "false" or "no" (`.ci/run` sets it). Outside CI a skip stays a skip
(pytest's `-ra` summary says why), for machines that cannot run a tier (not root: no local
Slurm cluster).

A tier's availability is decided at run time, in a fixture or the test itself, after
whatever the run installs (the Slurm packages, bubblewrap, tmux, the engines'
environments): never by a collection-time `skipif` or `importorskip`, which the first run
on a fresh machine would evaluate before it installs anything (`test_skip_policy.py`
checks the test files for them).
"""

from __future__ import annotations

import os

import pytest

CI_OFF = ("", "0", "false", "no")


def ci_mode() -> bool:
    return os.environ.get("CI", "").strip().lower() not in CI_OFF


def _fail_skip(rep, what: str) -> None:
    longrepr = rep.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
    rep.outcome = "failed"
    rep.longrepr = (f"{what} was skipped under CI, where every tier must run "
                    f"(skip reason: {reason}); make the machine able to run it, or fix the "
                    "test's availability check")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.skipped and not hasattr(rep, "wasxfail") and ci_mode():
        _fail_skip(rep, item.nodeid)
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    if rep.skipped and ci_mode():  # a module-level skip or importorskip
        _fail_skip(rep, collector.nodeid)
    return rep

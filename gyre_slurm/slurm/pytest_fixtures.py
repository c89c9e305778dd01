"""Pytest fixture logic for the Slurm test tier: one real local cluster per test session.

`slurm_cluster(request)` is a generator to wrap in a session-scoped fixture:

    @pytest.fixture(scope="session")
    def slurm_cluster(request):
        from gyre_slurm.slurm import pytest_fixtures
        yield from pytest_fixtures.slurm_cluster(request)

It yields a running `LocalCluster` (4 nodes, state dir `$GYRE_SLURM_STATE` or
/tmp/gyre-localslurm; run commands with `env=cluster.env()`). Where the machine cannot run it
(not root, no unshare, no packages and no apt-get) the tests are skipped, except when `CI` is
set: then they fail, because CI must run the Slurm tier.

Each test: `ensure_up(cluster)`, called before every test that uses the cluster (an autouse
fixture in the suite's conftest), starts again a slurmd that stopped during an earlier test
(Debian's slurmd 22.05.8 can abort when batch jobs launch at once on a node), so one crash
does not fail the tests after it.

Sharing: a cluster already up in the state dir (started by `tools/localslurm up` or by another
test session) is reused. Each session holds a shared flock on STATE/users.lock while it runs;
at its end, the session that can take that lock exclusively (the last user) stops the cluster,
but only if a test session started it (STATE/run/owner is "pytest"): a cluster a person
started by hand is left running.
"""
from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator

import pytest

from gyre_slurm.slurm.localcluster import LocalCluster, default_state_dir

log = logging.getLogger(__name__)

OWNER = "pytest"
UP_TIMEOUT_S = 60.0


def _usable_cluster() -> LocalCluster:
    cluster = LocalCluster(default_state_dir(), num_nodes=4)
    ok, reason = cluster.can_run()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tier, but this machine cannot: {reason}",
                        pytrace=False)
        pytest.skip(f"no local Slurm cluster: {reason}")
    return cluster


def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """Start (or reuse) the local cluster for this session; stop it at the end if we were
    its last user and a test session started it. `request` is unused (fixture signature)."""
    del request
    cluster = _usable_cluster()
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    owner_file = cluster.state_dir / "run" / "owner"
    with open(cluster.state_dir / "users.lock", "a") as users:
        fcntl.flock(users, fcntl.LOCK_SH)
        try:
            ensure_up(cluster)
            yield cluster
        finally:
            fcntl.flock(users, fcntl.LOCK_UN)
            _stop_if_last(cluster, users, owner_file)


def ensure_up(cluster: LocalCluster) -> None:
    """Start the cluster if it is down (then this session owns it), or start again each
    slurmd that stopped; a running, whole cluster is left as it is."""
    if cluster.up(timeout_s=UP_TIMEOUT_S):
        (cluster.state_dir / "run" / "owner").write_text(OWNER + "\n")
    elif cluster.restarted:
        log.warning("slurmd had stopped on %s: started it again", ",".join(cluster.restarted))


def _stop_if_last(cluster: LocalCluster, users, owner_file) -> None:
    try:
        fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("local Slurm cluster still used by another test session: left running")
        return
    try:
        owner = owner_file.read_text().strip() if owner_file.exists() else ""
        if owner == OWNER:
            cluster.down()
        else:
            log.info("local Slurm cluster was started by hand: left running")
    finally:
        fcntl.flock(users, fcntl.LOCK_UN)

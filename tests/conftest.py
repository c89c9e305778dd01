import os
import subprocess
import sys
from pathlib import Path

import pytest

# Under CI a skip is a failure (see skip_policy.py).
from skip_policy import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401
# Under tools/test's xdist workers: the units and their order (see schedule.py).
from schedule import (pytest_collection_modifyitems, pytest_configure,  # noqa: F401
                      pytest_configure_node, pytest_unconfigure, pytest_xdist_make_scheduler)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gyre():
    """Run the real `gyre` command (a subprocess, as a user would)."""

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        # wide: rich would wrap (or cut) lines at 140 columns, and the checks read whole
        # lines wherever pytest's temp dir is (xdist's workers add popen-gwN/ to it)
        env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="1000")
        proc = subprocess.run([sys.executable, "-m", "gyre_slurm", *args], env=env,
                              capture_output=True, text=True, timeout=600)
        if check and proc.returncode != 0:
            raise AssertionError(f"gyre {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    return run


@pytest.fixture(scope="session")
def slurm_cluster(request):
    """A real local Slurm cluster (tools/localslurm), started once per test session."""
    from gyre_slurm.slurm import pytest_fixtures

    yield from pytest_fixtures.slurm_cluster(request)


@pytest.fixture(autouse=True)
def _slurm_cluster_whole(request):
    """Before each test on the local Slurm cluster: a slurmd that stopped during an earlier
    test (slurmd 22.05.8 can abort when jobs launch at once on a node) is started again."""
    if "slurm_cluster" in request.fixturenames:
        from gyre_slurm.slurm import pytest_fixtures

        pytest_fixtures.ensure_up(request.getfixturevalue("slurm_cluster"))


def _role_python(role: str) -> str:
    """The interpreter of a role's environment, built on first use (tools/role-env):
    never skipped, so CI exercises the real engines."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([str(root / "tools" / "role-env"), role], capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"tools/role-env {role} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_python():
    return _role_python("vllm")


@pytest.fixture(scope="session")
def megatron_python():
    return _role_python("megatron")


@pytest.fixture(scope="session")
def minisweagent_python():
    return _role_python("minisweagent")


@pytest.fixture(scope="session")
def clients_python():
    """The client libraries' environment (openai, openai-agents, langchain-openai,
    pydantic-ai, litellm): tools/role-env clients."""
    return _role_python("clients")


@pytest.fixture(scope="session")
def verifiers_python():
    """The verifiers library's environment: tools/role-env verifiers."""
    return _role_python("verifiers")

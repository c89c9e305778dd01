"""coordinator.both: the layout starts the rollout servers and builds the first training
world at once; one failing cancels the other, and its own error comes out as it is (the
coordinator's `explain` reads AgentUnreachable, which an ExceptionGroup would hide)."""

from __future__ import annotations

import asyncio

import pytest

from gyre_slurm.runtime.control import AgentUnreachable
from gyre_slurm.runtime.coordinator import both


def test_both_runs_at_once_and_returns_in_order():
    async def after(s: float, value):
        await asyncio.sleep(s)
        return value

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await both(after(0.2, "engines"), after(0.2, "world"))
        return got, loop.time() - t0

    got, took = asyncio.run(main())
    assert got == ("engines", "world")
    assert took < 0.35  # concurrently, not 0.4 s one after the other


def test_a_failure_cancels_the_other_and_is_raised_as_it_is():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def fails():
        await asyncio.sleep(0.05)
        raise AgentUnreachable("node agent 2 is gone", node=2)

    with pytest.raises(AgentUnreachable) as err:
        asyncio.run(asyncio.wait_for(both(slow(), fails()), 5))
    assert err.value.node == 2 and cancelled == [True]

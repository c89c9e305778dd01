"""Engine commands on one node interleave safely (runtime.node_engines): a real node agent
with real embedded engines; a restart is made slow by a real delay in the new engine
process's start (GYRE_TEST_ENGINE_START_DELAY_FILE), and other commands arrive while it
runs: a handoff to training (release), the job's end (shutdown), a second fault (a second
restart of the same server, a kill of the node's engines)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from gyre_slurm.config.schema import load_config
from gyre_slurm.engines import EngineClient
from gyre_slurm.engines.embedded import START_DELAY_ENV
from gyre_slurm.errors import UserError
from gyre_slurm.runtime.agent import NodeAgent
from gyre_slurm.runtime.control import AgentRefused, CommandError, ControlClient, make_app
from gyre_slurm.runtime.coordinator import Coordinator
from gyre_slurm.runtime.node_engines import BadEngineCommand, EnginesClosed
from gyre_slurm.runtime.roles import resolve_roles

ROOT = Path(__file__).resolve().parent.parent
SLOW = "slow start for a test"


@pytest.fixture
def agent_env(tmp_path, monkeypatch):
    """A run dir made as `gyre run` makes it, the delay file (absent: no delay), and a
    factory of node agents on 127.0.10.1 (never registered: the test is their
    coordinator)."""
    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["cluster.num_nodes=2"])
    Coordinator(cfg, run_dir).prepare_run_dir()
    resolve_roles(cfg, run_dir)
    delay = tmp_path / "start-delay-s"
    monkeypatch.setenv(START_DELAY_ENV, str(delay))

    def make() -> NodeAgent:
        return NodeAgent(run_dir=run_dir, node_index=0, addr="127.0.10.1",
                         coordinator_url="http://127.0.10.1:9")

    return run_dir, delay, make


def engine_pids(run_dir: Path) -> set[int]:
    """Live embedded engine processes of this run (their command line names its model)."""
    pids = set()
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"gyre_slurm.engines.embedded" in cmd and str(run_dir).encode() in b" ".join(cmd) \
                and state != "Z":
            pids.add(int(d.name))
    return pids


async def slow_starts(run_dir: Path, count: int, timeout_s: float = 60.0) -> None:
    """Wait until `count` engine starts of node 0 have begun their test delay."""
    log = run_dir / "logs" / "engine-node0-s0.log"
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and log.read_text().count(SLOW) >= count):
        assert time.monotonic() < deadline, f"no slow start #{count} in {log}"
        await asyncio.sleep(0.05)


async def health(agent: NodeAgent, url: str) -> dict:
    client = EngineClient(url, agent.secret)
    try:
        return await client.health(timeout_s=10)
    finally:
        await client.close()


async def no_engine_left(run_dir: Path, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine_pids(run_dir):
        assert time.monotonic() < deadline, f"engines left: {engine_pids(run_dir)}"
        await asyncio.sleep(0.1)


@pytest.mark.slow
def test_a_handoff_to_training_waits_for_a_restart_and_releases_the_new_engine(agent_env):
    run_dir, delay, make = agent_env

    async def main():
        agent = make()
        try:
            url0 = (await agent.cmd_start_engine(version=0))["base_urls"][0]
            delay.write_text("2")
            done: list[str] = []

            async def command(name, coro):
                res = await coro
                done.append(name)
                return res

            restart = asyncio.create_task(command("restart", agent.cmd_restart_engine(
                server=0, version=0, base_url=url0)))
            await slow_starts(run_dir, 1)
            release = await command("release", agent.cmd_release_engine())
            res = await restart
            assert done == ["restart", "release"]  # one engine command at a time
            assert res["restarted"] and res["base_url"] != url0 and res["exit_code"] != 0, res
            assert release["killed"] is None, release  # the new engine was released
            assert (await health(agent, res["base_url"]))["status"] == "released"
            assert engine_pids(run_dir) == {res["pid"]}  # the old one is gone
            delay.unlink()
            again = await agent.cmd_start_engine(version=0)  # the next rollout resumes it
            assert again["base_urls"] == [res["base_url"]] and not again["replaced"], again
            assert (await health(agent, res["base_url"]))["status"] == "ok"
        finally:
            await agent.shutdown_engine()
        await no_engine_left(run_dir)

    asyncio.run(main())


@pytest.mark.slow
def test_the_job_ending_during_a_restart_cancels_it_and_leaves_no_engine(agent_env):
    run_dir, delay, make = agent_env

    async def main():
        agent = make()
        url0 = (await agent.cmd_start_engine(version=0))["base_urls"][0]
        delay.write_text("60")  # the new engine would serve only in a minute
        restart = asyncio.create_task(agent.cmd_restart_engine(server=0, version=0,
                                                               base_url=url0))
        await slow_starts(run_dir, 1)
        t0 = time.monotonic()
        await agent.shutdown_engine()  # what the agent does when the job stops
        res = await restart
        assert time.monotonic() - t0 < 20, "the shutdown waited for the slow start"
        assert not res["restarted"] and "shutting down" in res["reason"], res
        await no_engine_left(run_dir)
        with pytest.raises(EnginesClosed):  # nothing starts after the shutdown
            await agent.cmd_start_engine(version=0)
        await no_engine_left(run_dir)

    asyncio.run(main())


@pytest.mark.slow
def test_a_second_fault_during_a_restart_is_answered_plainly(agent_env):
    run_dir, delay, make = agent_env

    async def main():
        agent = make()
        try:
            url0 = (await agent.cmd_start_engine(version=0))["base_urls"][0]
            # the same server reported twice: the second restart finds it replaced
            delay.write_text("2")
            first = asyncio.create_task(agent.cmd_restart_engine(server=0, version=0,
                                                                 base_url=url0))
            await slow_starts(run_dir, 1)
            second = await agent.cmd_restart_engine(server=0, version=0, base_url=url0)
            res = await first
            assert res["restarted"], res
            assert not second["restarted"] and "already replaced" in second["reason"], second
            assert (await health(agent, res["base_url"]))["status"] == "ok"
            # the node's engines killed (a drain's hung engine) during a restart
            delay.write_text("60")
            third = asyncio.create_task(agent.cmd_restart_engine(
                server=0, version=0, base_url=res["base_url"]))
            await slow_starts(run_dir, 2)
            t0 = time.monotonic()
            killed = await agent.cmd_kill_engines(reason="hung while draining")
            out = await third
            assert time.monotonic() - t0 < 20, "the kill waited for the slow start"
            assert not out["restarted"] and "hung while draining" in out["reason"], out
            assert len(killed["exit_codes"]) == 1, killed
            await no_engine_left(run_dir)
            gone = await agent.cmd_restart_engine(server=0, version=0)
            assert not gone["restarted"] and "no engine server 0" in gone["reason"], gone
            with pytest.raises(BadEngineCommand):
                await agent.cmd_restart_engine(server=1, version=0)
            delay.unlink()
            fresh = await agent.cmd_start_engine(version=0)  # the next rollout: new ones
            assert (await health(agent, fresh["base_urls"][0]))["status"] == "ok"
            assert len(engine_pids(run_dir)) == 1
        finally:
            await agent.shutdown_engine()
        await no_engine_left(run_dir)

    asyncio.run(main())


async def serve_commands(agent: NodeAgent) -> tuple[web.AppRunner, str]:
    """The agent's command routes on 127.0.10.1 (as `serve` has them, without registering
    with a coordinator: the test is its coordinator); the runner and the URL."""
    app = make_app(agent.secret)
    app.router.add_post("/cmd/{name}", agent.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.10.1", 0)
    await site.start()
    return runner, f"http://127.0.10.1:{site._server.sockets[0].getsockname()[1]}"


def test_engine_commands_over_the_control_channel_say_what_was_wrong(agent_env):
    """A restart of a server the node can never run is the client's mistake (400); a
    start the run dir cannot serve (a roles.json naming a container without a Slurm
    job) is the user's to fix (422: `AgentRefused`, a UserError naming the node, which
    ends the job without a traceback; it was a 500); a command after the shutdown is
    refused (503); none is a server failure (500)."""
    run_dir, _, make = agent_env

    async def main():
        roles_file = run_dir / "roles.json"
        good = roles_file.read_text()
        written = json.loads(good)
        written["rollout"]["container_image"] = "img.sqsh"
        roles_file.write_text(json.dumps(written))
        refusing = make()
        roles_file.write_text(good)
        agent = make()
        runner, url = await serve_commands(agent)
        client = ControlClient(url, agent.secret, timeout_s=30)
        refused_runner, refused_url = await serve_commands(refusing)
        node0 = ControlClient(refused_url, agent.secret, node=0)
        try:
            with pytest.raises(AgentRefused, match=r"node agent 0 \(/cmd/start_engine\): "
                                                   r"container_image 'img.sqsh' .*Slurm job") \
                    as refusal:
                await node0.post("/cmd/start_engine", {"version": 0})
            assert isinstance(refusal.value, UserError)  # the CLI's plain error, exit 2
            assert isinstance(refusal.value, CommandError)  # recovery's retry or fail
            assert not engine_pids(run_dir)
            with pytest.raises(CommandError, match=r"400 .*not server 7"):
                await client.post("/cmd/restart_engine", {"server": 7, "version": 0})
            await agent.shutdown_engine()
            with pytest.raises(CommandError, match=r"503 .*shutting down"):
                await client.post("/cmd/start_engine", {"version": 0})
        finally:
            await client.close()
            await node0.close()
            await runner.cleanup()
            await refused_runner.cleanup()
            await refusing.shutdown_engine()

    asyncio.run(main())


def test_a_restart_answer_goes_to_the_gateway_only_while_the_cell_serves_with_it(tmp_path):
    """The coordinator's side: a restarted engine whose cell was handed to training (or
    whose server was replaced) meanwhile is not put back into the gateway."""
    from gyre_slurm.runtime.job import JobState, ServerId
    from gyre_slurm.runtime.recovery import Recovery
    from gyre_slurm.sched.cells import Role

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [])
    coord = Coordinator(cfg, tmp_path / "run")
    coord.rd.create(cfg)
    job: JobState = coord.job
    recovery = Recovery(job=job, world=None, gateway=None, agents={}, launcher=None,
                        started_from=None)
    old, sid = object(), ServerId(cell=2, node=2, index=0)
    answer = {"restarted": True, "base_url": "http://x"}
    job.engine_clients = {2: {sid: old}}
    assert recovery.restart_serves(2, sid, old, answer)
    job.engine_clients = {2: {sid: object()}}  # replaced meanwhile
    assert not recovery.restart_serves(2, sid, old, answer)
    job.engine_clients = {2: {sid: old}}
    job.table.begin_handoff(2, Role.TRAIN, now_s=1.0)  # handed to training meanwhile
    assert not recovery.restart_serves(2, sid, old, answer)
    lines = (coord.rd.path / "events.jsonl").read_text().splitlines()
    dropped = [e for e in map(json.loads, lines) if e["kind"] == "engine_restart_dropped"]
    assert [(e["server"], e["reason"]) for e in dropped] == [
        ("cell2-n2-s0", "the server was replaced meanwhile"),
        ("cell2-n2-s0", "the cell is draining now, no longer serving")], dropped

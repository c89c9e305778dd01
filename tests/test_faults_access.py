"""Faults: who can reach a run's servers, and what a bad request gets.

In-process first (cheap): the gateway and a control-channel app answer every malformed,
oversized, half-sent or unauthenticated request with a 4xx (never a 500 or a hang) and go
on serving. Then a REAL run (`gyre run` on the local launcher, real node agents, engines,
gateway): while it runs, its gateway, one node agent's control port and the coordinator's
control port are attacked with the same requests; the run's servers listen only on its
nodes' addresses; the secret is on no command line and in no other file; the model's
state is owner-only even under umask 0; and the run finishes every step, nothing lost.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from faults import wait_for
from aiohttp import web

from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.gateway import Gateway
from gyre_slurm.models import tiny
from gyre_slurm.runtime import control
from gyre_slurm.traj.store import CallStoreWriter
from runtime_checks import check_run_dir
from test_runtime_e2e import FAST, ROOT

KEY = "s3cret"
CHAT = "/runs/r1/v1/chat/completions"
HELLO = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
JSON = "application/json"


def _body(obj) -> bytes:
    return json.dumps(obj).encode()


# (name, path, content type, body, status) sent WITH the key; the path None = the route's own
BAD_BODIES = [
    ("text/plain", None, "text/plain", _body(HELLO), 415),
    ("form", None, "application/x-www-form-urlencoded", b"a=1", 415),
    ("malformed", None, JSON, b'{"messages": [', 400),
    ("NaN", None, JSON, b'{"messages": [], "temperature": NaN}', 400),
    ("deep", None, JSON, b"[" * 200_000 + b"]" * 200_000, 400),
    ("latin-1", None, JSON, '{"messages": "h\xe9"}'.encode("latin-1"), 400),
    ("surrogate", None, JSON, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("array", None, JSON, b"[1, 2]", 400),
    ("huge-int", None, JSON, b'{"n": ' + b"9" * 5000 + b"}", 400),
]
GATEWAY_BAD = BAD_BODIES + [
    ("messages-type", None, JSON, _body({"messages": 5}), 400),
    ("temperature-type", None, JSON, _body({**HELLO, "temperature": "hot"}), 400),
    ("huge-max_tokens", None, JSON, _body({**HELLO, "max_tokens": 10 ** 9}), 400),
    ("negative-n", None, JSON, _body({**HELLO, "n": -1}), 400),
    ("huge-seed", None, JSON, _body({**HELLO, "seed": 10 ** 30}), 400),
    ("bad-run-id", "/runs/a%20b/v1/chat/completions", JSON, _body(HELLO), 400),
    ("over-cap", None, JSON, b'{"x": "' + b"a" * (5 << 20) + b'"}', 413),
]
AGENT_BAD = BAD_BODIES + [
    ("arg-type", None, JSON, _body({"version": "seven"}), 400),
    ("arg-float", None, JSON, b'{"version": 1e400}', 400),
    ("arg-inf", None, JSON, b'{"version": 1, "backoff_s": 1e400}', 400),
    ("arg-huge", None, JSON, b'{"version": 1, "backoff_s": 1' + b"0" * 400 + b"}", 400),
    ("arg-missing", None, JSON, b"{}", 400),
    ("arg-unknown", None, JSON, _body({"version": 1, "rm": "-rf"}), 400),
    ("no-command", "/cmd/nope", JSON, b"{}", 404),
    ("over-cap", None, JSON, b'{"x": "' + b"a" * (2 << 20) + b'"}', 413),
]


async def attack(base: str, route: str, table, *, key: str) -> dict[str, int]:
    """Every request of `table` plus the unauthenticated ones; name -> status."""
    out = {}
    async with aiohttp.ClientSession() as http:
        for name, path, ctype, body, _ in table:
            async with http.post(base + (path or route), data=body, headers={
                    "Content-Type": ctype, "Authorization": f"Bearer {key}"}) as r:
                out[name] = r.status
                assert r.status == 413 or "error" in await r.json(content_type=None)
        async with http.post(base + route, data=b"{}", headers={"Content-Type": JSON}) as r:
            out["no-key"] = r.status
        async with http.post(base + route, data=b"{}", headers={
                "Content-Type": JSON, "Authorization": f"Bearer {key}x"}) as r:
            out["wrong-key"] = r.status
        async with http.get(base + route, headers={"Authorization": f"Bearer {key}"}) as r:
            out["GET"] = r.status
    return out


def expected(table) -> dict[str, int]:
    return {**{name: status for name, _, _, _, status in table},
            "no-key": 401, "wrong-key": 401, "GET": 405}


async def raw(host: str, port: int, data: bytes, *, eof: bool = False,
              wait_s: float = 20.0) -> tuple[bytes | None, float]:
    """Send raw bytes (a half request); (the first bytes that came back, b"" if the server
    closed the connection, None if it kept it open for `wait_s`; the time it took)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    if eof:
        writer.write_eof()
    try:
        got = await asyncio.wait_for(reader.read(1 << 16), wait_s)
    except asyncio.TimeoutError:
        got = None
    finally:
        writer.close()
    return got, time.monotonic() - t0


def half_requests(path: str, key: str) -> dict[str, bytes]:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    return {"half-body": head + b'{"mess', "half-headers": head[:40],
            "garbage": b"\xff\xfe\x00 not http\r\n\r\n"}


def status_of(response: bytes | None) -> int | str | None:
    if response is None:
        return "open"
    m = re.match(rb"HTTP/1\.[01] (\d{3})", response)
    return int(m[1]) if m else None


async def half_attack(host: str, port: int, path: str, key: str, good) -> dict:
    """The half requests, concurrently; while they hang, `good()` must still answer."""
    reqs = half_requests(path, key)
    tasks = {name: asyncio.create_task(raw(host, port, data)) for name, data in reqs.items()}
    tasks["truncated"] = asyncio.create_task(raw(host, port, reqs["half-body"], eof=True))
    await asyncio.sleep(0.3)
    good_status = await good()  # served while the half requests are open
    out = {name: await t for name, t in tasks.items()}
    return {"good": good_status, **{n: (status_of(r), s) for n, (r, s) in out.items()}}


def check_half(out: dict, *, body_timeout_s: float, idle_timeout_s: float | None) -> None:
    """`idle_timeout_s` None: too long to wait for (the half-headers connection may still
    be open; what matters is that `good` was served meanwhile)."""
    assert out["half-body"][0] == 408 and out["half-body"][1] < body_timeout_s + 5, out
    if idle_timeout_s is not None:  # closed, with nothing to answer
        assert out["half-headers"][0] is None and out["half-headers"][1] < idle_timeout_s + 5
    assert out["garbage"][0] == 400, out
    assert out["truncated"][0] in (None, 400)  # the client left: nothing to answer, no 500


# -- in process ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_model_dir(tmp_path_factory.mktemp("model") / "m")


def test_gateway_refuses_bad_requests_and_keeps_serving(model_dir, tmp_path):
    async def main():
        writer = CallStoreWriter(tmp_path, "gateway")
        gw = Gateway(model_dir=model_dir, call_writer=writer,
                     wait_for_server_s=0.1, body_timeout_s=1.0, idle_timeout_s=2.0)
        port = await gw.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        key = gw.open_run("r1")  # the run's own key

        async def good():  # a well-formed call: no server in this test, so a clean 503
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as h:
                async with h.get(f"{base}/runs/r1/v1/models") as r:
                    assert r.status == 200
                async with h.post(base + CHAT, json=HELLO) as r:
                    return r.status
        try:
            statuses = await attack(base, CHAT, GATEWAY_BAD, key=key)
            async with aiohttp.ClientSession() as anon:
                async with anon.get(f"{base}/runs/r1/v1/models") as r:
                    statuses["models-no-key"] = r.status
            half = await half_attack("127.0.0.1", port, CHAT, key, good)
            return statuses, half, await good()
        finally:
            await gw.stop()
            writer.close()
    statuses, half, after = asyncio.run(main())
    assert statuses == {**expected(GATEWAY_BAD), "models-no-key": 401}
    assert half["good"] == 503 and after == 503
    check_half(half, body_timeout_s=1.0, idle_timeout_s=2.0)


class Commands:
    """A control-channel server's commands, served the way the node agent serves them."""

    def __init__(self):
        self.calls = []

    async def handle(self, request):
        name = request.match_info["name"]
        fn = getattr(self, f"cmd_{name}", None)
        if fn is None:
            return web.json_response({"error": "unknown"}, status=404)
        payload = await request.json() if request.can_read_body else {}
        return web.json_response(await fn(**payload))

    async def cmd_start_engine(self, *, version: int, backoff_s: float = 0.0) -> dict:
        self.calls.append(version)
        return {"version": version}


def test_control_channel_checks_bodies_before_commands(monkeypatch):
    monkeypatch.setattr(control, "BODY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(control, "IDLE_TIMEOUT_S", 2.0)

    async def main():
        target = Commands()
        app = control.make_app(KEY)
        app.router.add_post("/cmd/{name}", target.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        base = f"http://127.0.0.1:{port}"
        client = control.ControlClient(base, KEY)

        async def good():
            return (await client.post("/cmd/start_engine", {"version": 3}))["version"]
        try:
            statuses = await attack(base, "/cmd/start_engine", AGENT_BAD, key=KEY)
            half = await half_attack("127.0.0.1", port, "/cmd/start_engine", KEY, good)
            return statuses, half, target.calls
        finally:
            await client.close()
            await runner.cleanup()
    statuses, half, calls = asyncio.run(main())
    assert statuses == expected(AGENT_BAD)
    assert half["good"] == 3 and calls == [3]  # no refused request reached the command
    check_half(half, body_timeout_s=1.0, idle_timeout_s=2.0)


# -- a real run -----------------------------------------------------------------------
def descendants(pid: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            pass
    out, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in out]
        out.update(kids)
        frontier += kids
    return out


def listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by `pids`."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
                if m:
                    inodes.add(m[1])
        except OSError:
            pass
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                hexaddr, port = f[1].split(":")
                raw = bytes.fromhex(hexaddr)
                addr = ".".join(str(b) for b in raw[::-1]) if len(raw) == 4 else raw.hex()
                out.add((addr, int(port, 16)))
    return out


@pytest.mark.slow
def test_attacks_on_a_live_run_get_4xx_and_lose_nothing(tmp_path):
    run_dir, err = tmp_path / "run", tmp_path / "gyre.err"
    args = [sys.executable, "-m", "gyre_slurm", "run", str(ROOT / "configs" / "tiny.yaml"),
            "--run-dir", str(run_dir)]
    # colocate with the `wait` drain: an external run that stays registered must not
    # hold the drain (every cell would wait for it forever). Two nodes: the attacks need
    # one node agent, and the run starts half the processes of four
    for item in FAST + ["workload.num_steps=5", "cluster.num_nodes=2",
                        "gateway.external.enabled=true",
                        "scheduler.policy=colocate", "scheduler.drain=wait"]:
        args += ["--set", item]
    with open(err, "w") as err_file:  # umask 0: the model's state must stay owner-only
        proc = subprocess.Popen(args, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                stdout=subprocess.DEVNULL, stderr=err_file,
                                preexec_fn=lambda: os.umask(0))
    try:
        gateway = wait_for(lambda: re.search(r"gateway serving at (http://[\d.]+:\d+)",
                                             err.read_text()), timeout_s=180, what="gateway url")[1]
        agent = wait_for(lambda: [e for e in read_jsonl(run_dir / "events.jsonl")
                                  if e["kind"] == "agent_registered"] if
                         (run_dir / "events.jsonl").exists() else None, timeout_s=180, what="agent")[0]
        secret = (run_dir / "secret").read_text().strip()
        ext_key = (run_dir / "external_key").read_text().strip()
        cmdline = Path(f"/proc/{agent['pid']}/cmdline").read_bytes().split(b"\0")
        coordinator = cmdline[cmdline.index(b"--coordinator") + 1].decode()

        async def good_chat():
            async with aiohttp.ClientSession(
                    headers={"Authorization": f"Bearer {ext_key}"}) as h:
                async with h.post(f"{gateway}/runs/ext-probe/v1/chat/completions",
                                  json=HELLO) as r:
                    return r.status

        async def status(url, key, body=None):
            async with aiohttp.ClientSession() as h:
                async with h.post(url, json=body or {},
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.status

        async def heartbeat(body, key):
            async with aiohttp.ClientSession() as h:
                async with h.post(f"{coordinator}/agent/heartbeat", json=body,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.status

        async def main():
            host, port = gateway[7:].split(":")
            ahost, aport = agent["url"][7:].split(":")
            crossed = await asyncio.gather(  # each key where it does not belong
                status(f"{gateway}/runs/s0000-p000-g00/v1/chat/completions", secret, HELLO),
                status(f"{gateway}/runs/s0000-p000-g00/v1/chat/completions", ext_key, HELLO),
                status(f"{agent['url']}/cmd/start_engine", ext_key, {"version": 1}),
                heartbeat({"node": 0}, ext_key))
            return crossed, *await asyncio.gather(
                attack(gateway, "/runs/ext-r1/v1/chat/completions", GATEWAY_BAD, key=ext_key),
                attack(agent["url"], "/cmd/start_engine", AGENT_BAD, key=secret),
                half_attack(host, int(port), "/runs/ext-r1/v1/chat/completions", ext_key,
                            good_chat),
                half_attack(ahost, int(aport), "/cmd/start_engine", secret, good_chat),
                heartbeat({"node": "zero"}, secret), heartbeat({"node": 0}, "guess"))
        binds = listening(descendants(proc.pid))
        crossed, gw_out, agent_out, gw_half, agent_half, *beats = asyncio.run(main())
        binds |= listening(descendants(proc.pid))  # training worlds may exist by now
        pids = descendants(proc.pid)
        cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in pids
                    if Path(f"/proc/{p}/cmdline").exists()]
        assert proc.wait(timeout=300) == 0, err.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert crossed == [401, 401, 401, 401]  # secret on the gateway, external key elsewhere
    assert gw_out == expected(GATEWAY_BAD)
    assert agent_out == expected(AGENT_BAD)
    assert gw_half["good"] == 200 and agent_half["good"] == 200
    check_half(gw_half, body_timeout_s=control.BODY_TIMEOUT_S, idle_timeout_s=None)
    check_half(agent_half, body_timeout_s=control.BODY_TIMEOUT_S, idle_timeout_s=None)
    assert beats == [400, 401]
    # servers listen on the nodes' own addresses only: never a wildcard. Known gap: gloo's
    # pair listeners (torch.distributed in the trainers) take the host name's address,
    # 127.0.0.1 here, not the node's: loopback, but not 127.0.10.N (see train/dist.py)
    hosts = {gateway, coordinator, agent["url"]}
    assert {f"http://{a}:{p}" for a, p in binds} >= hosts
    stray = {(a, p) for a, p in binds if not re.fullmatch(r"127\.0\.10\.\d+", a)}
    assert all(a == "127.0.0.1" for a, _ in stray), binds
    # the secrets: on no command line, each in its own file only; the model's state private
    assert not any(k.encode() in c for c in cmdlines for k in (secret, ext_key))
    for path in run_dir.rglob("*"):
        if path.is_file() and path.stat().st_size < 50 << 20:
            data = path.read_bytes()
            assert path.name == "secret" or secret.encode() not in data, path
            assert path.name == "external_key" or ext_key.encode() not in data, path
    assert (run_dir / "secret").stat().st_mode & 0o777 == 0o600
    assert (run_dir / "external_key").stat().st_mode & 0o777 == 0o600
    # the probes were external runs: recorded apart, never in the job's store
    from gyre_slurm.traj.store import load_store
    assert "ext-probe" in load_store(run_dir / "external").runs
    assert not [r for r in load_store(run_dir).runs if r.startswith("ext-")]
    for sub in ("checkpoints", "weights", "trainer_state"):
        assert (run_dir / sub).stat().st_mode & 0o777 == 0o700, sub
    check_run_dir(run_dir, num_steps=5)  # every step, nothing lost or repeated

"""An external scaffold as a run: the real gateway (with its Unix socket) in front of a
real engine process, the `shell` environment, and the scaffold in its bubblewrap
sandbox. The scaffold here is a probe (`scaffold_probe.py`): it makes a model call,
runs the task's reference solution through the sandbox, and tries what a hostile
scaffold would (the job secret, another run's files, the engine's and the gateway's TCP
ports, another run's URL with its key). The reward comes from the task's tests, run
after it has ended."""

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from engine_helpers import tiny_engines
import faults
from gyre_slurm.agents.scaffold import ScaffoldRunner, run_scaffold
from gyre_slurm.config.agents import ScaffoldConfig
from gyre_slurm.engines import EngineClient
from gyre_slurm.envs import make_env
from gyre_slurm.envs.base import TaskSpec
from gyre_slurm.envs.shell import TASKS_DIR
from gyre_slurm.gateway import Gateway
from gyre_slurm.traj.store import CallStoreWriter, load_store

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
TASK = TaskSpec("shell/fix-off-by-one/0", 0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with tiny_engines(tmp_path_factory.mktemp("scaffold-engine"), max_positions=8192) as e:
        yield dict(e, url=e["urls"][0])


def scaffold_run(engine, run_dir, spec, *, env_params=None, probe_env=None, other=None,
                 max_calls=None):
    """One run of TASK with `spec`; (record, probe.json or None, calls in the store)."""
    async def main():
        run_dir.mkdir(parents=True, exist_ok=True)
        sock_dir = Path(os.path.realpath("/tmp")) / f"gyre-gw-test-{os.getpid()}"
        sock_dir.mkdir(exist_ok=True)
        os.chmod(sock_dir, 0o711)
        writer = CallStoreWriter(run_dir, "gateway")
        gw = Gateway(model_dir=engine["model_dir"], call_writer=writer, wait_for_server_s=5,
                     default_max_tokens=8)
        port = await gw.start(HOST, 0, unix_path=sock_dir / "gateway.sock")
        client = EngineClient(engine["url"], engine["secret"])
        gw.add_server("s0", client, capacity=4)
        if other:
            gw.open_run(other)
        runner = ScaffoldRunner(spec, python=sys.executable, run_dir=run_dir,
                                socket_path=sock_dir / "gateway.sock",
                                gateway_url=f"http://{HOST}:{port}")
        env = make_env("shell", base_dir=str(run_dir / "sandboxes"), **(env_params or {}))
        try:
            record = await run_scaffold(runner, env=env, task=TASK, run_id="s0000-p000-g00",
                                        gateway=gw, run_seed=1, max_calls=max_calls)
            after = gw.calls_of("s0000-p000-g00")
        finally:
            await env.close()
            await gw.stop()
            await client.close()
            writer.close()
            shutil.rmtree(sock_dir, ignore_errors=True)
        probe = runner.home("s0000-p000-g00") / "probe.json"
        return record, json.loads(probe.read_text()) if probe.exists() else None, after, port
    return asyncio.run(main())


def probe_spec(tmp_path, **kw):
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    shutil.copy(HERE / "scaffold_probe.py", agent_dir)
    kw.setdefault("keep_homes", "all")  # the probe's report is read from its home
    return ScaffoldConfig(type="command", command=("python3", "scaffold_probe.py"),
                          workdir=str(agent_dir), timeout_s=120, **kw)


def test_probe_scaffold_solves_through_the_sandbox_and_escapes_nothing(engine, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    secret = run_dir / "secret"
    secret.write_text("the-job-secret")
    secret.chmod(0o600)
    other_home = run_dir / "scaffolds" / "s0000-p000-g01"
    other_home.mkdir(parents=True)
    (other_home / "TASK.md").write_text("another run's task")
    solution = (TASKS_DIR / "fix-off-by-one" / "solution.sh").read_text()
    engine_addr = engine["url"][7:]
    spec = probe_spec(tmp_path, env_vars={
        "PROBE_COMMANDS": json.dumps([solution, "id -u; ls /home/agent"]),
        "PROBE_FILES": ":".join([str(secret), str(other_home / "TASK.md"),
                                 str(run_dir / "calls"), "/root/.bash_history",
                                 str(TASKS_DIR / "fix-off-by-one" / "solution.sh")]),
        "PROBE_OTHER_RUN": "s0000-p000-g01"})
    gw_probe = {"PROBE_TCP": f"{engine_addr},127.0.0.1:22"}
    spec = ScaffoldConfig(**{**spec.__dict__, "env_vars": {**spec.env_vars, **gw_probe}})
    record, probe, calls, port = scaffold_run(engine, run_dir, spec, other="s0000-p000-g01")
    assert record["status"] == "ok", record["error"]
    assert record["reward"] == 1.0 and all(record["tests"].values()), record
    assert record["num_calls"] == calls == 1 and probe["chat"] == 200
    assert probe["task_file"] is True
    solved, ident = probe["commands"]
    assert solved["returncode"] == 0 and solved["limit"] is None, solved
    assert ident["output"].split()[0] == ("65534" if os.geteuid() == 0 else str(os.geteuid()))
    assert "rangesum.py" in ident["output"]  # the task's sandbox, not the scaffold's home
    for path, got in probe["files"].items():  # nothing of the run dir or the host
        assert got.startswith("refused"), (path, got)
    for addr, got in probe["tcp"].items():  # no network: not the engine, not anything
        assert got.startswith("refused"), (addr, got)
    assert probe["other_run"] == 401
    assert probe["uid"] == (65534 if os.geteuid() == 0 else os.geteuid())
    assert not {"GYRE_SECRET", "VLLM_API_KEY"} & set(probe["env_keys"])
    recs = load_store(run_dir).runs["s0000-p000-g00"]
    assert [d.call for d in recs] == [0]


def test_scaffold_timeout_and_failure(engine, tmp_path):
    spec = ScaffoldConfig(type="command", command=("python3", "-c", "import time; "
                                                   "time.sleep(600)"), timeout_s=1.5)
    t0 = time.monotonic()
    record, _, _, _ = scaffold_run(engine, tmp_path / "slow", spec)
    assert record["status"] == "timeout" and "1.5 s" in record["error"]
    assert time.monotonic() - t0 < 30 and record["reward"] == 0.0
    spec = ScaffoldConfig(type="command", command=("python3", "-c", "raise SystemExit(3)"))
    record, _, _, _ = scaffold_run(engine, tmp_path / "fail", spec)
    assert record["status"] == "failed" and "code 3" in record["error"]
    assert record["scaffold"]["exit_code"] == 3
    # keep_homes: failed (the default): a failed run's home stays, to see what went wrong
    for name in ("slow", "fail"):
        assert (tmp_path / name / "scaffolds" / "s0000-p000-g00" / "TASK.md").is_file()


@pytest.mark.parametrize("keep, code, kept", [
    ("failed", 0, False), ("none", 3, False), ("all", 0, True)])
def test_an_ended_runs_home_goes_unless_kept(engine, tmp_path, keep, code, kept):
    """A home holds up to disk_mb on the shared filesystem, for thousands of runs a job:
    it goes once the run has ended, unless `keep_homes` keeps it; the log stays."""
    spec = ScaffoldConfig(type="command", keep_homes=keep, command=(
        "python3", "-c", f"open('notes.txt', 'w').write('x' * 1000); raise SystemExit({code})"))
    record, _, _, _ = scaffold_run(engine, tmp_path / "run", spec)
    assert record["status"] == ("ok" if code == 0 else "failed"), record
    home = tmp_path / "run" / "scaffolds" / "s0000-p000-g00"
    assert home.exists() == kept
    if kept:
        assert (home / "notes.txt").read_text() == "x" * 1000
    assert Path(record["scaffold"]["log"]).is_file()


def test_the_run_key_never_shows_in_a_command_line(engine, tmp_path, monkeypatch):
    """Any user of a node reads every process's arguments (/proc/PID/cmdline, `ps`);
    only the process's own user reads its environment. While a scaffold runs, no
    command line on this host carries its run key or its config's variables, and the
    scaffold still gets them (and nothing of the job's own environment)."""
    import threading
    from gyre_slurm.gateway.runs import KEY_PREFIX
    monkeypatch.setenv("GYRE_TEST_JOB_ONLY", "job-side-value")
    script = ("import json, os, time; json.dump({'env': dict(os.environ)}, "
              "open('env.json', 'w')); time.sleep(4)")
    spec = ScaffoldConfig(type="command", command=("python3", "-c", script), timeout_s=60,
                          env_vars={"MY_SETTING": "scaffold-only-value"}, keep_homes="all")
    seen, done = [], threading.Event()

    def scan():
        while not done.is_set():
            for pid in os.listdir("/proc"):
                line = faults.cmdline(pid) if pid.isdigit() else ""
                if KEY_PREFIX in line or "scaffold-only-value" in line:
                    seen.append(line)
            time.sleep(0.05)
    scanner = threading.Thread(target=scan, daemon=True)
    scanner.start()
    try:
        record, _, _, _ = scaffold_run(engine, tmp_path / "run", spec)
    finally:
        done.set()
        scanner.join()
    assert record["status"] == "ok", record["error"]
    env = json.loads((tmp_path / "run" / "scaffolds" / "s0000-p000-g00" / "env.json")
                     .read_text())["env"]
    assert env["OPENAI_API_KEY"].startswith(KEY_PREFIX) and env["MY_SETTING"] == \
        "scaffold-only-value" and env["GYRE_RUN_ID"] == "s0000-p000-g00"
    assert "GYRE_TEST_JOB_ONLY" not in env, sorted(env)
    assert not seen, seen[:3]


def test_a_scaffold_that_fills_its_home_is_stopped(engine, tmp_path):
    """Its home is on the shared filesystem (RUN_DIR/scaffolds/<run_id>): past
    `disk_mb` the scaffold is stopped and the run fails saying why, in seconds, not at
    its timeout; one that stays under it runs as before."""
    fill = ("import time\nfor i in range(400):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))"
            "\ntime.sleep(120)")
    spec = ScaffoldConfig(type="command", command=("python3", "-c", fill), timeout_s=120,
                          disk_mb=16)
    t0 = time.monotonic()
    record, _, _, _ = scaffold_run(engine, tmp_path / "full", spec)
    assert record["status"] == "failed", record
    assert "held more than agent.scaffold.disk_mb = 16 MiB" in record["error"], record
    assert time.monotonic() - t0 < 60 and record["reward"] == 0.0
    flood = "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)"  # its log
    spec = ScaffoldConfig(type="command", command=("python3", "-c", flood), timeout_s=120,
                          disk_mb=16)
    t0 = time.monotonic()
    record, _, _, _ = scaffold_run(engine, tmp_path / "loud", spec)
    assert record["status"] == "failed", record
    assert time.monotonic() - t0 < 60
    log = Path(record["scaffold"]["log"])  # no file of it past disk_mb: RLIMIT_FSIZE
    assert log.stat().st_size <= (16 << 20) + 4096, log.stat().st_size
    spec = ScaffoldConfig(type="command", command=("python3", "-c", "open('a', 'wb').write("
                                                   "b'x' * (1 << 20))"), disk_mb=16)
    record, _, _, _ = scaffold_run(engine, tmp_path / "fits", spec)
    assert record["scaffold"]["status"] == "ok", record


CALLER = """
import json, os, urllib.error, urllib.request
statuses = []
for i in range(8):
    body = {"model": "m", "n": 2 if i == 4 else 1, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                 data=json.dumps(body).encode(), headers={
                                     "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                     "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            statuses.append(r.status)
    except urllib.error.HTTPError as e:
        statuses.append([e.code, json.loads(e.read())["error"]["message"]])
json.dump(statuses, open("statuses.json", "w"))
"""


def test_a_run_past_its_model_calls_is_answered_429(engine, tmp_path):
    """gateway.max_calls_per_run bounds a scaffold's model calls (choices, recorded or
    in flight): a scaffold that loops on the model gets 429 past it, and nothing more is
    recorded; one request of n = 2 with one call left is refused whole."""
    spec = ScaffoldConfig(type="command", command=("python3", "-c", CALLER), timeout_s=120,
                          keep_homes="all")  # its statuses.json is read below
    record, _, calls, _ = scaffold_run(engine, tmp_path / "run", spec, max_calls=5)
    statuses = json.loads((tmp_path / "run" / "scaffolds" / "s0000-p000-g00" /
                           "statuses.json").read_text())
    assert statuses[:4] == [200] * 4 and statuses[5] == 200, statuses
    assert statuses[4][0] == 429 and "has made 4 model calls of the 5" in statuses[4][1]
    assert [s[0] for s in statuses[6:]] == [429, 429]  # n = 2 with one left: refused whole
    assert "has made 5 model calls of the 5 it may (gateway.max_calls_per_run)" in \
        statuses[6][1], statuses
    assert calls == record["num_calls"] == 5
    assert len(load_store(tmp_path / "run").runs["s0000-p000-g00"]) == 5


def test_commands_past_max_steps_are_refused(engine, tmp_path):
    spec = probe_spec(tmp_path, env_vars={"PROBE_COMMANDS": json.dumps(["true"] * 4)})
    record, probe, _, _ = scaffold_run(engine, tmp_path / "run", spec,
                                       env_params={"max_steps": 2})
    assert [c["returncode"] for c in probe["commands"][:2]] == [0, 0]
    assert all("max_steps" in str(c) for c in probe["commands"][2:]), probe["commands"]
    assert record["status"] == "ok" and record["reward"] < 1.0


MINI_SCRIPT = [
    "Let me look around.\n```mswea_bash_command\nid -u; ls; tail -n +3 /proc/net/dev | "
    "cut -d: -f1; cat /root/.bash_history /etc/shadow 2>&1 | head -3\n```",
    "Fix it.\n```mswea_bash_command\n"
    + (TASKS_DIR / "fix-off-by-one" / "solution.sh").read_text().strip() + "\n```",
    "Done.\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]


@pytest.mark.slow
def test_mini_swe_agent_runs_its_commands_in_the_task_sandbox(engine, minisweagent_python,
                                                              tmp_path):
    """mini-swe-agent, unmodified, in its sandbox: its commands (the model's, scripted
    here: a tiny random model writes none) run in the task's sandbox through the gateway,
    it submits, and the task's tests pay 1.0."""
    from gyre_slurm.models import tiny
    from test_gateway_openai import ScriptedEngine

    tok = tiny.load_tokenizer(engine["model_dir"])
    scripted = ScriptedEngine(tok, MINI_SCRIPT)

    async def main():
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        sock_dir = Path(os.path.realpath("/tmp")) / f"gyre-gw-mini-{os.getpid()}"
        sock_dir.mkdir(exist_ok=True)
        os.chmod(sock_dir, 0o711)
        writer = CallStoreWriter(run_dir, "gateway")
        gw = Gateway(model_dir=engine["model_dir"], call_writer=writer, wait_for_server_s=5,
                     default_max_tokens=64)
        port = await gw.start(HOST, 0, unix_path=sock_dir / "gateway.sock")
        client = EngineClient(await scripted.start(), "unused")
        gw.add_server("scripted", client, capacity=4)
        spec = ScaffoldConfig(type="mini-swe-agent", step_limit=5, timeout_s=240,
                              keep_homes="all")  # its trajectory file is read below
        runner = ScaffoldRunner(spec, python=minisweagent_python, run_dir=run_dir,
                                socket_path=sock_dir / "gateway.sock",
                                gateway_url=f"http://{HOST}:{port}")
        env = make_env("shell", base_dir=str(run_dir / "sandboxes"))
        try:
            return await run_scaffold(runner, env=env, task=TASK, run_id="s0000-p000-g00",
                                      gateway=gw, run_seed=1), run_dir
        finally:
            await env.close()
            await gw.stop()
            await client.close()
            await scripted.runner.cleanup()
            writer.close()
            shutil.rmtree(sock_dir, ignore_errors=True)
    record, run_dir = asyncio.run(main())
    log = Path(record["scaffold"]["log"]).read_text()
    assert record["status"] == "ok", (record["error"], log[-3000:])
    assert record["reward"] == 1.0 and record["num_calls"] == 3, (record, log[-3000:])
    prompts = [tok.decode(p) for p in scripted.prompts]
    first_output = prompts[1].rsplit("<returncode>", 1)[1]
    uid = "65534" if os.geteuid() == 0 else str(os.geteuid())
    assert first_output.startswith(f"0</returncode>\n<output>\n{uid}\n"), first_output
    assert "rangesum.py" in first_output  # the task's files: the task's sandbox
    assert "    lo\n" in first_output and "eth" not in first_output  # no network
    assert "No such file" in first_output and "Permission denied" in first_output
    traj = json.loads((run_dir / "scaffolds" / "s0000-p000-g00" / "mini.traj.json").read_text())
    assert traj["info"]["exit_status"] == "Submitted"


def test_the_task_sandbox_holds_through_the_scaffold_path(engine, tmp_path):
    """The shell environment's escape checks, sent as a scaffold's commands through the
    gateway: writes outside the workdir fail, nothing of the tasks is in sight, no
    network (TCP to a host listener, the gateway's Unix socket), a limit is reported
    and the run goes on, nothing a command started outlives it."""
    import socket
    import threading

    tag = f"gyre-scaffold-{os.getpid()}"
    srv = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(srv.accept()), daemon=True).start()
    marker = f"gyre-sleeper-{os.getpid()}"
    commands = [f"echo x > /etc/{tag}", f"touch /tmp/../root/{tag}",
                f"echo x > {HERE}/{tag}",
                "find / \\( -path /proc -o -path /dev -o -path /sys \\) -prune -o \\( -name "
                "solution.sh -o -name task.yaml -o -name gyre_runner.py \\) -print 2>/dev/null "
                "| wc -l",
                f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", "
                f"{srv.getsockname()[1]}), timeout=3)' 2>&1 | tail -1",
                "python3 -c 'import socket, glob; s = socket.socket(socket.AF_UNIX); "
                "print(glob.glob(\"/tmp/gyre-gw-*\"))' 2>&1 | tail -1",
                "sleep 120", f"(exec -a {marker} sleep 300) & echo started"]
    spec = probe_spec(tmp_path, env_vars={"PROBE_COMMANDS": json.dumps(commands)})
    # each command's wall-time limit: long enough for `find /` on a loaded machine (2 s
    # was not, in a CI run; nor was 10 s on a new machine's cold cache), short against
    # `sleep 120`
    record, probe, _, _ = scaffold_run(engine, tmp_path / "run", spec,
                                       env_params={"time_s": 30.0})
    srv.close()
    writes, find, tcp, unix, slow, bg = (probe["commands"][:3], *probe["commands"][3:])
    for w in writes:
        assert w["returncode"] not in (0, None), w
    assert find["output"].strip() == "0", find
    assert "ConnectionRefusedError" in tcp["output"] and not accepted, tcp
    assert "PermissionError" in unix["output"], unix  # seccomp: no AF_UNIX socket at all
    assert slow["limit"] == "time" and slow["returncode"] is None
    assert bg["returncode"] == 0 and "started" in bg["output"]
    assert record["status"] == "ok"  # the limit ended the command, not the run
    for path in (f"/etc/{tag}", f"/root/{tag}", f"{HERE}/{tag}"):
        assert not os.path.lexists(path), path
    left = [p for p in os.listdir("/proc") if p.isdigit() and marker in faults.cmdline(p)]
    assert left == []

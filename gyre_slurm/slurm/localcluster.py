"""A real multi-node Slurm cluster on one machine (Debian's Slurm 22.05), for tests and trials.

`LocalCluster(state_dir, num_nodes=4)` runs munged, slurmctld and one slurmd per node as root,
started by hand (never as system services) and stopped by the PIDs in their pid files.
State dir (default `$GYRE_SLURM_STATE` or /tmp/gyre-localslurm): etc/slurm.conf + gres.conf
(clients need `SLURM_CONF=STATE/etc/slurm.conf`), munge/ (key 0400, socket, pid), run/*.pid,
log/ (munged, slurmctld, slurmd-nodeN, daemons.out, jobcomp.txt), ctld/ (saved state),
spool/nodeN/, dev/nvidia0..3 (-> /dev/null), .lock (up/down), users.lock + run/owner (pytest).

Nodes: nodeN has address 127.0.10.N (a line `127.0.10.N nodeN  # gyre-localslurm STATE` is
added to /etc/hosts, rewritten in place, removed on down), slurmd port `node_port_base + N`,
4 CPUs, 2000 MB and 4 fake GPUs (gres gpu:4, File= symlinks to /dev/null: steps get
CUDA_VISIBLE_DEVICES but there is no device). Each slurmd runs in its own UTS namespace with
hostname nodeN, so `srun hostname` prints nodeN. All nodes share one network stack: a server
on a node binds the node's own address (127.0.10.N), never 0.0.0.0.

Works: sbatch (multi-node, arrays, --wait), srun (--overlap, --exact, -w), scancel (also
`--batch --signal=USR2`), `scontrol requeue` (the job runs again after cred_expire=10 s, with
SLURM_RESTART_COUNT=1), squeue/sinfo (also --json), GPU gres binding per step.
Known not to work: sacct and anything else needing slurmdbd (tools such as submitit warn
"Bypassing sacct error"); `scontrol ... --json` (not in 22.05); cgroup confinement
(proctrack/linuxproc + task/none: steps are not fenced to their CPUs or memory); real GPUs;
timed signals (`--signal=B:USR2@T`) arrive up to ~30 s late (slurmctld's limit check period):
send signals with `scancel --signal`. `up` with another node count restarts the cluster;
`up` on a running cluster whose slurmd stopped on some nodes starts only those again.

A second cluster beside the first (the shared test cluster keeps running): its own state
dir, slurmctld port and slurmd ports, node names and loopback addresses, e.g.
`LocalCluster("/tmp/gyre-bench-slurm", 8, ctld_port=16827, node_port_base=17100,
node_prefix="bnode", addr_prefix="127.0.11.")` (`tools/localslurm up --nodes 8 --state-dir
... --ctld-port ... --port-base ... --node-prefix bnode --addr-prefix 127.0.11.`). A
cluster on ports already in use is refused.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sinfo", "munged")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_TAG = "# gyre-localslurm"
GPUS_PER_NODE = 4


def default_state_dir() -> Path:
    """`$GYRE_SLURM_STATE`, else /tmp/gyre-localslurm."""
    return Path(os.environ.get("GYRE_SLURM_STATE") or "/tmp/gyre-localslurm")


@dataclass(frozen=True)
class DaemonStatus:
    name: str
    pid: int | None
    alive: bool


@dataclass(frozen=True)
class ClusterStatus:
    daemons: list[DaemonStatus]
    sinfo: str


def pid_alive(pid: int | None) -> bool:
    """True if `pid` runs and is not a zombie (PID 1 may reap slowly)."""
    try:
        return bool(pid) and Path(f"/proc/{pid}/stat").read_text().rsplit(")")[-1][1] != "Z"
    except OSError:
        return False


def _read_pid(pid_file: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(pid_file.read_text().split()[0])
    return None


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def _stop_pid(pid: int, *, timeout_s: float) -> None:
    """SIGTERM, wait up to timeout_s for it to be gone (or a zombie), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        log.warning("pid %d ignored SIGTERM for %.0f s: SIGKILL", pid, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def packages_installed() -> bool:
    return all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in BINARIES)


def ensure_packages() -> None:
    """apt-get install the Slurm + munge packages when missing (update only if no candidate)."""
    if packages_installed():
        return
    policy = _apt("apt-cache", "policy", "slurmctld")
    if "Candidate:" not in policy or "Candidate: (none)" in policy:
        _apt("apt-get", "update")
    _apt("apt-get", "install", "-y", "--no-install-recommends", *PACKAGES)


def _apt(*argv: str) -> str:
    log.info("%s", " ".join(argv))
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600,
                          env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-800:]}")
    return proc.stdout


def render_slurm_conf(*, state_dir: Path, num_nodes: int, ctld_port: int,
                      node_port_base: int, node_prefix: str = "node",
                      addr_prefix: str = "127.0.10.", cluster_name: str = "gyre") -> str:
    s = state_dir
    lines = [
        f"ClusterName={cluster_name}", "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={s}/munge/munge.socket,cred_expire=10",
        f"StateSaveLocation={s}/ctld", f"SlurmdSpoolDir={s}/spool/%n",
        f"SlurmctldPidFile={s}/run/slurmctld.pid", f"SlurmdPidFile={s}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={s}/log/slurmctld.log", f"SlurmdLogFile={s}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1,bf_interval=1", "MpiDefault=none",
        "MailProg=/bin/true", "ReturnToService=2", "SlurmdParameters=config_overrides",
        "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=2", "MinJobAge=60",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={s}/log/jobcomp.txt",
        "AccountingStorageType=accounting_storage/none", "GresTypes=gpu",
    ]
    for n in range(1, num_nodes + 1):
        name = f"{node_prefix}{n}"
        lines.append(f"NodeName={name} NodeHostname={name} NodeAddr={addr_prefix}{n} "
                     f"Port={node_port_base + n} CPUs=4 RealMemory=2000 "
                     f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Atomic write (tmp + rename) with the final mode set before the rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
    tmp.chmod(mode)
    os.replace(tmp, path)


class LocalCluster:
    """One local Slurm cluster: `up`, `down`, `status`, `env` (see the module docstring)."""

    def __init__(self, state_dir: Path | str | None = None, num_nodes: int = 4, *,
                 ctld_port: int = 16817, node_port_base: int = 16900,
                 node_prefix: str = "node", addr_prefix: str = "127.0.10.") -> None:
        if not 1 <= num_nodes <= 250:
            raise ValueError(f"num_nodes must be in 1..250, not {num_nodes}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", node_prefix):
            raise ValueError(f"node_prefix must be a lowercase name (a-z, then a-z 0-9), "
                             f"got {node_prefix!r}")
        m = re.fullmatch(r"127\.(\d{1,3})\.(\d{1,3})\.", addr_prefix)
        if m is None or max(int(m[1]), int(m[2])) > 255:
            raise ValueError(f"addr_prefix must be a loopback prefix 127.X.Y. (with the "
                             f"final dot), got {addr_prefix!r}")
        self.state_dir = Path(state_dir or default_state_dir()).resolve()
        self.num_nodes, self.ctld_port, self.node_port_base = num_nodes, ctld_port, node_port_base
        self.node_prefix, self.addr_prefix = node_prefix, addr_prefix
        self.nodes = [f"{node_prefix}{n}" for n in range(1, num_nodes + 1)]
        self._spawned: list[str] = []  # daemons the current `up` has started
        self.restarted: list[str] = []  # nodes whose stopped slurmd the last `up` restarted

    @property
    def conf_path(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF (and without an enclosing job's SLURM_JOB_* variables)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    def _query(self, *argv: str) -> str:
        """A Slurm client command's stdout (stderr too if `argv[0]` fails)."""
        proc = subprocess.run(argv, capture_output=True, text=True, env=self.env(),
                              check=False, timeout=10)
        return proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr

    def _pid_files(self) -> dict[str, Path]:
        s = self.state_dir
        files = {"munged": s / "munge" / "munged.pid", "slurmctld": s / "run" / "slurmctld.pid"}
        files.update({f"slurmd-{n}": s / "run" / f"slurmd-{n}.pid" for n in self.nodes})
        return files

    def _daemon_pid(self, name: str) -> int | None:
        return self._live_pid(self._pid_files()[name])

    def _live_pid(self, pid_file: Path) -> int | None:
        """The PID in `pid_file` if that process is alive and ours (its command line names
        this state dir), else None."""
        pid = _read_pid(pid_file)
        return pid if pid_alive(pid) and str(self.state_dir) in _cmdline(pid) else None

    @contextlib.contextmanager
    def _locked(self):
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / ".lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def can_run(self) -> tuple[bool, str]:
        """(True, "") when this machine can run the cluster, else (False, why not)."""
        if os.geteuid() != 0:
            return False, "needs root (slurmd, munged, /etc/hosts, UTS namespaces)"
        if not packages_installed() and not shutil.which("apt-get"):
            return False, "Slurm/munge are not installed and apt-get is not available"
        if not shutil.which("unshare"):
            return False, "unshare (util-linux) is not available"
        probe = subprocess.run(["unshare", "--uts", "--", "true"], capture_output=True,
                               text=True, check=False)
        if probe.returncode != 0:
            return False, f"unshare --uts fails: {probe.stderr.strip()}"
        if not os.access(HOSTS_FILE, os.W_OK):
            return False, f"{HOSTS_FILE} is not writable"
        return True, ""

    def is_up(self) -> bool:
        """Every daemon of this state dir (munged, slurmctld, each node's slurmd) runs."""
        return all(self._daemon_pid(name) for name in self._pid_files())

    def up(self, timeout_s: float = 60.0) -> bool:
        """Start the cluster and wait until every node is idle. Returns False if it was already
        up, True if started. A half-started cluster is stopped on failure. A running cluster
        with some slurmd stopped gets only those started again (listed in `restarted`; its
        jobs keep running) and counts as already up."""
        self.restarted = []
        with self._locked():
            if self.is_up():
                return False
            dead = self._dead_slurmds()
            if dead:  # the cluster runs but some slurmd stopped: start only those
                self._restart_slurmds(dead, time.monotonic() + timeout_s)
                return False
            ensure_packages()
            self._stop_daemons()  # leftovers of a half-dead cluster in this state dir
            for port in (self.ctld_port, self.node_port_base + 1):
                with socket.socket() as sock:
                    if sock.connect_ex(("127.0.0.1", port)) == 0:
                        raise RuntimeError(
                            f"port {port} is in use: another local Slurm cluster (other "
                            f"state dir) runs here? A second cluster needs its own "
                            f"ctld_port and node_port_base (and node names, addresses)")
            self._spawned = []
            try:
                self._start(timeout_s=timeout_s)
            except BaseException:
                self._stop_all(wait_for=self._spawned)
                raise
            return True

    def _dead_slurmds(self) -> list[str]:
        """The nodes whose slurmd stopped while munged and slurmctld still run with this
        cluster's config (Debian's slurmd 22.05.8 can abort in a thread's free() when batch
        jobs launch at once on a node; a core file lands in log/). Empty when the cluster is
        down, or when its config is not this cluster's (another node count: restart all)."""
        if not (self._daemon_pid("munged") and self._daemon_pid("slurmctld")):
            return []
        with contextlib.suppress(OSError):
            if self.conf_path.read_text() != self._conf_text():
                return []
        return [n for n in self.nodes if not self._daemon_pid(f"slurmd-{n}")]

    def _restart_slurmds(self, nodes: list[str], deadline: float) -> None:
        """Start the slurmd of `nodes` again, leaving munged, slurmctld, the other nodes and
        every job running; wait until slurmctld has each of them back (ReturnToService=2)."""
        log.warning("slurmd stopped on %s: starting it again (see %s/log/slurmd-NODE.log; "
                    "the running cluster and its jobs are left alone)",
                    ",".join(nodes), self.state_dir)
        self._spawned = []
        with open(self.state_dir / "log" / "daemons.out", "a") as out:
            for node in nodes:
                self._spawn_slurmd(node, out)
            for node in nodes:
                self._wait_pid(f"slurmd-{node}", deadline)
        # "idle*" etc.: slurmctld has not heard from the node yet
        self._wait_idle(deadline, nodes=nodes,
                        states=("idle", "mixed", "allocated", "completing"))
        self.restarted = list(nodes)

    def _spawn_slurmd(self, node: str, out) -> None:
        script = f'hostname {node} && exec slurmd -N {node} -f "$1"'
        self._spawn(f"slurmd-{node}",
                    ["unshare", "--uts", "--", "sh", "-c", script, "sh", str(self.conf_path)],
                    out)

    def _start(self, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._write_files()
        self._rewrite_hosts(keep_ours=True)
        s, conf = self.state_dir, str(self.conf_path)
        with open(s / "log" / "daemons.out", "a") as out:
            self._spawn("munged", ["munged", f"--socket={s}/munge/munge.socket",
                                   f"--key-file={s}/munge/munge.key",
                                   f"--pid-file={s}/munge/munged.pid",
                                   f"--log-file={s}/log/munged.log",
                                   f"--seed-file={s}/munge/munged.seed"], out)
            self._wait_pid("munged", deadline)
            self._spawn("slurmctld", ["slurmctld", "-c", "-f", conf], out)  # -c: no old jobs
            self._wait_pid("slurmctld", deadline)
            for node in self.nodes:
                self._spawn_slurmd(node, out)
            for node in self.nodes:
                self._wait_pid(f"slurmd-{node}", deadline)
        self._wait_idle(deadline)

    def _write_files(self) -> None:
        s = self.state_dir
        closed = [d for d in (s, *s.parents) if not d.stat().st_mode & 0o001]
        if closed:  # munged: "Socket is inaccessible: execute permissions for all required"
            raise RuntimeError(f"{closed[0]} must be searchable by all (o+x) for munged")
        for sub in ("etc", "munge", "run", "log", "ctld", "dev", "spool"):
            (s / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (s / "spool" / node).mkdir(exist_ok=True)
        (s / "munge").chmod(0o755)  # munged refuses a group/world-writable socket dir
        key = s / "munge" / "munge.key"
        if not key.exists():
            _write(key, os.urandom(1024), mode=0o400)
        for dev in (s / "dev" / f"nvidia{i}" for i in range(GPUS_PER_NODE)):
            dev.unlink(missing_ok=True)
            dev.symlink_to("/dev/null")  # slurmd wants a device: a regular file is refused
        _write(self.conf_path, self._conf_text())
        _write(s / "etc" / "gres.conf",
               f"AutoDetect=off\nNodeName={self.node_prefix}[1-{self.num_nodes}] Name=gpu "
               f"File={s}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n")

    def _conf_text(self) -> str:
        return render_slurm_conf(
            state_dir=self.state_dir, num_nodes=self.num_nodes, ctld_port=self.ctld_port,
            node_port_base=self.node_port_base, node_prefix=self.node_prefix,
            addr_prefix=self.addr_prefix,
            cluster_name="gyre" if self.node_prefix == "node" else f"gyre{self.node_prefix}")

    def _spawn(self, name: str, argv: list[str], out) -> None:
        """Run a self-daemonizing command; it returns once the daemon has forked."""
        self._spawned.append(name)
        out.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                              check=False, timeout=30, env=self.env())
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed to start (exit {proc.returncode}); see "
                               f"{self.state_dir}/log/daemons.out and the daemon's log")

    def _wait_pid(self, name: str, deadline: float) -> None:
        while not self._daemon_pid(name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not start; see {self.state_dir}/log/")
            time.sleep(0.02)

    def _wait_idle(self, deadline: float, *, nodes: list[str] | None = None,
                   states: tuple[str, ...] = ("idle",)) -> None:
        """Until sinfo shows each of `nodes` (default: all) in one of `states`."""
        nodes = self.nodes if nodes is None else nodes
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            out = self._query("sinfo", "-h", "-N", "-o", "%N %T")
            seen = dict(line.split()[:2] for line in out.splitlines() if " " in line)
            if all(seen.get(n) in states for n in nodes):
                return
            time.sleep(0.05)
        raise TimeoutError(f"nodes not {'/'.join(states)} in time: {seen}; "
                           f"see {self.state_dir}/log/")

    @property
    def _hosts_tag(self) -> str:
        return f"{HOSTS_TAG} {self.state_dir}"

    def _hosts_lines(self) -> list[str]:
        return [f"{self.addr_prefix}{i} {n}  {self._hosts_tag}" for i, n in enumerate(self.nodes, 1)]

    def _rewrite_hosts(self, keep_ours: bool) -> None:
        """Rewrite /etc/hosts in place (it may be a bind mount: no rename)."""
        with open(HOSTS_FILE, "r+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            old = fh.read().splitlines()
            new = [line for line in old if not line.rstrip().endswith(self._hosts_tag)]
            if keep_ours:
                new += self._hosts_lines()
            if new != old:
                fh.seek(0)
                fh.write("\n".join(new) + "\n")
                fh.truncate()

    def down(self, *, purge: bool = False) -> None:
        """Cancel every job, stop every daemon, remove the /etc/hosts lines; with purge also
        delete the state dir."""
        with self._locked():
            if self._daemon_pid("slurmctld"):
                self._cancel_all_jobs()
            self._stop_all()
            (self.state_dir / "run" / "owner").unlink(missing_ok=True)
        if purge:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _cancel_all_jobs(self, timeout_s: float = 10.0) -> None:
        jobs = self._query("squeue", "-h", "-o", "%i").split()
        if not jobs:
            return
        self._query("scancel", "--full", *jobs)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self._query("squeue", "-h", "-t", "all", "-o", "%T").split()
            if not {"RUNNING", "COMPLETING", "CONFIGURING"} & set(states):
                return
            time.sleep(0.1)
        log.warning("jobs still running after scancel; stopping the daemons anyway")

    def _stop_daemons(self) -> None:
        """Stop every daemon of this state dir: each slurmd (also of nodes beyond num_nodes,
        left by an `up` with more nodes), then slurmctld, then munged."""
        run = self.state_dir / "run"
        order = sorted(run.glob("slurmd-*.pid")) + [run / "slurmctld.pid",
                                                    self._pid_files()["munged"]]
        for pid_file in order:
            pid = self._live_pid(pid_file)
            if pid:
                log.debug("stopping %s (pid %d)", pid_file.stem, pid)
                _stop_pid(pid, timeout_s=10.0)

    def _stop_all(self, *, wait_for: list[str] = (), grace_s: float = 3.0) -> None:
        """Stop the daemons and remove the /etc/hosts lines. Daemons named in `wait_for` were
        just spawned and may not have written their pid files yet: wait for those a little."""
        deadline = time.monotonic() + grace_s
        for name in wait_for:
            while not self._daemon_pid(name) and time.monotonic() < deadline:
                time.sleep(0.02)
        self._stop_daemons()
        self._rewrite_hosts(keep_ours=False)

    def status(self) -> ClusterStatus:
        """Each daemon's pid and liveness, and `sinfo -N` while slurmctld runs."""
        daemons = []
        for name, path in self._pid_files().items():
            alive = self._live_pid(path) is not None
            daemons.append(DaemonStatus(name=name, pid=_read_pid(path), alive=alive))
        ctld_alive = any(d.alive and d.name == "slurmctld" for d in daemons)
        sinfo = self._query("sinfo", "-N", "-o", "%N %T %G").strip() if ctld_alive else ""
        return ClusterStatus(daemons=daemons, sinfo=sinfo)

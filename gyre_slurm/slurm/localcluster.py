"""A real multi-node Slurm cluster on one machine (Debian's Slurm 22.05), for tests and trials.

`LocalCluster(state_dir, num_nodes=4)` runs munged, slurmctld and one slurmd per node, all as
root, all started by hand (never as system services), all stopped by the PIDs in their pid files.

Layout under STATE (the state dir; default `$GYRE_SLURM_STATE` or /tmp/gyre-localslurm):
  etc/slurm.conf, etc/gres.conf   the config (clients need `SLURM_CONF=STATE/etc/slurm.conf`)
  munge/munge.key (0400), munge/munge.socket, munge/munged.pid
  run/slurmctld.pid, run/slurmd-nodeN.pid
  log/munged.log, log/slurmctld.log, log/slurmd-nodeN.log, log/daemons.out, log/jobcomp.txt
  ctld/ (StateSaveLocation), spool/nodeN/ (SlurmdSpoolDir), dev/nvidia0..3 (-> /dev/null)
  .lock (serialises up/down), users.lock (pytest sessions sharing the cluster; see
  pytest_fixtures), run/owner ("pytest" when a test session started the cluster)

Nodes: nodeN has address 127.0.10.N (a line `127.0.10.N nodeN  # gyre-localslurm` is added to
/etc/hosts, rewritten in place, removed on down), slurmd port `node_port_base + N`, 4 CPUs,
2000 MB and 4 fake GPUs (gres gpu:4, File= symlinks to /dev/null: steps get
CUDA_VISIBLE_DEVICES but there is no device). Each slurmd runs in its own UTS namespace with
hostname nodeN, so `srun hostname` prints nodeN. All nodes share one network stack: a server
on a node binds the node's own address (127.0.10.N), never 0.0.0.0.

Works: sbatch (multi-node, arrays, --wait), srun (--overlap, --exact, -w), scancel (also
`--batch --signal=USR2`), `scontrol requeue` (the job runs again after cred_expire=10 s, with
SLURM_RESTART_COUNT=1), squeue/sinfo (also --json), GPU gres binding per step.

Known not to work: sacct and anything else needing slurmdbd (AccountingStorageType=none; tools
such as submitit warn "Bypassing sacct error"); `scontrol ... --json` (not in 22.05); cgroup
confinement (proctrack/linuxproc + task/none: steps are not fenced to their CPUs or memory);
real GPUs; timed signals (`--signal=B:USR2@T`) arrive up to ~30 s late (slurmctld's limit
check period): send signals with `scancel --signal`. One cluster per machine at a time: ports
and node names are fixed per cluster, and a second cluster with the same ports is refused.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
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

    @property
    def all_alive(self) -> bool:
        return all(d.alive for d in self.daemons)


def pid_alive(pid: int | None) -> bool:
    """True if `pid` runs and is not a zombie (PID 1 here reaps slowly)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
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
    policy = subprocess.run(["apt-cache", "policy", "slurmctld"], capture_output=True,
                            text=True, check=False).stdout
    if "Candidate:" not in policy or "Candidate: (none)" in policy:
        log.info("apt-get update (no candidate for slurmctld)")
        subprocess.run(["apt-get", "update"], check=True, capture_output=True)
    log.info("apt-get install %s", " ".join(PACKAGES))
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
                   check=True, capture_output=True,
                   env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def render_slurm_conf(*, state_dir: Path, num_nodes: int, ctld_port: int,
                      node_port_base: int) -> str:
    s = state_dir
    lines = [
        "ClusterName=gyre", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctld_port}",
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
        lines.append(f"NodeName=node{n} NodeHostname=node{n} NodeAddr=127.0.10.{n} "
                     f"Port={node_port_base + n} CPUs=4 RealMemory=2000 "
                     f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class LocalCluster:
    """One local Slurm cluster: `up`, `down`, `status`, `env` (see the module docstring)."""

    def __init__(self, state_dir: Path | str | None = None, num_nodes: int = 4, *,
                 ctld_port: int = 16817, node_port_base: int = 16900) -> None:
        if not 1 <= num_nodes <= 250:
            raise ValueError(f"num_nodes must be in 1..250, not {num_nodes}")
        self.state_dir = Path(state_dir or default_state_dir()).resolve()
        self.num_nodes = num_nodes
        self.ctld_port = ctld_port
        self.node_port_base = node_port_base
        self.nodes = [f"node{n}" for n in range(1, num_nodes + 1)]

    # ---- paths and environment -------------------------------------------------------------
    @property
    def conf_path(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF (and without an enclosing job's SLURM_JOB_* variables)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    def _pid_files(self) -> dict[str, Path]:
        s = self.state_dir
        files = {"munged": s / "munge" / "munged.pid", "slurmctld": s / "run" / "slurmctld.pid"}
        files.update({f"slurmd-{n}": s / "run" / f"slurmd-{n}.pid" for n in self.nodes})
        return files

    def _daemon_pid(self, name: str) -> int | None:
        """The PID in `name`'s pid file if that process is alive and ours (its command line
        names this state dir), else None."""
        try:
            pid = int(self._pid_files()[name].read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        marker = str(self.state_dir)
        return pid if pid_alive(pid) and marker in _cmdline(pid) else None

    @contextlib.contextmanager
    def _locked(self, name: str = ".lock", kind: int = fcntl.LOCK_EX):
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / name, "a") as fh:
            fcntl.flock(fh, kind)
            yield fh

    # ---- checks ------------------------------------------------------------------------------
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
        return all(self._daemon_pid(name) for name in self._pid_files())

    # ---- up ------------------------------------------------------------------------------------
    def up(self, timeout_s: float = 60.0) -> bool:
        """Start the cluster and wait until every node is idle. Returns False if it was already
        up (nothing done), True if started. A half-started cluster is stopped on failure."""
        with self._locked():
            if self.is_up():
                return False
            ensure_packages()
            self._stop_daemons()  # leftovers of a half-dead cluster in this state dir
            if _port_in_use(self.ctld_port):
                raise RuntimeError(f"port {self.ctld_port} is in use: another local Slurm "
                                   "cluster (other state dir) runs on this machine?")
            try:
                self._start(timeout_s=timeout_s)
            except BaseException:
                self._stop_all()
                raise
            return True

    def _start(self, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._write_files()
        self._hosts_add()
        with open(self.state_dir / "log" / "daemons.out", "a") as out:
            self._spawn(["munged", f"--socket={self.state_dir}/munge/munge.socket",
                         f"--key-file={self.state_dir}/munge/munge.key",
                         f"--pid-file={self._pid_files()['munged']}",
                         f"--log-file={self.state_dir}/log/munged.log",
                         f"--seed-file={self.state_dir}/munge/munged.seed"], out)
            self._wait_pid("munged", deadline)
            self._spawn(["slurmctld", "-f", str(self.conf_path)], out)
            self._wait_pid("slurmctld", deadline)
            for node in self.nodes:
                script = f'hostname {node} && exec slurmd -N {node} -f "$1"'
                self._spawn(["unshare", "--uts", "--", "sh", "-c", script, "sh",
                             str(self.conf_path)], out)
            for node in self.nodes:
                self._wait_pid(f"slurmd-{node}", deadline)
        self._wait_idle(deadline)

    def _write_files(self) -> None:
        s = self.state_dir
        for sub in ("etc", "munge", "run", "log", "ctld", "dev", "spool"):
            (s / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (s / "spool" / node).mkdir(exist_ok=True)
        (s / "munge").chmod(0o755)  # munged refuses a group/world-writable socket dir
        key = s / "munge" / "munge.key"
        if not key.exists():
            key.touch(mode=0o600)
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for i in range(GPUS_PER_NODE):
            dev = s / "dev" / f"nvidia{i}"
            if not dev.is_symlink():
                dev.unlink(missing_ok=True)
                dev.symlink_to("/dev/null")  # slurmd wants a device: a regular file is refused
        _write(self.conf_path, render_slurm_conf(state_dir=s, num_nodes=self.num_nodes,
                                                 ctld_port=self.ctld_port,
                                                 node_port_base=self.node_port_base))
        _write(s / "etc" / "gres.conf",
               f"AutoDetect=off\nNodeName=node[1-{self.num_nodes}] Name=gpu "
               f"File={s}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n")

    def _spawn(self, argv: list[str], out) -> None:
        """Run a self-daemonizing command; it returns once the daemon has forked."""
        out.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                              check=False, timeout=30, env=self.env())
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed to start (exit {proc.returncode}); see "
                               f"{self.state_dir}/log/daemons.out and the daemon's log")

    def _wait_pid(self, name: str, deadline: float) -> int:
        while time.monotonic() < deadline:
            pid = self._daemon_pid(name)
            if pid:
                return pid
            time.sleep(0.02)
        raise TimeoutError(f"{name} did not start; see {self.state_dir}/log/")

    def _wait_idle(self, deadline: float) -> None:
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                                  text=True, env=self.env(), check=False, timeout=10)
            states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.05)
        raise TimeoutError(f"nodes not idle in time: {states}; see {self.state_dir}/log/")

    # ---- /etc/hosts ----------------------------------------------------------------------------
    def _hosts_lines(self) -> list[str]:
        return [f"127.0.10.{i} {n}  {HOSTS_TAG}" for i, n in enumerate(self.nodes, start=1)]

    def _rewrite_hosts(self, keep_ours: bool) -> None:
        """Rewrite /etc/hosts in place (it may be a bind mount: no rename)."""
        with open(HOSTS_FILE, "r+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            old = fh.read().splitlines()
            new = [line for line in old if not line.rstrip().endswith(HOSTS_TAG)]
            if keep_ours:
                new += self._hosts_lines()
            if new != old:
                fh.seek(0)
                fh.write("\n".join(new) + "\n")
                fh.truncate()

    def _hosts_add(self) -> None:
        self._rewrite_hosts(keep_ours=True)

    # ---- down ----------------------------------------------------------------------------------
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
        env = self.env()
        squeue = ["squeue", "-h", "-o", "%i"]
        jobs = subprocess.run(squeue, capture_output=True, text=True, env=env, check=False,
                              timeout=10).stdout.split()
        if not jobs:
            return
        subprocess.run(["scancel", "--full", *jobs], capture_output=True, env=env, check=False,
                       timeout=10)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            left = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%T"],
                                  capture_output=True, text=True, env=env, check=False,
                                  timeout=10).stdout.split()
            if not any(state in ("RUNNING", "COMPLETING", "CONFIGURING") for state in left):
                return
            time.sleep(0.1)
        log.warning("jobs still running after scancel; stopping the daemons anyway")

    def _stop_daemons(self) -> None:
        order = [f"slurmd-{n}" for n in self.nodes] + ["slurmctld", "munged"]
        for name in order:
            pid = self._daemon_pid(name)
            if pid:
                log.debug("stopping %s (pid %d)", name, pid)
                _stop_pid(pid, timeout_s=10.0)

    def _stop_all(self) -> None:
        self._stop_daemons()
        self._rewrite_hosts(keep_ours=False)

    # ---- status --------------------------------------------------------------------------------
    def status(self) -> ClusterStatus:
        daemons = []
        for name, path in self._pid_files().items():
            pid = self._daemon_pid(name)
            if pid is None:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    pid = int(path.read_text().split()[0])
            daemons.append(DaemonStatus(name=name, pid=pid, alive=self._daemon_pid(name)
                                        is not None))
        sinfo = ""
        if any(d.alive and d.name == "slurmctld" for d in daemons):
            proc = subprocess.run(["sinfo", "-N", "-o", "%N %T %G"], capture_output=True,
                                  text=True, env=self.env(), check=False, timeout=10)
            sinfo = (proc.stdout + proc.stderr).strip()
        return ClusterStatus(daemons=daemons, sinfo=sinfo)

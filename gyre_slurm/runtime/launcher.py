"""Launchers start one node agent per node, with one interface: `start(coordinator_url)`,
`stop()`, `node_names()`, `coordinator_addr()`, `agent_log(i)`, `lost(i)` (node i's
agent is lost: whatever of it still runs is ended, as if the node had gone down).

- `LocalLauncher` runs them as local processes ("virtual nodes"), node i bound to its
  own loopback address (`cluster.node_addr_prefix` + (i + 1)), as a real node would be.
- `SlurmLauncher` (inside a Slurm allocation) starts them as ONE job step:
  `srun --overlap --nodes=N --ntasks-per-node=1 ... gyre_slurm.runtime.agent --addr auto`;
  each agent takes its node index from SLURM_NODEID and binds to its node's own address
  (its hostname resolved); the node list comes from Slurm (`scontrol show hostnames`),
  cells from it in order. Engines get CUDA_VISIBLE_DEVICES from what Slurm gave the step.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.config.checks import MAX_LOCAL_NODES
from gyre_slurm.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class NodeProcess:
    index: int
    addr: str
    proc: subprocess.Popen

    def alive(self) -> bool:
        return self.proc.poll() is None


class LocalLauncher:
    def __init__(self, *, run_dir: Path, num_nodes: int, addr_prefix: str, python: str = sys.executable):
        self.run_dir, self.num_nodes = Path(run_dir), num_nodes
        self.addr_prefix, self.python = addr_prefix, python
        self.nodes: list[NodeProcess] = []

    def node_names(self) -> list[str]:
        return [f"node{i + 1}" for i in range(self.num_nodes)]

    def coordinator_addr(self) -> str:
        return self.addr(0)

    def agent_log(self, index: int) -> Path:
        return self.run_dir / "logs" / f"agent-node{index + 1}.log"

    def addr(self, index: int) -> str:
        return f"{self.addr_prefix}{index + 1}"

    def start(self, coordinator_url: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for i in range(self.num_nodes):
            logf = open(self.run_dir / "logs" / f"agent-node{i + 1}.log", "ab")
            cmd = [self.python, "-m", "gyre_slurm.runtime.agent", "--run-dir", str(self.run_dir),
                   "--node-index", str(i), "--addr", self.addr(i),
                   "--coordinator", coordinator_url, "--shared-host"]
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            logf.close()
            self.nodes.append(NodeProcess(i, self.addr(i), proc))
        log.info("started %d node agents", self.num_nodes)

    def lost(self, index: int) -> None:
        """Kill what is left of a lost virtual node (its engines and rank processes share
        the agent's process group) and reap the agent: a zombie agent would keep its
        engine's parent-pid watch believing it alive."""
        for node in self.nodes:
            if node.index == index:
                try:
                    os.killpg(node.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                # reaped off the caller's thread: the coordinator calls this on its event
                # loop, and a process stuck in the kernel (a hung filesystem) can take
                # seconds to die, a stall every other agent's heartbeat would wait out
                threading.Thread(target=self._reap, args=(node,), daemon=True,
                                 name=f"reap-agent-{index}").start()

    @staticmethod
    def _reap(node: NodeProcess) -> None:
        try:
            node.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("agent of node %d did not exit 30 s after SIGKILL", node.index)

    def stop(self, *, timeout_s: float = 15.0) -> None:
        for node in self.nodes:
            if node.alive():
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            try:
                node.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(node.proc.pid, signal.SIGKILL)
                node.proc.wait(timeout=5)


def slurm_hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                         capture_output=True, text=True, timeout=30)
    return out.stdout.split()


def own_address() -> str:
    """This node's address: its hostname resolved (what the other nodes reach it by)."""
    return socket.gethostbyname(socket.gethostname())


class SlurmLauncher:
    def __init__(self, *, run_dir: Path, num_nodes: int, python: str = sys.executable,
                 env: dict | None = None):
        self.run_dir, self.python = Path(run_dir), python
        self.env = dict(env if env is not None else os.environ)
        job_nodes = int(self.env.get("SLURM_JOB_NUM_NODES", self.env.get("SLURM_NNODES", 0)))
        if job_nodes != num_nodes:
            from gyre_slurm.errors import UserError

            raise UserError(f"the config asks for cluster.num_nodes = {num_nodes} but the Slurm "
                            f"job holds {job_nodes} nodes; submit with --nodes={num_nodes} "
                            f"or set cluster.num_nodes")
        self.num_nodes = num_nodes
        self.names = slurm_hostnames(self.env["SLURM_JOB_NODELIST"])
        self.step: subprocess.Popen | None = None

    def node_names(self) -> list[str]:
        return list(self.names)

    def coordinator_addr(self) -> str:
        return own_address()

    def agent_log(self, index: int) -> Path:
        return self.run_dir / "logs" / f"agent-{self.names[index]}.log"

    def srun_command(self, coordinator_url: str) -> list[str]:
        return ["srun", "--overlap", f"--nodes={self.num_nodes}", "--ntasks-per-node=1",
                f"--ntasks={self.num_nodes}", "--kill-on-bad-exit=0", "--exact",
                f"--output={self.run_dir}/logs/agent-%N.log",
                self.python, "-m", "gyre_slurm.runtime.agent", "--run-dir", str(self.run_dir),
                "--addr", "auto", "--coordinator", coordinator_url]

    def start(self, coordinator_url: str) -> None:
        env = dict(self.env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        logf = open(self.run_dir / "logs" / "srun-agents.log", "ab")
        self.step = subprocess.Popen(self.srun_command(coordinator_url), stdout=logf,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        log.info("srun step started for %d node agents on %s", self.num_nodes, self.names)

    def lost(self, index: int) -> None:
        """Nothing to do here: a lost node's processes died with it (or exit once their
        coordinator stops answering them), and Slurm ends the step's tasks at the end."""

    def stop(self, *, timeout_s: float = 30.0) -> None:
        if self.step is None or self.step.poll() is not None:
            return
        self.step.send_signal(signal.SIGTERM)  # srun forwards it to every agent
        try:
            self.step.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.step.kill()
            self.step.wait(timeout=10)


Launcher = LocalLauncher | SlurmLauncher  # what the coordinator and recovery use


def launcher_kind(kind: str) -> str:
    """`cluster.launcher` as it runs: `auto` is Slurm inside an allocation (SLURM_JOB_ID
    set), else local processes."""
    if kind == "auto":
        return "slurm" if os.environ.get("SLURM_JOB_ID") else "local"
    return kind


def make_launcher(kind: str, *, run_dir: Path, num_nodes: int, addr_prefix: str) -> Launcher:
    """`auto`: Slurm inside an allocation (SLURM_JOB_ID set), else local processes."""
    if launcher_kind(kind) == "slurm":
        return SlurmLauncher(run_dir=run_dir, num_nodes=num_nodes)
    if num_nodes > MAX_LOCAL_NODES:  # `auto` outside a Slurm job (the config checks `local`)
        raise UserError(f"cluster.num_nodes = {num_nodes}: the local launcher (this is not a "
                        f"Slurm job) gives each node one address {addr_prefix}N (N up to "
                        f"{MAX_LOCAL_NODES}); use fewer nodes, or run it as a Slurm job "
                        f"(gyre submit, sbatch sbatch/gyre.sbatch)")
    return LocalLauncher(run_dir=run_dir, num_nodes=num_nodes, addr_prefix=addr_prefix)

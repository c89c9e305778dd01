"""Launchers start one node agent per node. `LocalLauncher` runs them as local
processes ("virtual nodes"), node i bound to its own loopback address
(`runtime.node_addr_prefix` + (i + 1)), as a real node would be, so that moving to
`srun` changes only this file's sibling (the Slurm launcher)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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

    def addr(self, index: int) -> str:
        return f"{self.addr_prefix}{index + 1}"

    def start(self, coordinator_url: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for i in range(self.num_nodes):
            logf = open(self.run_dir / "logs" / f"agent-node{i + 1}.log", "ab")
            cmd = [self.python, "-m", "gyre_slurm.runtime.agent", "--run-dir", str(self.run_dir),
                   "--node-index", str(i), "--addr", self.addr(i),
                   "--coordinator", coordinator_url]
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            logf.close()
            self.nodes.append(NodeProcess(i, self.addr(i), proc))
        log.info("started %d node agents", self.num_nodes)

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

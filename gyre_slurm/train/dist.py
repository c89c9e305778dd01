"""Process groups, one per world "generation", over one long-lived TCPStore.

Protocol: the coordinator hosts a single `TCPStore` for the whole job (`host_store`).
Every new training world gets a new generation number N and its members rendezvous
through `PrefixStore(f"gen{N}/", client)` on that store; the default process group is
destroyed and re-created at every handoff (`join_world`). A prefix is never reused, so
no key left by an old group can be read by a new one: re-initialising through
`init_method="env://"` instead reuses old keys, and then init "succeeds" and the first
collective hangs. Two disjoint worlds may exist at once, each with its own generation.

This module is the only place that creates or destroys process groups: the training
worlds (`join_world`) and the weight-transfer groups (`join_transfer_group`: the
training ranks and the rollout servers' workers, one generation per membership, see
`gyre_slurm.train.wsync`). A transfer group is a process group object of its own, outside
torch.distributed's global state: a training rank is in its world and in a transfer
group at once, and a vLLM worker keeps its own groups.

Nothing that crosses a group is unpickled: objects travel as bytes in uint8 tensors
(`broadcast_text`, `gather_bytes`), which the receiver decodes with a format that
cannot run code (UTF-8 text, safetensors), never `broadcast_object_list` or
`gather_object` (both unpickle what a peer sent).

Gloo binds its sockets to the address the host name resolves to, or to the interface
named by `GLOO_SOCKET_IFNAME`. When the store is on a loopback address (local runs,
tests) and `GLOO_SOCKET_IFNAME` is unset, `join_world` sets it to `lo` so that nothing
listens beyond loopback.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 600.0
_clients: dict[tuple[str, int], object] = {}


@dataclass(frozen=True)
class WorldSpec:
    """One training world: who rendezvous where, and with which backend."""

    generation: int
    world_size: int
    store_host: str
    store_port: int
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.generation < 0 or self.world_size < 1:
            raise ValueError(f"bad world spec: {self}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")

    @property
    def prefix(self) -> str:
        return f"gen{self.generation}/"


def default_backend() -> str:
    """`nccl` where CUDA is available, else `gloo`."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def host_store(host: str, port: int = 0, *, timeout_s: float = STORE_TIMEOUT_S):
    """Host the job's TCPStore on `host:port` (0: any free port). Returns (store, port).

    The listening socket is bound here, to `host` only, and handed to the store (the
    store's own server would listen on every interface). Keep the returned store alive
    for as long as any world may be built."""
    import torch.distributed as dist

    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)  # TCPStore alone would listen on every interface
    sock.listen(1024)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())
    logger.info("hosting the rendezvous store on %s:%d", host, store.port)
    return store, int(store.port)


def _client(host: str, port: int, timeout_s: float):
    import torch.distributed as dist

    key = (host, port)
    if key not in _clients:
        _clients[key] = dist.TCPStore(host, port, is_master=False,
                                      timeout=timedelta(seconds=timeout_s))
    return _clients[key]


def _pin_loopback(host: str) -> None:
    if host.startswith("127.") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def current_world() -> tuple[int, int] | None:
    """(rank, world_size) of the default group, or None when there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def leave_world() -> float:
    """Destroy the default process group, if any. Returns the seconds it took."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return time.perf_counter() - t0


def join_world(spec: WorldSpec, rank: int, *, timeout_s: float = 120.0) -> dict[str, float]:
    """Leave the current world (if any) and join `spec` as `rank`.

    Blocks until all `spec.world_size` members have joined. Returns {"destroy_s", "init_s"}."""
    import torch
    import torch.distributed as dist

    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} outside a world of {spec.world_size}")
    destroy_s = leave_world()
    t0 = time.perf_counter()
    if spec.backend == "gloo":
        _pin_loopback(spec.store_host)
    logger.info("joining generation %d as rank %d/%d through %s:%d", spec.generation, rank,
                spec.world_size, spec.store_host, spec.store_port)
    store = dist.PrefixStore(spec.prefix, _client(spec.store_host, spec.store_port, timeout_s))
    kwargs = {}
    if spec.backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    init_s = time.perf_counter() - t0
    logger.info("joined generation %d as rank %d/%d in %.3f s", spec.generation, rank,
                spec.world_size, init_s)
    return {"destroy_s": destroy_s, "init_s": init_s}


def all_reduce_sum(value: float) -> float:
    """Sum of `value` over the current world (a probe that the group works)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def _device():
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_text(text: str | None, src: int = 0) -> str | None:
    """Rank `src`'s `text` on every rank of the default group (None stays None)."""
    import torch
    import torch.distributed as dist

    dev = _device()
    mine = dist.get_rank() == src
    raw = (text or "").encode() if mine else b""
    length = torch.tensor([-1 if mine and text is None else len(raw)], dtype=torch.int64,
                          device=dev)
    dist.broadcast(length, src)
    n = int(length.item())
    if n <= 0:
        return None if n < 0 else ""
    buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev) if mine
           else torch.empty(n, dtype=torch.uint8, device=dev))
    dist.broadcast(buf, src)
    return bytes(buf.cpu().numpy()).decode()


def gather_bytes(payload: bytes, dst: int = 0) -> list[bytes] | None:
    """Every rank's `payload` on rank `dst`, in rank order (None elsewhere)."""
    import torch
    import torch.distributed as dist

    dev, world = _device(), dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64, device=dev))
    lengths = [int(t.item()) for t in sizes]
    buf = torch.zeros(max(1, max(lengths)), dtype=torch.uint8, device=dev)
    if payload:
        buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    mine = dist.get_rank() == dst
    parts = [torch.empty_like(buf) for _ in range(world)] if mine else None
    dist.gather(buf, parts, dst=dst)
    if not mine:
        return None
    return [bytes(t[:n].cpu().numpy()) for t, n in zip(parts, lengths)]


# ---- weight-transfer groups ---------------------------------------------------------------

TRANSFER_CURRENT_KEY = "wsync/current"
JOIN_TIMEOUT_S = 60.0


class StaleGeneration(RuntimeError):
    """A member was asked to use a transfer generation that is no longer the current one."""


@dataclass(frozen=True)
class TransferSpec:
    """One generation of the weight-transfer group (training ranks first, then the
    rollout servers' workers), on the job's TCPStore under `wsync/gen<N>/`."""

    generation: int
    world_size: int
    store_host: str
    store_port: int
    backend: str = "gloo"
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.generation < 1 or self.world_size < 2 or self.timeout_s <= 0:
            raise ValueError(f"bad transfer group spec: {self}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")

    @property
    def prefix(self) -> str:
        return f"wsync/gen{self.generation}"  # PrefixStore adds the "/"


def announce_transfer_generation(store, generation: int) -> None:
    """The coordinator (holding the store) makes `generation` the current one: members
    asked to join an older one refuse (`StaleGeneration`)."""
    store.set(TRANSFER_CURRENT_KEY, str(int(generation)))


class TransferGroup:
    """A process group of one transfer generation: point-to-point sends and receives
    (`send`, `recv` return torch Work objects), nothing global."""

    def __init__(self, spec: TransferSpec, rank: int, pg):
        self.spec, self.rank, self.pg = spec, rank, pg

    @property
    def generation(self) -> int:
        return self.spec.generation

    def check(self, generation: int) -> None:
        if generation != self.spec.generation:
            raise StaleGeneration(f"transfer generation {generation} refused: this member "
                                  f"is in generation {self.spec.generation}")

    def wait(self, work) -> None:
        """Wait for a send or receive, at most the spec's `timeout_s`."""
        work.wait(timedelta(seconds=self.spec.timeout_s))

    def send(self, tensor, dst: int, tag: int):
        return self.pg.send([tensor], dst, tag)

    def recv(self, tensor, src: int, tag: int):
        return self.pg.recv([tensor], src, tag)

    def close(self) -> None:
        try:
            self.pg.abort() if self.spec.backend == "nccl" else self.pg.shutdown()
        except Exception:  # noqa: BLE001 - a dead peer may leave nothing to shut down
            logger.debug("closing transfer generation %d", self.generation, exc_info=True)


def join_transfer_group(spec: TransferSpec, rank: int, *, host: str | None = None
                        ) -> TransferGroup:
    """Join transfer generation `spec` as `rank` (blocks until all members joined, at
    most max(`spec.timeout_s`, JOIN_TIMEOUT_S)). `host`: this member's own address,
    where gloo listens (default: the host name's). StaleGeneration when the store's
    current generation is another."""
    import torch
    import torch.distributed as dist

    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} outside a transfer group of {spec.world_size}")
    client = _client(spec.store_host, spec.store_port, spec.timeout_s)
    current = int(client.get(TRANSFER_CURRENT_KEY).decode())
    if current != spec.generation:
        raise StaleGeneration(f"transfer generation {spec.generation} refused: the current "
                              f"one is {current}")
    store = dist.PrefixStore(spec.prefix, client)
    # Members come up at their own pace (a server's worker, a rank busy a moment): the
    # rendezvous may take longer than one send (`TransferGroup.wait` bounds those).
    timeout = timedelta(seconds=max(spec.timeout_s, JOIN_TIMEOUT_S))
    t0 = time.perf_counter()
    if spec.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                         else dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(store, rank, spec.world_size, opts)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        torch.cuda.current_device()  # the member's device is set before it joins
        pg = dist.ProcessGroupNCCL(store, rank, spec.world_size, opts)
    logger.info("joined transfer generation %d as rank %d/%d in %.3f s", spec.generation,
                rank, spec.world_size, time.perf_counter() - t0)
    return TransferGroup(spec, rank, pg)

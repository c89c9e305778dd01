"""The rendezvous store and the worlds listen on loopback only; world specs are checked."""

import os
import socket
from pathlib import Path

import pytest

from gyre_slurm.models.tiny import make_model_dir
from gyre_slurm.train.dist import WorldSpec, host_store, join_world
from gyre_slurm.train.harness import WorkerProcesses


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets `pid` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if width == 8:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, words)
            out.append((addr, int(hex_port, 16)))
    return out


def test_store_listens_on_the_given_loopback_address_only():
    store, port = host_store("127.0.0.2")
    try:
        # this process's listening sockets on that port: 127.0.0.2 alone (not 0.0.0.0).
        # (Connecting to 127.0.0.1:port to see it refused reached another test's
        # listener on that port once in CI, 30:24 run of 77033b3: ports are per address.)
        mine = [s for s in listening(os.getpid()) if s[1] == port]
        assert mine == [("127.0.0.2", port)]
        with socket.create_connection(("127.0.0.2", port), timeout=5):
            pass
    finally:
        del store


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """3 worker processes joined in one gloo world on loopback, shared by the tests below
    (each start of the processes imports torch: seconds of CPU per process)."""
    model_dir = make_model_dir(tmp_path_factory.mktemp("world") / "model", vocab_size=300,
                               hidden_size=16, num_layers=1, num_heads=2, max_positions=32)
    store, port = host_store("127.0.0.1")
    try:
        with WorkerProcesses(3, model_dir=model_dir) as w:
            spec = WorldSpec(1, 3, "127.0.0.1", port)
            # the workers import torch first: minutes on a loaded CI machine, not seconds
            w.call({i: ("join", {"spec": spec, "rank": i, "src_rank": 0}) for i in range(3)},
                   timeout_s=240)
            yield w
    finally:
        del store


def test_world_members_listen_on_loopback_only(world):
    assert world.call_all("all_reduce_sum", value=2.0, timeout_s=60) == {0: 6.0, 1: 6.0,
                                                                         2: 6.0}
    sockets = [s for pid in world.pids for s in listening(pid)]
    assert sockets  # gloo listens for its peers ...
    assert all(addr.startswith("127.") for addr, _ in sockets), sockets  # ... on lo


def test_text_and_bytes_cross_the_world_without_pickle(world):
    """What Megatron ranks exchange (the publish directory, each shard's safetensors bytes)
    travels as uint8 tensors: any length, empty, None, non-ASCII, in rank order."""
    w = world
    for text in ("/lustre/run/weights/v000003 ü", None, ""):
        got = w.call({i: ("broadcast_text", {"text": text if i == 1 else "ignored",
                                             "src": 1}) for i in range(3)}, timeout_s=60)
        assert got == {0: text, 1: text, 2: text}
    payloads = {0: b"", 1: bytes(range(256)) * 40, 2: b"\x00pieces"}
    got = w.call({i: ("gather_bytes", {"payload": payloads[i], "dst": 2})
                  for i in range(3)}, timeout_s=60)
    assert got[0] is None and got[1] is None
    assert got[2] == [payloads[0], payloads[1], payloads[2]]


def test_packed_shards_round_trip_and_refuse_other_bytes():
    import torch

    from gyre_slurm.train.megatron import convert

    pieces = {"model.embed_tokens.weight": (torch.arange(12.).view(3, 4)[1:], 0),
              "model.norm.weight": (torch.ones(4, dtype=torch.bfloat16), None)}
    tp_rank, back = convert.unpack_pieces(convert.pack_pieces(1, pieces))
    assert tp_rank == 1 and set(back) == set(pieces)
    for name, (t, dim) in pieces.items():
        assert back[name][1] == dim and torch.equal(back[name][0], t)
    import pickle

    for bad in (b"", b"garbage", pickle.dumps({"tp_rank": 0})):
        with pytest.raises(ValueError, match="not a packed shard"):
            convert.unpack_pieces(bad)


@pytest.mark.parametrize("kwargs", [
    dict(generation=-1, world_size=2), dict(generation=0, world_size=0),
    dict(generation=0, world_size=1, backend="mpi"),
])
def test_bad_world_specs(kwargs):
    with pytest.raises(ValueError):
        WorldSpec(store_host="127.0.0.1", store_port=1, **kwargs)


def test_rank_outside_the_world_is_refused_before_any_rendezvous():
    with pytest.raises(ValueError, match="outside"):
        join_world(WorldSpec(0, 2, "127.0.0.1", 1), 2, timeout_s=1)
    assert WorldSpec(7, 2, "127.0.0.1", 1).prefix == "gen7/"

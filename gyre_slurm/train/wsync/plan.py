"""The transfer plan of a streamed weight sync (pure: shapes only, no I/O, no process group).

A plan says, for one trainer layout, how the policy travels from the training ranks to
the rollout servers' workers:

- `params`: every Hugging Face tensor the servers load (vLLM's checkpoint format), in
  the order of the Hugging Face state dict (embeddings, layer 0, layer 1, ..., final
  norm, output layer), with its full shape;
- `pieces`: each tensor cut into the pieces the trainer holds. A piece is one shard
  coordinate's part of one tensor: (tensor, TP rank, PP stage, the dimension along which
  the TP pieces concatenate, offset and length along it). Pieces come from
  `gyre_slurm.train.megatron.convert` (the same mapping the Hugging Face export uses),
  applied to tensors on the meta device, so every family convert.py knows is planned
  alike; a replicated trainer (the torch backend: every rank holds the whole model) has
  one piece per tensor. Vocabulary padding is cut off (a TP rank holding only padding
  sends nothing of that tensor);
- `buckets`: consecutive tensors, at most `bucket_bytes` of them in the wire dtype (a
  tensor larger than a bucket is a bucket of its own). A bucket may hold pieces of any
  TP ranks and PP stages: where shards begin and end does not matter to it;
- each piece's `sender`: the training rank that holds it, among the data-parallel
  replicas the one of index `bucket % dp` (replicas take turns, so a replicated trainer
  spreads the sending over its ranks); its `tag`: its index (unique within a round).

Expert parallelism: an expert's tensors are whole on the expert-parallel rank holding
that expert (expert TP 1), so their pieces (whole, `tp` 0) come from the rank of that
EP rank in Megatron's expert order ("tp-cp-ep-dp-pp": `TrainerLayout.expert_rank`), the
expert-data-parallel replicas taking turns by bucket as the dense ones do; the dense
tensors are cut as without EP.

Plans travel as JSON (`to_json` / `from_json`) from the coordinator, which computes them,
to the senders and receivers, with a fingerprint each side checks: a piece that two
sides cut differently would otherwise mix tensors silently.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = 1
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}
KINDS = ("replicated", "megatron")


@dataclass(frozen=True)
class TrainerLayout:
    """How the training ranks hold the model. `replicated`: every rank holds all of it
    (the torch backend, data parallel). `megatron`: TP x PP shards, data-parallel
    replicas of them, ranks in Megatron's order (rank = tp + TP * (dp + DP * pp))."""

    kind: str
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism (MoE): experts split over EP ranks of each stage

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"trainer layout kind {self.kind!r}: choose one of {KINDS}")
        if self.kind == "replicated" and (self.tp, self.pp, self.ep) != (1, 1, 1):
            raise ValueError("a replicated trainer has tp = pp = ep = 1")
        if min(self.world_size, self.tp, self.pp) < 1 or self.world_size % (self.tp * self.pp):
            raise ValueError(f"a world of {self.world_size} ranks cannot hold TP {self.tp} x "
                             f"PP {self.pp}")
        if self.ep < 1 or self.world_size % (self.ep * self.pp):
            raise ValueError(f"a world of {self.world_size} ranks cannot hold EP {self.ep} x "
                             f"PP {self.pp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel replicas of each expert."""
        return self.world_size // (self.ep * self.pp)

    def rank(self, *, tp: int, pp: int, dp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def expert_rank(self, *, ep: int, pp: int, edp: int) -> int:
        """The rank holding EP rank `ep`'s experts of stage `pp` in replica `edp`."""
        return ep + self.ep * (edp + self.edp * pp)

    def coords(self) -> list[tuple[int, int]]:
        return [(t, p) for p in range(self.pp) for t in range(self.tp)]

    def to_json(self) -> dict:
        out = {"kind": self.kind, "world_size": self.world_size, "tp": self.tp, "pp": self.pp}
        return {**out, "ep": self.ep} if self.ep != 1 else out


@dataclass(frozen=True)
class Piece:
    param: int
    tp: int
    pp: int
    dim: int | None  # None: the whole tensor
    offset: int
    length: int
    sender: int
    tag: int


@dataclass(frozen=True)
class Plan:
    layout: TrainerLayout
    dtype: str
    bucket_bytes: int
    params: tuple[tuple[str, tuple[int, ...]], ...]
    pieces: tuple[Piece, ...]  # grouped by bucket, then tensor, then TP rank
    buckets: tuple[tuple[int, int], ...]  # [first, end) ranges of `pieces`

    @property
    def torch_dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.dtype]

    def param_bytes(self, index: int) -> int:
        return math.prod(self.params[index][1]) * self.torch_dtype.itemsize

    @property
    def model_bytes(self) -> int:
        return sum(self.param_bytes(i) for i in range(len(self.params)))

    def bucket_pieces(self, bucket: int) -> tuple[Piece, ...]:
        first, end = self.buckets[bucket]
        return self.pieces[first:end]

    def piece_shape(self, piece: Piece) -> tuple[int, ...]:
        shape = list(self.params[piece.param][1])
        if piece.dim is not None:
            shape[piece.dim] = piece.length
        return tuple(shape)

    def senders(self) -> list[int]:
        return sorted({p.sender for p in self.pieces})

    def to_json(self) -> dict:
        body = {"format": FORMAT, "layout": self.layout.to_json(), "dtype": self.dtype,
                "bucket_bytes": self.bucket_bytes,
                "params": [[name, list(shape)] for name, shape in self.params],
                "pieces": [[p.param, p.tp, p.pp, -1 if p.dim is None else p.dim, p.offset,
                            p.length, p.sender] for p in self.pieces],
                "buckets": [list(b) for b in self.buckets]}
        return {**body, "fingerprint": _fingerprint(body)}

    @property
    def fingerprint(self) -> str:
        return self.to_json()["fingerprint"]


def _fingerprint(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def from_json(data: dict) -> Plan:
    """A plan sent as `Plan.to_json()`; ValueError if it is not one or was altered."""
    try:
        body = {k: v for k, v in data.items() if k != "fingerprint"}
        if body["format"] != FORMAT:
            raise ValueError(f"plan format {body['format']!r}, this side reads {FORMAT}")
        if _fingerprint(body) != data["fingerprint"]:
            raise ValueError("the plan's fingerprint does not match its content")
        pieces = tuple(Piece(int(a), int(t), int(p), None if d < 0 else int(d), int(o),
                             int(n), int(s), tag)
                       for tag, (a, t, p, d, o, n, s) in enumerate(body["pieces"]))
        return Plan(layout=TrainerLayout(**body["layout"]), dtype=str(body["dtype"]),
                    bucket_bytes=int(body["bucket_bytes"]),
                    params=tuple((str(n), tuple(int(x) for x in s)) for n, s in body["params"]),
                    pieces=pieces, buckets=tuple((int(a), int(b)) for a, b in body["buckets"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a transfer plan: {type(exc).__name__}: {exc}") from None


# ---- building ---------------------------------------------------------------------------

def hf_meta_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model's Hugging Face checkpoint state dict on the meta device (names and
    shapes only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gyre_slurm.models.tiny import checkpoint_state

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        # the checkpoint's names, which vLLM loads (Qwen3-MoE's experts one by one, not
        # transformers' fused in-memory tensors)
        return dict(checkpoint_state(model))


def shard_pieces(hf: dict[str, torch.Tensor], model_dir: str | Path, layout: TrainerLayout,
                 tp: int, pp: int, ep: int = 0) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Shard coordinate (tp, pp, ep)'s pieces {hf name: (tensor, TP concat dim or None)},
    as its rank holds them (`hf` on the meta device gives their shapes; the senders call
    convert.py on their real shards the same way)."""
    if layout.kind == "replicated":
        return {name: (t, None) for name, t in hf.items()}
    from gyre_slurm.train.megatron import convert

    shape = convert.ModelShape.from_model_dir(model_dir)
    shard = convert.hf_to_megatron_shard(hf, shape, tp_rank=tp, tp_size=layout.tp,
                                         pp_rank=pp, pp_size=layout.pp, ep_rank=ep,
                                         ep_size=layout.ep)
    return convert.megatron_shard_to_hf_pieces(shard, shape, tp_size=layout.tp, pp_rank=pp,
                                               pp_size=layout.pp, ep_rank=ep,
                                               ep_size=layout.ep)


_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def _held(hf, model_dir, layout: TrainerLayout) -> tuple[dict[str, list], set[str]]:
    """{hf name: [(tp or ep, pp, piece shape, dim)]} over the shard coordinates, and the
    names of the expert tensors (held by EP coordinates, whole)."""
    held: dict[str, list] = {}
    experts: set[str] = set()
    for tp, pp in layout.coords():
        for ep in range(layout.ep if tp == 0 else 1):
            for name, (t, dim) in shard_pieces(hf, model_dir, layout, tp, pp, ep).items():
                if _EXPERT.search(name) and layout.ep > 1:
                    experts.add(name)
                    held.setdefault(name, []).append((ep, pp, tuple(t.shape), dim))
                elif ep == 0:
                    held.setdefault(name, []).append((tp, pp, tuple(t.shape), dim))
    return held, experts


def _cut(name: str, full: tuple[int, ...], held: list[tuple[int, int, tuple, int | None]]):
    """(tp, pp, dim, offset, length) of each piece of tensor `name`, from what each shard
    coordinate holds of it: [(tp, pp, piece shape, dim)]."""
    dims = {d for *_, d in held}
    if len(dims) != 1:
        raise ValueError(f"{name}: its pieces concatenate along different dims {dims}")
    dim = dims.pop()
    if dim is None:
        tp, pp, shape, _ = min(held)
        if tuple(shape) != full:
            raise ValueError(f"{name}: a whole piece of shape {tuple(shape)}, the tensor is "
                             f"{full}")
        return [(tp, pp, None, 0, 0)]
    out, offset = [], 0
    for tp, pp, shape, _ in sorted(held):
        length = min(shape[dim], full[dim] - offset)  # vocabulary padding is cut off
        rest = tuple(s for i, s in enumerate(shape) if i != dim)
        if rest != tuple(s for i, s in enumerate(full) if i != dim):
            raise ValueError(f"{name}: piece shape {tuple(shape)} does not fit {full}")
        if length > 0:
            out.append((tp, pp, dim, offset, length))
        offset += shape[dim]
    if sum(o[4] for o in out) != full[dim]:
        raise ValueError(f"{name}: pieces cover {sum(o[4] for o in out)} of {full[dim]} "
                         f"along dim {dim}")
    return out


def build_plan(model_dir: str | Path, layout: TrainerLayout, *, bucket_bytes: int,
               dtype: str = "float32",
               hf: dict[str, torch.Tensor] | None = None) -> Plan:
    """The plan for `layout` (see the module docstring). `hf`: the meta state dict, if
    the caller has it (`hf_meta_state`)."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {dtype!r}: choose one of {sorted(WIRE_DTYPES)}")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    hf = hf_meta_state(model_dir) if hf is None else hf
    held, experts = _held(hf, model_dir, layout)
    if set(held) != set(hf):
        raise ValueError(f"the trainer's pieces name {sorted(set(held) ^ set(hf))[:5]} "
                         f"differently from the Hugging Face state")
    params = tuple((name, tuple(t.shape)) for name, t in hf.items())
    itemsize = WIRE_DTYPES[dtype].itemsize
    pieces: list[Piece] = []
    buckets: list[tuple[int, int]] = []
    size = 0
    for index, (name, shape) in enumerate(params):
        nbytes = math.prod(shape) * itemsize
        if not buckets or (size + nbytes > bucket_bytes and size > 0):
            buckets.append((len(pieces), len(pieces)))
            size = 0
        size += nbytes
        bucket = len(buckets) - 1
        for tp, pp, dim, offset, length in _cut(name, shape, held[name]):
            if name in experts:  # whole, on EP rank `tp` (the coordinate's first field)
                sender = layout.expert_rank(ep=tp, pp=pp, edp=bucket % layout.edp)
                tp = 0
            else:
                sender = layout.rank(tp=tp, pp=pp, dp=bucket % layout.dp)
            pieces.append(Piece(index, tp, pp, dim, offset, length, sender, len(pieces)))
        buckets[-1] = (buckets[-1][0], len(pieces))
    return Plan(layout=layout, dtype=dtype, bucket_bytes=bucket_bytes, params=params,
                pieces=tuple(pieces), buckets=tuple(buckets))

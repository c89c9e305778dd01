"""Hugging Face <-> Megatron-core weights for the llama and qwen2 families (pure torch).

Megatron names (a `GPTModel` with the local layer spec, layers numbered from 0 within
a pipeline stage) and how each is cut from the Hugging Face tensors:

    embedding.word_embeddings.weight     embed_tokens, vocab padded, rows split over TP
    decoder.layers.i.input_layernorm     input_layernorm (replicated)
    ...self_attention.linear_qkv.weight  q/k/v packed per query group: for each KV head g,
                                         [the q heads of g; k_g; v_g]; groups split over TP
    ...self_attention.linear_qkv.bias    the same packing of the q/k/v biases (qwen2)
    ...self_attention.linear_proj        o_proj, columns split over TP
    ...pre_mlp_layernorm                 post_attention_layernorm (replicated)
    ...mlp.linear_fc1.weight             per TP shard t: [gate rows of t; up rows of t]
    ...mlp.linear_fc2.weight             down_proj, columns split over TP
    decoder.final_layernorm.weight       model.norm (last stage)
    output_layer.weight                  lm_head, vocab padded, rows split over TP

Pipeline stage p holds global layers [p * L / PP, (p + 1) * L / PP), the embedding on the
first stage, the final norm and the output layer on the last. The vocabulary is padded
to a multiple of `VOCAB_MULTIPLE` (the same for every layout, so a checkpoint reshards);
padding rows are zero and are cut off on the way back.

`megatron_shard_to_hf_pieces` turns one rank's shard into Hugging Face-named pieces, each
with the dimension along which TP shards concatenate (None: replicated), so a full
Hugging Face state dict is the concatenation of all ranks' pieces (`gather_hf`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_MULTIPLE = 128
FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_LAYER = re.compile(r"^(?:model\.layers|decoder\.layers)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ModelShape:
    """What the conversion and the model build need from a Hugging Face config.json."""

    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    pad_token_id: int

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        path = Path(model_dir) / "config.json"
        cfg = json.loads(path.read_text())
        archs = cfg.get("architectures") or []
        family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
        if family is None:
            family = {"llama": "llama", "qwen2": "qwen2"}.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(f"{path}: architectures {archs} / model_type "
                             f"{cfg.get('model_type')!r}: the Megatron backend supports "
                             f"{', '.join(sorted(FAMILIES))}")
        if cfg.get("tie_word_embeddings", False):
            raise ValueError(f"{path}: tied embeddings are not supported (set "
                             "tie_word_embeddings false)")
        heads = int(cfg["num_attention_heads"])
        scaling = cfg.get("rope_scaling") or None
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"{path}: rope_scaling {scaling} is not supported")
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
        return cls(family=family, vocab_size=int(cfg["vocab_size"]),
                   hidden_size=int(cfg["hidden_size"]),
                   ffn_hidden_size=int(cfg["intermediate_size"]),
                   num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                   rope_theta=float(theta or 10000.0),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   max_positions=int(cfg.get("max_position_embeddings", 4096)),
                   pad_token_id=int(cfg.get("pad_token_id") or 0))

    def check_layout(self, tp_size: int, pp_size: int) -> None:
        """ValueError unless this model can be split over TP x PP."""
        problems = []
        if self.num_kv_heads % tp_size:
            problems.append(f"num_key_value_heads {self.num_kv_heads} % TP {tp_size} != 0")
        if self.ffn_hidden_size % tp_size:
            problems.append(f"intermediate_size {self.ffn_hidden_size} % TP {tp_size} != 0")
        if self.padded_vocab_size % tp_size:
            problems.append(f"padded vocab {self.padded_vocab_size} % TP {tp_size} != 0")
        if self.num_layers % pp_size:
            problems.append(f"num_hidden_layers {self.num_layers} % PP {pp_size} != 0")
        if problems:
            raise ValueError(f"cannot split this model over TP={tp_size} x PP={pp_size}: "
                             + "; ".join(problems))


def stage_layers(shape: ModelShape, pp_rank: int, pp_size: int) -> range:
    """Global indices of the layers on pipeline stage `pp_rank`."""
    per = shape.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return torch.chunk(t, size, dim=dim)[rank]


def _pad_vocab(t: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    extra = shape.padded_vocab_size - t.shape[0]
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def _pack_qkv(q, k, v, shape: ModelShape, tp_rank: int, tp_size: int) -> torch.Tensor:
    """HF q/k/v (weights [out, H] or biases [out]) -> this TP rank's linear_qkv rows."""
    per_group = shape.num_heads // shape.num_kv_heads
    d, rest = shape.head_dim, q.shape[1:]
    q = q.reshape(shape.num_kv_heads, per_group * d, *rest)
    k = k.reshape(shape.num_kv_heads, d, *rest)
    v = v.reshape(shape.num_kv_heads, d, *rest)
    packed = torch.cat([q, k, v], dim=1)  # [groups, (per_group + 2) * d, ...]
    return _chunk(packed, 0, tp_rank, tp_size).reshape(-1, *rest)


def _unpack_qkv(t: torch.Tensor, shape: ModelShape, tp_size: int):
    """This TP rank's linear_qkv rows -> its pieces of HF q, k, v (rows, split on dim 0)."""
    per_group = shape.num_heads // shape.num_kv_heads
    d, rest = shape.head_dim, t.shape[1:]
    groups = shape.num_kv_heads // tp_size
    t = t.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = torch.split(t, [per_group * d, d, d], dim=1)  # views: strided in t
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))  # copies


def _qkv_piece(t: torch.Tensor, shape: ModelShape, tp_size: int, i: int) -> torch.Tensor:
    """q (0), k (1) or v (2) of this TP rank's linear_qkv rows, copied (only that one)."""
    per_group = shape.num_heads // shape.num_kv_heads
    d, rest = shape.head_dim, t.shape[1:]
    t = t.reshape(shape.num_kv_heads // tp_size, (per_group + 2) * d, *rest)
    view = torch.split(t, [per_group * d, d, d], dim=1)[i]
    return view.reshape(-1, *rest)


def hf_to_megatron_shard(hf_state: dict[str, torch.Tensor], shape: ModelShape, *,
                         tp_rank: int, tp_size: int, pp_rank: int,
                         pp_size: int) -> dict[str, torch.Tensor]:
    """One (TP, PP) rank's Megatron state dict (its local names) from a full HF state."""
    shape.check_layout(tp_size, pp_size)
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _chunk(
            _pad_vocab(hf_state["model.embed_tokens.weight"], shape), 0, tp_rank, tp_size)
    for local, layer in enumerate(stage_layers(shape, pp_rank, pp_size)):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
        out[mg + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        attn = hf + "self_attn."
        out[mg + "self_attention.linear_qkv.weight"] = _pack_qkv(
            *(hf_state[f"{attn}{p}_proj.weight"] for p in "qkv"), shape, tp_rank, tp_size)
        if shape.qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = _pack_qkv(
                *(hf_state[f"{attn}{p}_proj.bias"] for p in "qkv"), shape, tp_rank, tp_size)
        out[mg + "self_attention.linear_proj.weight"] = _chunk(
            hf_state[attn + "o_proj.weight"], 1, tp_rank, tp_size)
        gate = _chunk(hf_state[hf + "mlp.gate_proj.weight"], 0, tp_rank, tp_size)
        up = _chunk(hf_state[hf + "mlp.up_proj.weight"], 0, tp_rank, tp_size)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[mg + "mlp.linear_fc2.weight"] = _chunk(
            hf_state[hf + "mlp.down_proj.weight"], 1, tp_rank, tp_size)
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
        out["output_layer.weight"] = _chunk(
            _pad_vocab(hf_state["lm_head.weight"], shape), 0, tp_rank, tp_size)
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_shard_to_hf_pieces(shard: dict[str, torch.Tensor], shape: ModelShape, *,
                                tp_size: int, pp_rank: int, pp_size: int,
                                lazy: bool = False) -> dict[str, tuple[torch.Tensor, int | None]]:
    """One rank's Megatron shard -> {hf_name: (piece, concat dim over TP or None)}. Every
    piece is a view of the shard but q/k/v, which are strided in the fused tensor and
    copied; `lazy`: those come as functions that make the copy when called (the
    streamed sync calls them bucket by bucket, so a rank never holds all the copies)."""
    offset = stage_layers(shape, pp_rank, pp_size).start
    out: dict[str, tuple[torch.Tensor, int | None]] = {}
    for name, t in shard.items():
        if name.endswith("_extra_state"):
            continue
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = (t, 0)
            continue
        if name == "output_layer.weight":
            out["lm_head.weight"] = (t, 0)
            continue
        if name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = (t, None)
            continue
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(f"unknown Megatron parameter {name!r}")
        hf = f"model.layers.{int(m.group(1)) + offset}."
        rest = m.group(2)
        if rest == "input_layernorm.weight":
            out[hf + "input_layernorm.weight"] = (t, None)
        elif rest == "pre_mlp_layernorm.weight":
            out[hf + "post_attention_layernorm.weight"] = (t, None)
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            for i, p in enumerate("qkv"):
                piece = (functools.partial(_qkv_piece, t, shape, tp_size, i) if lazy
                         else _unpack_qkv(t, shape, tp_size)[i])
                out[f"{hf}self_attn.{p}_proj.{kind}"] = (piece, 0)
        elif rest == "self_attention.linear_proj.weight":
            out[hf + "self_attn.o_proj.weight"] = (t, 1)
        elif rest == "mlp.linear_fc1.weight":
            gate, up = torch.chunk(t, 2, dim=0)
            out[hf + "mlp.gate_proj.weight"] = (gate, 0)
            out[hf + "mlp.up_proj.weight"] = (up, 0)
        elif rest == "mlp.linear_fc2.weight":
            out[hf + "mlp.down_proj.weight"] = (t, 1)
        else:
            raise KeyError(f"unknown Megatron parameter {name!r}")
    return out


def pack_pieces(tp_rank: int, pieces: dict[str, tuple[torch.Tensor, int | None]]) -> bytes:
    """One rank's pieces as safetensors bytes (to send to the rank that gathers them):
    the split dims and the TP rank ride in the header's metadata."""
    from safetensors.torch import save

    meta = {"tp_rank": tp_rank, "dims": {name: dim for name, (_, dim) in pieces.items()}}
    return save({name: t.detach().cpu().contiguous().clone() for name, (t, _) in pieces.items()},
                metadata={"gyre": json.dumps(meta)})


def unpack_pieces(data: bytes) -> tuple[int, dict[str, tuple[torch.Tensor, int | None]]]:
    """`pack_pieces`'s bytes -> (tp_rank, pieces). Raises ValueError on anything else."""
    from safetensors.torch import load

    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        meta = json.loads(header["__metadata__"]["gyre"])
        tensors = load(data)
        pieces = {name: (tensors[name], meta["dims"][name]) for name in meta["dims"]}
        return int(meta["tp_rank"]), pieces
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a packed shard ({len(data)} bytes): {exc}") from exc


def gather_hf(pieces_by_rank: list[dict[str, tuple[torch.Tensor, int | None]]],
              tp_ranks: list[int], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Full HF state from every rank's pieces; `tp_ranks[i]` is the TP rank of entry i.

    Pieces of one name concatenate in TP-rank order; a replicated piece is taken once."""
    by_name: dict[str, dict[int, tuple[torch.Tensor, int | None]]] = {}
    for tp_rank, pieces in zip(tp_ranks, pieces_by_rank):
        for name, piece in pieces.items():
            by_name.setdefault(name, {})[tp_rank] = piece
    out = {}
    for name, parts in by_name.items():
        dims = {d for _, d in parts.values()}
        if len(dims) != 1:
            raise ValueError(f"{name}: inconsistent split dims {dims}")
        dim = dims.pop()
        ordered = [parts[r][0] for r in sorted(parts)]
        full = ordered[0] if dim is None else torch.cat(ordered, dim=dim)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            full = full[:shape.vocab_size]
        out[name] = full.detach().clone().contiguous()
    return out


def megatron_shards_to_hf(shards: dict[tuple[int, int], dict[str, torch.Tensor]],
                          shape: ModelShape, *, tp_size: int,
                          pp_size: int) -> dict[str, torch.Tensor]:
    """Full HF state from all shards {(tp_rank, pp_rank): megatron shard}."""
    keys = sorted(shards)
    pieces = [megatron_shard_to_hf_pieces(shards[k], shape, tp_size=tp_size, pp_rank=k[1],
                                          pp_size=pp_size) for k in keys]
    return gather_hf(pieces, [k[0] for k in keys], shape)


def gather_hf_state(local: dict[str, torch.Tensor], shape: ModelShape, *, tp_rank: int,
                    tp_size: int, pp_rank: int, pp_size: int, dp_rank: int, rank: int,
                    world_size: int) -> dict[str, torch.Tensor] | None:
    """The file publish path: every rank's shard (`local`, Megatron names) gathered into
    the full model in Hugging Face names on rank 0 (None elsewhere). Collective over the
    default group; replicas other than data-parallel rank 0 send nothing. Here rather
    than in worker.py: tools/bench_weightsync.py runs it without megatron-core."""
    from gyre_slurm.train import dist as gdist

    mine = b""
    if dp_rank == 0:
        mine = pack_pieces(tp_rank, megatron_shard_to_hf_pieces(
            {k: v.detach().cpu() for k, v in local.items()}, shape, tp_size=tp_size,
            pp_rank=pp_rank, pp_size=pp_size))
    parts = gdist.gather_bytes(mine, dst=0) if world_size > 1 else [mine]
    if rank != 0:
        return None
    parts = [unpack_pieces(p) for p in parts if p]
    return gather_hf([p[1] for p in parts], [p[0] for p in parts], shape)

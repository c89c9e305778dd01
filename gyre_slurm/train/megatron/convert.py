"""Hugging Face <-> Megatron-core weights for every family of `models.shape` (pure torch).

Megatron names (a `GPTModel` with the local layer spec, layers numbered from 0 within a
pipeline stage, experts from 0 within an expert-parallel rank) and how each is cut from
the Hugging Face tensors, as one table per layer (`layer_rules`):

    embedding.word_embeddings.weight     embed_tokens, vocab padded, rows split over TP
    decoder.layers.i.input_layernorm     input_layernorm (replicated)
    ...self_attention.linear_qkv.weight  q/k/v packed per query group: for each KV head g,
                                         [the q heads of g; k_g; v_g]; groups split over TP
    ...self_attention.linear_qkv.bias    the same packing of the q/k/v biases (qwen2)
    ...self_attention.q_layernorm        q_norm, k_norm (qwen3, qwen3_moe; replicated)
    ...self_attention.linear_proj        o_proj, columns split over TP
    ...pre_mlp_layernorm                 post_attention_layernorm (replicated)
    ...mlp.linear_fc1.weight             per TP shard t: [gate rows of t; up rows of t]
    ...mlp.linear_fc2.weight             down_proj, columns split over TP
    ...mlp.router.weight                 mlp.gate (qwen3_moe; replicated)
    ...mlp.experts.local_experts.j.*     mlp.experts.(ep_rank * E / EP + j).* as fc1/fc2
                                         above (expert tensor parallel is 1: whole)
    decoder.final_layernorm.weight       model.norm (last stage)
    output_layer.weight                  lm_head, vocab padded, rows split over TP (tied:
                                         none with PP 1, the embedding's copy on the last
                                         stage with PP > 1, never exported)

Pipeline stage p holds global layers [p * L / PP, (p + 1) * L / PP), the embedding on the
first stage, the final norm and the output layer on the last. The vocabulary is padded
to a multiple of `VOCAB_MULTIPLE` (the same for every layout, so a checkpoint reshards);
padding rows are zero and are cut off on the way back.

`megatron_to_hf(name, tensor, ...)` maps ONE parameter shard to its Hugging Face pieces,
each with the dimension along which TP shards concatenate (None: whole, take one copy:
replicated parameters, and experts, whole on their EP rank),
so a streamed weight sync can convert parameter by parameter; `gather_hf` joins every
rank's pieces into the full state dict.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import torch

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.models.shape import FAMILIES, VOCAB_MULTIPLE, ModelShape  # noqa: F401

_LAYER = re.compile(r"^(?:model\.layers|decoder\.layers)\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter of a layer: its HF source(s) and how TP cuts it.
    kind: "whole" (replicated), "rows"/"columns" (split dim 0/1), "qkv" (packed per
    query group), "gate_up" (per TP shard: [gate rows; up rows])."""

    megatron: str
    hf: tuple[str, ...]
    kind: str


def layer_rules(shape: ModelShape) -> list[Rule]:
    """The per-layer table of `shape`'s family (experts: `expert_rules`)."""
    attn = "self_attn."
    rules = [Rule("input_layernorm.weight", ("input_layernorm.weight",), "whole"),
             Rule("self_attention.linear_qkv.weight",
                  tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"),
             Rule("self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "columns"),
             Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "whole")]
    if shape.qkv_bias:
        rules.append(Rule("self_attention.linear_qkv.bias",
                          tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv"))
    if shape.qk_norm:
        rules += [Rule("self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), "whole"),
                  Rule("self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), "whole")]
    if shape.is_moe:
        rules.append(Rule("mlp.router.weight", ("mlp.gate.weight",), "whole"))
    else:
        rules += [Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                       "gate_up"),
                  Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "columns")]
    return rules


EXPERT_RULES = [Rule("linear_fc1.weight", ("gate_proj.weight", "up_proj.weight"), "gate_up"),
                Rule("linear_fc2.weight", ("down_proj.weight",), "columns")]


def stage_layers(shape: ModelShape, pp_rank: int, pp_size: int) -> range:
    """Global indices of the layers on pipeline stage `pp_rank`."""
    per = shape.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def rank_experts(shape: ModelShape, ep_rank: int, ep_size: int) -> range:
    """Global indices of the experts on expert-parallel rank `ep_rank`."""
    per = shape.num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


# ---- one rule, both directions ------------------------------------------------------------

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


def _to_megatron(rule: Rule, sources: list[torch.Tensor], shape: ModelShape, tp_rank: int,
                 tp_size: int) -> torch.Tensor:
    if rule.kind == "whole":
        return sources[0]
    if rule.kind in ("rows", "columns"):
        return _chunk(sources[0], 0 if rule.kind == "rows" else 1, tp_rank, tp_size)
    if rule.kind == "qkv":
        return _pack_qkv(*sources, shape, tp_rank, tp_size)
    gate, up = (_chunk(s, 0, tp_rank, tp_size) for s in sources)
    return torch.cat([gate, up], dim=0)


def _qkv_piece(t: torch.Tensor, shape: ModelShape, tp_size: int, i: int) -> torch.Tensor:
    """q (0), k (1) or v (2) of this TP rank's linear_qkv rows, copied (only that one)."""
    per_group = shape.num_heads // shape.num_kv_heads
    d, rest = shape.head_dim, t.shape[1:]
    t = t.reshape(shape.num_kv_heads // tp_size, (per_group + 2) * d, *rest)
    view = torch.split(t, [per_group * d, d, d], dim=1)[i]
    return view.reshape(-1, *rest)


def _to_hf(rule: Rule, t: torch.Tensor, shape: ModelShape, tp_size: int,
           lazy: bool = False) -> list[tuple[torch.Tensor, int | None]]:
    """(piece, concat dim over TP) for each of `rule.hf`, from one TP shard: views, but
    q/k/v (strided in the fused tensor: copies; `lazy`: functions that copy)."""
    if rule.kind == "whole":
        return [(t, None)]
    if rule.kind in ("rows", "columns"):
        return [(t, 0 if rule.kind == "rows" else 1)]
    if rule.kind == "qkv":
        if lazy:
            return [(functools.partial(_qkv_piece, t, shape, tp_size, i), 0) for i in range(3)]
        return [(p, 0) for p in _unpack_qkv(t, shape, tp_size)]
    return [(p, 0) for p in torch.chunk(t, 2, dim=0)]


# ---- whole shards -------------------------------------------------------------------------

def hf_to_megatron_shard(hf_state: dict[str, torch.Tensor], shape: ModelShape, *,
                         tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                         ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """One (TP, PP, EP) rank's Megatron state dict (its local names) from a full HF
    state (expert tensor parallelism is 1: each expert whole on its EP rank)."""
    shape.check_layout(tp_size, pp_size, ep_size)
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _chunk(
            _pad_vocab(hf_state["model.embed_tokens.weight"], shape), 0, tp_rank, tp_size)
    rules = layer_rules(shape)
    for local, layer in enumerate(stage_layers(shape, pp_rank, pp_size)):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for rule in rules:
            out[mg + rule.megatron] = _to_megatron(
                rule, [hf_state[hf + n] for n in rule.hf], shape, tp_rank, tp_size)
        if not shape.is_moe:
            continue
        for j, e in enumerate(rank_experts(shape, ep_rank, ep_size)):
            for rule in EXPERT_RULES:
                out[f"{mg}mlp.experts.local_experts.{j}.{rule.megatron}"] = _to_megatron(
                    rule, [hf_state[f"{hf}mlp.experts.{e}.{n}"] for n in rule.hf], shape, 0, 1)
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
        # tied: one stage holds the embedding as its output layer; over PP the last
        # stage holds a copy of it (Megatron keeps the two equal through its embedding
        # group), which the checkpoint does not name
        if not shape.tied_embeddings or pp_size > 1:
            out["output_layer.weight"] = _chunk(_pad_vocab(hf_state[
                "model.embed_tokens.weight" if shape.tied_embeddings else "lm_head.weight"],
                shape), 0, tp_rank, tp_size)
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_to_hf(name: str, tensor: torch.Tensor, shape: ModelShape, *, tp_size: int,
                   pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1,
                   lazy: bool = False) -> dict[str, tuple[torch.Tensor, int | None]]:
    """One Megatron parameter shard -> {hf_name: (piece, concat dim over TP or None)}.

    Vocabulary pieces (`VOCAB_NAMES`) still hold the padding rows: `gather_hf` cuts
    them once the TP pieces are joined. KeyError for a name no rule knows."""
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": (tensor, 0)}
    if name == "output_layer.weight":  # tied: the last stage's copy of the embedding
        return {} if shape.tied_embeddings else {"lm_head.weight": (tensor, 0)}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": (tensor, None)}
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"unknown Megatron parameter {name!r}")
    hf = f"model.layers.{int(m.group(1)) + stage_layers(shape, pp_rank, pp_size).start}."
    rest, rules, tp = m.group(2), layer_rules(shape), tp_size
    e = _EXPERT.match(rest)
    if e is not None and shape.is_moe:  # whole on its EP rank (expert TP 1): dim None
        expert = rank_experts(shape, ep_rank, ep_size)[int(e.group(1))]
        rule = next((r for r in EXPERT_RULES if r.megatron == e.group(2)), None)
        if rule is None:
            raise KeyError(f"unknown Megatron parameter {name!r} for a {shape.family} model")
        return {f"{hf}mlp.experts.{expert}.{n}": (piece, None)
                for n, (piece, _) in zip(rule.hf, _to_hf(rule, tensor, shape, 1))}
    rule = next((r for r in rules if r.megatron == rest), None)
    if rule is None:
        raise KeyError(f"unknown Megatron parameter {name!r} for a {shape.family} model")
    return {hf + n: piece for n, piece in zip(rule.hf, _to_hf(rule, tensor, shape, tp, lazy))}


def megatron_shard_to_hf_pieces(shard: dict[str, torch.Tensor], shape: ModelShape, *,
                                tp_size: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                                ep_size: int = 1,
                                lazy: bool = False) -> dict[str, tuple[torch.Tensor, int | None]]:
    """One rank's Megatron shard -> {hf_name: (piece, concat dim over TP or None)}. Every
    piece is a view of the shard but q/k/v, which are strided in the fused tensor and
    copied; `lazy`: those come as functions that make the copy when called (the
    streamed sync calls them bucket by bucket, so a rank never holds all the copies)."""
    out: dict[str, tuple[torch.Tensor, int | None]] = {}
    for name, t in shard.items():
        if not name.endswith("_extra_state"):
            out.update(megatron_to_hf(name, t, shape, tp_size=tp_size, pp_rank=pp_rank,
                                      pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size,
                                      lazy=lazy))
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
        header = loads_json(data[8:8 + n])
        meta = loads_json(header["__metadata__"]["gyre"])
        tensors = load(data)
        pieces = {name: (tensors[name], meta["dims"][name]) for name in meta["dims"]}
        return int(meta["tp_rank"]), pieces
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a packed shard ({len(data)} bytes): {exc}") from exc


def gather_hf(pieces_by_rank: list[dict[str, tuple[torch.Tensor, int | None]]],
              tp_ranks: list[int], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Full HF state from every rank's pieces; `tp_ranks[i]` is the TP rank of entry i.

    Pieces of one name concatenate in TP-rank order; a whole piece is taken once."""
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
        if name in VOCAB_NAMES:
            full = full[:shape.vocab_size]
        out[name] = full.detach().clone().contiguous()
    return out


def megatron_shards_to_hf(shards: dict[tuple, dict[str, torch.Tensor]], shape: ModelShape,
                          *, tp_size: int, pp_size: int,
                          ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Full HF state from all shards {(tp_rank, pp_rank[, ep_rank]): megatron shard}."""
    keys = sorted(shards)
    pieces = [megatron_shard_to_hf_pieces(shards[k], shape, tp_size=tp_size, pp_rank=k[1],
                                          pp_size=pp_size, ep_rank=k[2] if len(k) > 2 else 0,
                                          ep_size=ep_size) for k in keys]
    return gather_hf(pieces, [k[0] for k in keys], shape)


def gather_hf_state(local: dict[str, torch.Tensor], shape: ModelShape, *, tp_rank: int,
                    tp_size: int, pp_rank: int, pp_size: int, dp_rank: int, rank: int,
                    world_size: int, ep_rank: int = 0, ep_size: int = 1,
                    edp_rank: int | None = None) -> dict[str, torch.Tensor] | None:
    """The file publish path: every rank's shard (`local`, Megatron names) gathered into
    the full model in Hugging Face names on rank 0 (None elsewhere). Collective over the
    default group; replicas other than data-parallel rank 0 send nothing of the dense
    parameters, and of the experts (EP rank `ep_rank` of `ep_size`) ranks other than
    expert-data-parallel rank 0 (`edp_rank`; with EP the experts of one replica may sit
    on other data-parallel ranks). Here rather than in worker.py:
    tools/bench_weightsync.py runs it without megatron-core."""
    from gyre_slurm.train import dist as gdist

    edp_rank = dp_rank if edp_rank is None else edp_rank
    keep = {k: v.detach().cpu() for k, v in local.items()
            if (edp_rank if ".mlp.experts." in k else dp_rank) == 0}
    mine = b""
    if keep:
        mine = pack_pieces(tp_rank, megatron_shard_to_hf_pieces(
            keep, shape, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
            ep_rank=ep_rank, ep_size=ep_size))
    parts = gdist.gather_bytes(mine, dst=0) if world_size > 1 else [mine]
    if rank != 0:
        return None
    parts = [unpack_pieces(p) for p in parts if p]
    return gather_hf([p[1] for p in parts], [p[0] for p in parts], shape)

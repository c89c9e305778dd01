"""What gyre needs to know of a model, read from its Hugging Face `config.json` (pure:
no torch; the trainers, the weight conversion and the memory calculator share it).

Families (`FAMILIES`, by `architectures` or `model_type`):

| family    | architecture          | beyond Llama                                        |
|-----------|-----------------------|-----------------------------------------------------|
| llama     | LlamaForCausalLM      | -                                                   |
| qwen2     | Qwen2ForCausalLM      | biases on q/k/v                                     |
| qwen3     | Qwen3ForCausalLM      | RMS norm on each head's q and k; head_dim its own   |
| qwen3_moe | Qwen3MoeForCausalLM   | qwen3 + a mixture of experts in every layer (top-k  |
|           |                       | softmax router, no shared expert)                   |

A config this code cannot train faithfully (rope scaling, biases on the output
projection, dense layers among MoE ones, shared experts) is refused with the key that
says so, rather than trained as another model. Tied embeddings (`tie_word_embeddings`)
are one tensor, `model.embed_tokens.weight`, in checkpoints and in Megatron
(`share_embeddings_and_output_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.errors import UserError

VOCAB_MULTIPLE = 128
FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only model, in one family's terms."""

    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int  # the dense MLP's (every layer of a dense model)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_positions: int = 4096
    pad_token_id: int = 0
    num_experts: int = 0  # 0: dense
    moe_top_k: int = 0  # experts per token
    moe_ffn_hidden_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = True  # renormalise the top-k routing weights
    tied_embeddings: bool = False  # tie_word_embeddings: the output layer is the embedding

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        from gyre_slurm.common.yamltext import read_text

        path = Path(model_dir) / "config.json"
        try:
            cfg = loads_json(read_text(path, what=str(path)))  # at most 64 MB, UTF-8
        except FileNotFoundError:
            raise ValueError(f"{model_dir}: no config.json (a Hugging Face model directory "
                             "holds config.json, the tokenizer and safetensors weights)") from None
        except NotADirectoryError:
            raise ValueError(f"{model_dir} is neither a model directory nor a config.json "
                             f"file") from None
        except OSError as exc:
            raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
        except UserError:
            raise
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        return cls.from_config(cfg, source=str(path))

    @classmethod
    def from_config(cls, cfg: dict, *, source: str = "config.json") -> ModelShape:
        """From a config.json's contents; ValueError naming the key for what is refused
        (a key missing, of the wrong type or out of range, or a model gyre cannot train)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: a model config is a JSON object, not "
                             f"{type(cfg).__name__}")
        family = _family(cfg, source)
        _refuse_unsupported(cfg, family, source)
        num = _Reader(cfg, source)
        heads = num.int("num_attention_heads")
        hidden = num.int("hidden_size")
        kv_heads = num.int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        head_dim = num.int("head_dim", default=hidden // heads if hidden >= heads else None)
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(cfg.get("rope_parameters"), dict):
            theta = cfg["rope_parameters"].get("rope_theta")
        moe = family == "qwen3_moe"
        return cls(family=family, vocab_size=num.int("vocab_size"), hidden_size=hidden,
                   ffn_hidden_size=num.int("intermediate_size", default=0, lo=0 if moe else 1),
                   num_layers=num.int("num_hidden_layers"), num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim,
                   rope_theta=num.float("rope_theta", theta, default=10000.0),
                   rms_norm_eps=num.float("rms_norm_eps", cfg.get("rms_norm_eps"),
                                          default=1e-6, hi=1.0),
                   max_positions=num.int("max_position_embeddings", default=4096),
                   pad_token_id=num.int("pad_token_id", default=0, lo=0),
                   num_experts=_num_experts(cfg, source) if moe else 0,
                   moe_top_k=num.int("num_experts_per_tok") if moe else 0,
                   moe_ffn_hidden_size=num.int("moe_intermediate_size") if moe else 0,
                   norm_topk_prob=num.bool("norm_topk_prob", default=True),
                   tied_embeddings=num.bool("tie_word_embeddings", default=False))

    def check_layout(self, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
        """ValueError unless this model can be split over TP x PP (x EP for experts)."""
        problems = []
        if self.num_kv_heads % tp_size:
            problems.append(f"num_key_value_heads {self.num_kv_heads} % TP {tp_size} != 0")
        if not self.is_moe and self.ffn_hidden_size % tp_size:
            problems.append(f"intermediate_size {self.ffn_hidden_size} % TP {tp_size} != 0")
        if self.padded_vocab_size % tp_size:
            problems.append(f"padded vocab {self.padded_vocab_size} % TP {tp_size} != 0")
        if self.num_layers % pp_size:
            problems.append(f"num_hidden_layers {self.num_layers} % PP {pp_size} != 0")
        if ep_size > 1 and not self.is_moe:
            problems.append(f"expert parallel {ep_size} needs a mixture-of-experts model "
                            f"({self.family} is dense)")
        elif self.is_moe and self.num_experts % ep_size:
            problems.append(f"num_experts {self.num_experts} % EP {ep_size} != 0")
        if problems:
            raise ValueError(f"cannot split this model over TP={tp_size} x PP={pp_size}"
                             + (f" x EP={ep_size}" if ep_size > 1 else "") + ": "
                             + "; ".join(problems))

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a Hugging Face checkpoint of this model holds, with its shape
        (what the Megatron conversion reads; a checkpoint that differs is not this
        config's model)."""
        h, d, v = self.hidden_size, self.head_dim, self.vocab_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h),
                                           "model.norm.weight": (h,)}
        if not self.tied_embeddings:  # tied: the checkpoint names the tensor once
            out["lm_head.weight"] = (v, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out.update({p + "input_layernorm.weight": (h,),
                        p + "post_attention_layernorm.weight": (h,),
                        p + "self_attn.q_proj.weight": (q, h),
                        p + "self_attn.k_proj.weight": (kv, h),
                        p + "self_attn.v_proj.weight": (kv, h),
                        p + "self_attn.o_proj.weight": (h, q)})
            if self.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
            if self.qk_norm:
                out.update({p + "self_attn.q_norm.weight": (d,),
                            p + "self_attn.k_norm.weight": (d,)})
            if self.is_moe:
                f = self.moe_ffn_hidden_size
                out[p + "mlp.gate.weight"] = (self.num_experts, h)
                for e in range(self.num_experts):
                    out.update({f"{p}mlp.experts.{e}.gate_proj.weight": (f, h),
                                f"{p}mlp.experts.{e}.up_proj.weight": (f, h),
                                f"{p}mlp.experts.{e}.down_proj.weight": (h, f)})
            else:
                f = self.ffn_hidden_size
                out.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                            p + "mlp.down_proj.weight": (h, f)})
        return out

    def num_params(self) -> dict[str, int]:
        """Parameter counts: "total", "expert" (all experts), "dense" (the rest),
        "embedding" (input embedding + output layer, unpadded)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        attn += (self.num_heads + 2 * self.num_kv_heads) * d if self.qkv_bias else 0
        attn += 2 * d if self.qk_norm else 0
        norms = 2 * h
        if self.is_moe:
            expert = self.num_experts * 3 * h * self.moe_ffn_hidden_size
            mlp_dense = self.num_experts * h  # the router
        else:
            expert, mlp_dense = 0, 3 * h * self.ffn_hidden_size
        embedding = (1 if self.tied_embeddings else 2) * self.vocab_size * h
        dense = self.num_layers * (attn + norms + mlp_dense) + h + embedding
        expert *= self.num_layers
        return {"total": dense + expert, "expert": expert, "dense": dense,
                "embedding": embedding}


MAX_DIM = (1 << 31) - 1  # a size beyond any model (and beyond Megatron's int32 shapes)
_REQUIRED = object()


class _Reader:
    """A config's numbers, each checked: an int (not a bool, not 1.5) in [lo, hi], or a
    finite float in (0, hi]; the error names the key and the value."""

    def __init__(self, cfg: dict, source: str) -> None:
        self.cfg, self.source = cfg, source

    def int(self, key: str, *, default=_REQUIRED, lo: int = 1, hi: int = MAX_DIM) -> int:
        value = self.cfg.get(key)
        if value is None:
            if default is _REQUIRED or default is None:
                raise ValueError(f"{self.source}: {key} is missing (a whole number >= {lo})")
            return default
        if isinstance(value, float) and value.is_integer() and abs(value) <= hi:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"{self.source}: {key} = {value!r} must be a whole number in "
                             f"{lo}..{hi}")
        return value

    def float(self, key: str, value, *, default: float, hi: float = 1e12) -> float:
        if value is None:
            return default
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not 0 < value <= hi:  # also NaN
            raise ValueError(f"{self.source}: {key} = {value!r} must be a number in (0, {hi:g}]")
        return float(value)

    def bool(self, key: str, *, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.source}: {key} = {value!r} must be true or false")
        return value


def _num_experts(cfg: dict, source: str) -> int:
    """Published Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts."""
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    return _Reader(cfg, source).int(key)


def _family(cfg: dict, source: str) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{source}: architectures = {archs!r} must be a list of names, "
                         f"e.g. [\"LlamaForCausalLM\"]")
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    model_type = cfg.get("model_type", "")
    family = family or (MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None)
    if family is None:
        raise ValueError(f"{source}: architectures {archs} / model_type "
                         f"{cfg.get('model_type')!r}: gyre's Megatron backend supports "
                         f"{', '.join(sorted(FAMILIES))}")
    return family


def _refuse_unsupported(cfg: dict, family: str, source: str) -> None:
    def refuse(key: str, why: str) -> None:
        raise ValueError(f"{source}: {key} = {cfg.get(key)!r}: {why}")

    scaling = cfg.get("rope_scaling") or None
    if scaling is not None and not isinstance(scaling, dict):
        refuse("rope_scaling", "must be an object (or null)")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        refuse("rope_scaling", "only plain RoPE is supported")
    if family != "qwen2" and cfg.get("attention_bias", False):
        refuse("attention_bias", "biases on the attention projections are supported for "
               "qwen2 (q/k/v) only")
    if cfg.get("mlp_bias", False):
        refuse("mlp_bias", "biases on the MLP are not supported")
    if family != "qwen3_moe":
        return
    num = _Reader(cfg, source)
    if num.int("decoder_sparse_step", default=1, lo=0) != 1:
        refuse("decoder_sparse_step", "every layer must be a mixture-of-experts layer "
               "(decoder_sparse_step 1)")
    if cfg.get("mlp_only_layers"):
        refuse("mlp_only_layers", "dense layers among the MoE layers are not supported")
    if num.int("shared_expert_intermediate_size", default=0, lo=0):
        refuse("shared_expert_intermediate_size", "shared experts are not supported")
    experts = _num_experts(cfg, source)
    num.int("num_experts_per_tok", hi=experts)  # 1..num_experts
    num.int("moe_intermediate_size")

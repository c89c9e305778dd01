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

A config this code cannot train faithfully (tied embeddings, rope scaling, biases on
the output projection, dense layers among MoE ones, shared experts) is refused with the
key that says so, rather than trained as another model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.common.fsio import loads_json

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
        path = Path(model_dir) / "config.json"
        try:
            cfg = loads_json(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{model_dir}: no config.json (a Hugging Face model directory "
                             "holds config.json, the tokenizer and safetensors weights)") from None
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        return cls.from_config(cfg, source=str(path))

    @classmethod
    def from_config(cls, cfg: dict, *, source: str = "config.json") -> ModelShape:
        """From a config.json's contents; ValueError naming the key for what is refused."""
        family = _family(cfg, source)
        _refuse_unsupported(cfg, family, source)
        heads = int(cfg["num_attention_heads"])
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
        moe = family == "qwen3_moe"
        return cls(family=family, vocab_size=int(cfg["vocab_size"]),
                   hidden_size=int(cfg["hidden_size"]),
                   ffn_hidden_size=int(cfg.get("intermediate_size") or 0),
                   num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                   rope_theta=float(theta or 10000.0),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   max_positions=int(cfg.get("max_position_embeddings", 4096)),
                   pad_token_id=int(cfg.get("pad_token_id") or 0),
                   num_experts=_num_experts(cfg) if moe else 0,
                   moe_top_k=int(cfg.get("num_experts_per_tok") or 0) if moe else 0,
                   moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0) if moe else 0,
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))

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
        embedding = 2 * self.vocab_size * h
        dense = self.num_layers * (attn + norms + mlp_dense) + h + embedding
        expert *= self.num_layers
        return {"total": dense + expert, "expert": expert, "dense": dense,
                "embedding": embedding}


def _num_experts(cfg: dict) -> int:
    """Published Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _family(cfg: dict, source: str) -> str:
    archs = cfg.get("architectures") or []
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    family = family or MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        raise ValueError(f"{source}: architectures {archs} / model_type "
                         f"{cfg.get('model_type')!r}: gyre's Megatron backend supports "
                         f"{', '.join(sorted(FAMILIES))}")
    return family


def _refuse_unsupported(cfg: dict, family: str, source: str) -> None:
    def refuse(key: str, why: str) -> None:
        raise ValueError(f"{source}: {key} = {cfg.get(key)!r}: {why}")

    if cfg.get("tie_word_embeddings", False):
        refuse("tie_word_embeddings", "tied input and output embeddings are not supported "
               "(the checkpoint needs its own lm_head.weight)")
    scaling = cfg.get("rope_scaling") or None
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        refuse("rope_scaling", "only plain RoPE is supported")
    if family != "qwen2" and cfg.get("attention_bias", False):
        refuse("attention_bias", "biases on the attention projections are supported for "
               "qwen2 (q/k/v) only")
    if cfg.get("mlp_bias", False):
        refuse("mlp_bias", "biases on the MLP are not supported")
    if family != "qwen3_moe":
        return
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        refuse("decoder_sparse_step", "every layer must be a mixture-of-experts layer "
               "(decoder_sparse_step 1)")
    if cfg.get("mlp_only_layers"):
        refuse("mlp_only_layers", "dense layers among the MoE layers are not supported")
    if int(cfg.get("shared_expert_intermediate_size") or 0):
        refuse("shared_expert_intermediate_size", "shared experts are not supported")
    experts, top_k = _num_experts(cfg), int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"{source}: num_experts_per_tok {top_k} must be in 1..num_experts "
                         f"({experts})")
    if not int(cfg.get("moe_intermediate_size") or 0):
        refuse("moe_intermediate_size", "must be > 0")

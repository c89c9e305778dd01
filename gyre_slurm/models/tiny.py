"""A tiny causal LM and its tokenizer, made locally (nothing is downloaded).

`make_model_dir(path, family=...)` writes a Hugging Face model directory: `config.json` (a
small model of one of `FAMILIES`: Llama; Qwen2, the same shape plus biases on q/k/v;
Qwen3, RMS norms on each head's queries and keys instead; Qwen3-MoE, Qwen3 with a
mixture of experts in every layer, top-k routing, no shared expert), the tokenizer
(byte-level BPE trained here on a fixed corpus, with a chat template) and nothing else; weights live per policy version under
`RUN_DIR/weights/vNNNNNN/model.safetensors` (`save_weights`, `load_weights`). The same
directory serves the embedded rollout engine and the trainer, so both see one model.
torch and transformers are imported inside the functions: importing this module is free.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from gyre_slurm.common.fsio import loads_json

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEIGHTS_FILE = "model.safetensors"


def _corpus() -> list[str]:
    words = ("the quick brown fox jumps over the lazy dog agent tool call result file test "
             "pass fail error run build repo answer yes no red green blue left right up down")
    digits = " ".join(str(i) for i in range(100))
    return [words, digits] * 40 + [f"step {i}: {words.split()[i % 20]}" for i in range(200)]


FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _family_config(family: str, *, num_experts: int, experts_per_token: int,
                   moe_ffn_hidden_size: int | None, head_dim: int | None, **common):
    """The transformers config object of a tiny model of `family`."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    hidden = common["hidden_size"]
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    head_dim = head_dim or hidden // common["num_attention_heads"]
    if family == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    if not 0 < experts_per_token <= num_experts:
        raise ValueError(f"experts_per_token {experts_per_token} must be in 1..num_experts "
                         f"({num_experts})")
    return Qwen3MoeConfig(head_dim=head_dim, num_experts=num_experts,
                          num_experts_per_tok=experts_per_token, norm_topk_prob=True,
                          moe_intermediate_size=moe_ffn_hidden_size or hidden // 2,
                          decoder_sparse_step=1, mlp_only_layers=[], **common)


def make_model_dir(path: str | Path, *, vocab_size: int = 512, hidden_size: int = 64,
                   num_layers: int = 2, num_heads: int = 4, num_kv_heads: int | None = None,
                   max_positions: int = 4096, family: str = "llama",
                   head_dim: int | None = None, num_experts: int = 8,
                   experts_per_token: int = 2,
                   moe_ffn_hidden_size: int | None = None) -> Path:
    """Write config + tokenizer to `path` (atomically: temp dir, then rename).

    `family`: one of `FAMILIES` ("llama": LlamaForCausalLM; "qwen2": q/k/v biases;
    "qwen3": per-head q/k RMS norms, `head_dim` (default hidden_size / num_heads);
    "qwen3_moe": Qwen3 with `num_experts` experts of `moe_ffn_hidden_size` (default
    hidden_size / 2) in every layer, `experts_per_token` routed per token).
    `num_kv_heads` < `num_heads` makes grouped-query attention (default: equal)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family not in FAMILIES:
        raise ValueError(f"model family {family!r}: choose one of {', '.join(FAMILIES)}")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads or (head_dim is None and hidden_size % num_heads):
        raise ValueError(f"hidden_size {hidden_size}, num_heads {num_heads}, num_kv_heads "
                         f"{num_kv_heads}: heads must divide hidden_size, kv heads the heads")
    if head_dim is not None and family not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"head_dim is set by hidden_size / num_heads for {family}; an "
                         "independent head_dim is for qwen3 and qwen3_moe")

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # it wrote blank lines to stdout
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp)
    config = _family_config(
        family, num_experts=num_experts, experts_per_token=experts_per_token,
        moe_ffn_hidden_size=moe_ffn_hidden_size, head_dim=head_dim,
        vocab_size=len(fast), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=False, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        torch_dtype="float32")
    # what a published checkpoint says, and what vLLM resolves the model class by (from
    # model_type alone it takes Qwen3Model, an embedding model)
    config.architectures = [ARCHITECTURES[family]]
    config.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def load_tokenizer(model_dir: str | Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt, ending with the assistant header."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def new_model(model_dir: str | Path, *, seed: int = 0, attn_implementation: str | None = None):
    """A freshly initialised model from the directory's config (deterministic for a seed);
    `attn_implementation`: a transformers attention implementation (None: its default)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_config(config, **extra)
    return model.float()


def checkpoint_state(model) -> dict:
    """The model's weights under the names a Hugging Face checkpoint stores them by.

    transformers 5 holds some layers fused in memory (Qwen3-MoE's experts as two 3-D
    tensors per layer) and writes them per expert, as every published checkpoint (and
    vLLM's loader) has them; its own `revert_weight_conversion` (what `save_pretrained`
    calls) does the unfusing. Models without such layers come back unchanged."""
    from transformers.core_model_loading import revert_weight_conversion

    tied = tied_weights(model)
    return revert_weight_conversion(model, {k: v for k, v in model.state_dict().items()
                                            if k not in tied})


def tied_weights(model) -> dict[str, str]:
    """{name: the name it is tied to} of a model's tied weights (`tie_word_embeddings`:
    lm_head.weight is model.embed_tokens.weight, as in most small published models).
    A checkpoint stores only the second name, as transformers and vLLM write and read
    it; safetensors refuses to write one tensor under two names."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


_FUSED_EXPERTS = ".mlp.experts.gate_up_proj"


def model_state(model, state: dict) -> dict:
    """A checkpoint's state dict (`checkpoint_state`'s names) in the model's in-memory
    names: per-expert gate/up/down projections stacked into the fused 3-D tensors
    transformers holds (`gate_up_proj[e] = [gate_e; up_e]`, `down_proj[e] = down_e`)."""
    import torch

    out = dict(state)
    for target, source in tied_weights(model).items():
        # one tensor, the source's values (a checkpoint may hold the target too: the
        # import took it only as the source's copy, `_check_tied_copies`)
        out.pop(target, None)
        if source in out:
            out[target] = out[source]
    for key, value in model.state_dict().items():
        if not key.endswith(_FUSED_EXPERTS):
            continue
        prefix = key[: -len("gate_up_proj")]
        names = {p: [f"{prefix}{e}.{p}_proj.weight" for e in range(value.shape[0])]
                 for p in ("gate", "up", "down")}
        if not all(n in out for ns in names.values() for n in ns):
            continue  # already fused (or missing: load_state_dict names what is)
        out[key] = torch.stack([torch.cat([out.pop(g), out.pop(u)])
                                for g, u in zip(names["gate"], names["up"])])
        out[prefix + "down_proj"] = torch.stack([out.pop(d) for d in names["down"]])
    return out


def save_weights(model, out_dir: str | Path) -> Path:
    """Write `out_dir/model.safetensors` atomically (temp dir, then rename), in the
    checkpoint's names (`checkpoint_state`)."""
    return save_state(checkpoint_state(model), out_dir)


def save_state(state, out_dir: str | Path) -> Path:
    """Write a Hugging Face state dict as `out_dir/model.safetensors` (+ meta.json)
    atomically: temp dir, then rename. Every trainer publishes through here."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "meta.json").write_text(json.dumps({"num_tensors": len(state)}))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


class CorruptWeights(ValueError):
    """A weights file that is not whole (truncated, or not a safetensors file)."""


def verify_weights(weights_dir: str | Path) -> Path:
    """Check `weights_dir/model.safetensors` (or every shard its index lists) is whole
    before anyone loads it: the header parses and the file is exactly as long as its
    tensors say (a truncated or garbled file would otherwise fail deep inside
    safetensors, or not at all), and each shard holds what the index places in it.
    Returns the path (the index's, for shards); raises `CorruptWeights` naming the file,
    its size and what is wrong."""
    return _verified_headers(weights_dir)[0]


def weight_headers(weights_dir: str | Path) -> dict[str, dict]:
    """{tensor name: its safetensors header entry (dtype, shape)} of a whole weights dir
    (`verify_weights`'s checks; headers only, no tensor is read)."""
    return _verified_headers(weights_dir)[1]


def _verified_headers(weights_dir: str | Path) -> tuple[Path, dict[str, dict]]:
    """`verify_weights`'s path and every tensor's header entry, each file read once."""
    from gyre_slurm.models.weights import INDEX, weight_files

    index = Path(weights_dir) / INDEX
    if not index.is_file():
        path = Path(weights_dir) / WEIGHTS_FILE
        return path, _verify_file(path)
    try:
        listed = weight_files(weights_dir)
    except ValueError as exc:
        raise CorruptWeights(str(exc)) from None
    headers: dict[str, dict] = {}
    for f in sorted(set(listed.values())):
        held = _verify_file(f)
        absent = sorted(name for name, g in listed.items() if g == f and name not in held)
        if absent:
            raise CorruptWeights(f"{index} places {len(absent)} tensor(s) in {f.name}, "
                                 f"which does not hold them: {absent[:3]}")
        headers.update(held)
    return index, headers


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_weights_fit(shape, weights_dir: str | Path) -> None:
    """CorruptWeights unless the checkpoint holds every tensor `shape` (a `ModelShape`)
    needs, each with its shape and a floating dtype: a checkpoint of another model (or
    a config edited without its weights) is named here, not deep inside a trainer."""
    headers = weight_headers(weights_dir)
    problems = _fit_problems(headers, shape.hf_tensor_shapes())
    if not problems and shape.tied_embeddings and "lm_head.weight" in headers:
        _check_tied_copies(weights_dir, {"lm_head.weight": "model.embed_tokens.weight"})
    if problems:
        raise CorruptWeights(f"{weights_dir}: the weights are not the model its config.json "
                             f"describes ({shape.family}, hidden {shape.hidden_size}, "
                             f"{shape.num_layers} layers): " + "; ".join(problems))


def _fit_problems(headers: dict[str, dict], want: dict[str, tuple], *,
                  extra: list[str] = ()) -> list[str]:
    """What keeps a checkpoint's tensors (`headers`, safetensors header entries) from
    being the model's (`want`: name -> shape): tensors missing, `extra` ones, shapes
    other than the config's, dtypes that are not floating (the first few of each)."""
    def shape_of(entry) -> tuple | None:
        dims = entry.get("shape")
        return tuple(dims) if isinstance(dims, list) else None

    missing = [n for n in want if n not in headers]
    wrong = [f"{n} is {list(shape_of(headers[n]) or ()) or headers[n].get('shape')}, "
             f"the config says {list(s)}"
             for n, s in want.items() if n in headers and shape_of(headers[n]) != tuple(s)]
    not_float = [f"{n} is {headers[n].get('dtype')}" for n in want
                 if n in headers and headers[n].get("dtype") not in FLOAT_DTYPES]
    return ([f"{len(missing)} tensor(s) missing, e.g. {missing[:3]}"] if missing else []) \
        + ([f"{len(extra)} tensor(s) the model does not have, e.g. {extra[:3]}"]
           if extra else []) + wrong[:3] + not_float[:3]


def check_weights_build(model_dir: str | Path) -> None:
    """ValueError unless the torch trainer and the embedded engine can build the model
    `model_dir`'s config.json describes (transformers' own class for it) and its
    checkpoint holds exactly that model's tensors, each of its shape and a floating
    dtype (a tied weight's copy may be there or not). Built on the meta device: no
    memory, no tensor read. Before, a config edited without its weights, an unknown
    activation or rope type, or a checkpoint of another model failed each training
    rank's first load with a traceback, after every process had started."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    headers = weight_headers(model_dir)
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        want = {k: tuple(v.shape) for k, v in checkpoint_state(model).items()}
    except Exception as exc:  # noqa: BLE001 - an outside file: any failure is the config's
        raise ValueError(f"{model_dir}/config.json does not describe a model transformers "
                         f"can build ({type(exc).__name__}: {str(exc)[:400]}); fix the "
                         f"key it names, or give the model's published config.json") from None
    tied = tied_weights(model)
    problems = _fit_problems(headers, want,
                             extra=[n for n in headers if n not in want and n not in tied])
    if not problems:
        _check_tied_copies(model_dir, {t: s for t, s in tied.items()
                                       if t in headers and s in headers})
    if problems:
        raise CorruptWeights(f"{model_dir}: the weights are not the model its config.json "
                             f"describes ({type(model).__name__}, hidden "
                             f"{getattr(config, 'hidden_size', '?')}, "
                             f"{getattr(config, 'num_hidden_layers', '?')} layers): "
                             + "; ".join(problems))


def _check_tied_copies(model_dir: str | Path, pairs: dict[str, str]) -> None:
    """CorruptWeights if a checkpoint whose config ties `target` to `source` also holds
    a `target` of other values: the trainer (one tensor) would train the source while
    vLLM serves the checkpoint's own target (it unties them then), and no update would
    ever reach it. (Tied models are the small ones: the two tensors are read.)"""
    if not pairs:
        return
    import torch

    from gyre_slurm.models.weights import HFWeights

    weights = HFWeights(model_dir)
    for target, source in pairs.items():
        if not torch.equal(weights[target], weights[source]):
            raise CorruptWeights(
                f"{model_dir}: config.json ties {target} to {source} (tie_word_embeddings) "
                f"but the checkpoint holds a {target} of its own, with other values: set "
                f"tie_word_embeddings to false to train it as its own layer, or remove "
                f"{target} from the checkpoint to tie them")


def _verify_file(path: Path) -> dict[str, dict]:
    """The tensors of a whole safetensors file, name -> header entry (see verify_weights)."""
    import struct

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > 100 << 20:
                raise CorruptWeights(f"{path}: {size} bytes, no safetensors header "
                                     f"(truncated or not a safetensors file)")
            if n > size - 8:
                raise CorruptWeights(f"{path}: {size} bytes, truncated at byte offset "
                                     f"{size}, inside its {n}-byte header")
            header = loads_json(f.read(n))
    except FileNotFoundError:
        raise CorruptWeights(f"{path} does not exist") from None
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, CorruptWeights):
            raise
        raise CorruptWeights(f"{path}: {size} bytes, garbled safetensors header at byte "
                             f"offset 8 ({exc})") from None
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items()
                   if k != "__metadata__"), default=0)
    except (TypeError, KeyError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptWeights(f"{path}: garbled safetensors header ({exc!r})") from None
    want = 8 + n + end
    if size != want:
        raise CorruptWeights(f"{path}: {size} bytes but its header describes {want} "
                             f"(truncated at byte offset {size})" if size < want else
                             f"{path}: {size} bytes but its header describes {want}")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def load_weights(model, weights_dir: str | Path) -> None:
    """Load a weights dir (`model.safetensors`, or shards with their index), strictly."""
    from safetensors.torch import load_file

    from gyre_slurm.models.weights import HFWeights

    path = verify_weights(weights_dir)
    state = dict(HFWeights(weights_dir)) if path.name != WEIGHTS_FILE else load_file(str(path))
    model.load_state_dict(model_state(model, state), strict=True)


def weights_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"v{version:06d}"


def save_weights_into(model, model_dir: str | Path, *, shards: int = 1) -> Path:
    """Write the model's weights into a model directory, making it a whole Hugging Face
    checkpoint: `model.safetensors`, or with `shards` > 1 the published layout,
    `model-0000i-of-0000N.safetensors` listed by `model.safetensors.index.json` (each
    file atomically: temp file, then rename; the index last). Returns the file written
    last."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    state = {k: v.detach().contiguous().cpu() for k, v in checkpoint_state(model).items()}
    names = list(state)
    groups = [names[i * len(names) // shards:(i + 1) * len(names) // shards]
              for i in range(shards)] if shards > 1 else [names]
    weight_map = {}
    for i, group in enumerate(groups):
        name = WEIGHTS_FILE if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        path = model_dir / name
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file({k: state[k] for k in group}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
        weight_map.update(dict.fromkeys(group, name))
    if shards == 1:
        return path
    total = sum(t.numel() * t.element_size() for t in state.values())
    path = model_dir / f"{WEIGHTS_FILE}.index.json"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                              indent=1))
    os.replace(tmp, path)
    return path

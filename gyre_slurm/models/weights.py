"""The weights of a Hugging Face model directory, read tensor by tensor.

A checkpoint holds `model.safetensors`, or shards `model-0000i-of-0000N.safetensors`
listed by `model.safetensors.index.json` (every published model past a few GB).
`HFWeights(dir)` is a read-only mapping name -> tensor over either, opening each file
lazily and reading a tensor only when asked for it: a training rank that needs its
slices of a 30B model reads those tensors, not the checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.common.yamltext import read_text

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """{tensor name: file} of a weights directory; ValueError naming what is missing."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = loads_json(read_text(index, what=str(index)))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc!r})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"{index}: weight_map must map each tensor name to the name of "
                             f"its shard file (strings)")
        outside = sorted({f for f in weight_map.values()
                          if f in ("", ".", "..") or "/" in f or "\\" in f})
        if outside:  # a shard is a file beside the index, as every published model has it
            raise ValueError(f"{index} lists shards outside its directory: {outside[:3]}; "
                             f"each shard must be a file name beside the index")
        files = {name: model_dir / f for name, f in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise ValueError(f"{index} lists shards that are not there: {missing[:3]}")
        return files
    single = model_dir / SINGLE
    if not single.is_file():
        raise ValueError(f"{model_dir}: no {SINGLE} and no {INDEX} (a Hugging Face weights "
                         "directory in safetensors is needed; .bin checkpoints are not read)")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except SafetensorError as exc:
        raise ValueError(f"{single}: not a whole safetensors file ({exc})") from None


def has_weights(model_dir: str | Path) -> bool:
    return (Path(model_dir) / INDEX).is_file() or (Path(model_dir) / SINGLE).is_file()


class HFWeights(Mapping):
    """name -> torch tensor of a weights directory, read on access (see module doc)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.files = weight_files(self.model_dir)
        self._open: dict[Path, object] = {}

    def __getitem__(self, name: str):
        from safetensors import safe_open

        try:
            path = self.files[name]
        except KeyError:
            raise KeyError(f"{self.model_dir}: the checkpoint has no tensor {name!r}") from None
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def is_weight_file(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name == INDEX \
        or name.endswith(".bin.index.json")


def _check_tokenizer(src: Path, *, what: str = "model.path", chat: bool = False) -> None:
    """ValueError unless `src`'s tokenizer loads (as vLLM and the gateway will load it): a
    garbled tokenizer.json would otherwise fail every engine start on every cell. `chat`:
    its chat template must also render a user's message (the agents call
    /chat/completions, which the gateway renders with it): a base model has none, and
    every call of every run was refused (400) until the job stopped for steps that
    trained nothing."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(src))
    except Exception as exc:  # noqa: BLE001 - a loader of outside files: any failure is the file's
        raise ValueError(f"{what} {src}: its tokenizer (with the config.json "
                         f"transformers reads for it) does not load "
                         f"({type(exc).__name__}: {str(exc)[:500]})") from None
    if not chat:
        return
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{what} {src}: its tokenizer has no chat template, and the "
                         f"agents' model calls are chat completions: give an instruct "
                         f"(chat) model, or add its template (chat_template.jinja, or "
                         f"chat_template in tokenizer_config.json); a scaffold of type "
                         f"command may call /v1/completions instead")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                      add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - the template is outside input (jinja code)
        raise ValueError(f"{what} {src}: its chat template does not render a user's "
                         f"message ({type(exc).__name__}: {str(exc)[:300]}): fix "
                         f"chat_template (chat_template.jinja or tokenizer_config.json)"
                         ) from None


def check_model_files(src: str | Path, *, what: str = "model.path",
                      load_tokenizer: bool = True) -> None:
    """ValueError unless `src` holds a config.json that is a JSON object and a tokenizer
    (that loads, unless `load_tokenizer` is false): what every engine, rank and the
    gateway read of a model directory."""
    import json

    src = Path(src)
    config = src / "config.json"
    if not config.is_file():
        raise ValueError(f"{what} {src}: no config.json (a Hugging Face model directory "
                         "holds config.json, the tokenizer and safetensors weights)")
    try:
        if not isinstance(json.loads(config.read_bytes()), dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{what} {config} does not read as a model config "
                         f"({str(exc)[:200]})") from None
    if not any((src / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{what} {src}: no tokenizer (tokenizer.json or "
                         "tokenizer_config.json)")
    if load_tokenizer:
        _check_tokenizer(src, what=what)


def _check_positions(src: Path, max_model_len: int) -> None:
    """ValueError if the servers would take sequences longer than the model's positions
    (config.json's max_position_embeddings): vLLM refuses to start (every cell's server,
    after the job has started)."""
    import json

    positions = json.loads((src / "config.json").read_bytes()).get("max_position_embeddings")
    if isinstance(positions, bool) or not isinstance(positions, int | float):
        return  # none said: vLLM derives its own limit, or none
    if max_model_len > positions:
        raise ValueError(f"rollout.max_model_len = {max_model_len} exceeds model.path {src}'s "
                         f"max_position_embeddings = {positions:g} (config.json): vLLM "
                         f"refuses to serve it; set rollout.max_model_len to at most "
                         f"{positions:g}")


def import_model_dir(src: str | Path, model_dir: str | Path, weights_dir: str | Path, *,
                     layout: tuple[int, int, int] | None = None, chat: bool = False,
                     max_model_len: int | None = None) -> dict:
    """Start a run from a Hugging Face model directory `src` without copying it: the run's
    `model_dir` gets links to its config, tokenizer and other small files, `weights_dir`
    (the policy's version 0) links to its safetensors weights (one file, or the shards
    and their index). Each directory is made aside and renamed into place. `src` must
    be on a filesystem every node sees. `layout`: (TP, PP, EP) the Megatron trainer will
    split the model over, checked first (its family and shape, `ModelShape`); `chat`:
    the agents make chat calls, so its chat template must render; `max_model_len`:
    the servers' (vLLM's --max-model-len), at most the model's positions. Returns
    {"files": n, "weights": n}; ValueError saying what `src` lacks."""
    import os

    from gyre_slurm.models.shape import ModelShape

    src = Path(src).expanduser().resolve()
    check_model_files(src, load_tokenizer=False)  # loaded last: the weights say more
    if max_model_len is not None:
        _check_positions(src, max_model_len)
    shape = None
    if layout is not None:
        shape = ModelShape.from_model_dir(src)
        shape.check_layout(*layout)
    weights = weight_files(src)  # ValueError if there are none
    from gyre_slurm.models.tiny import check_weights_build, check_weights_fit

    # whole files and the index's tensors in its shards (headers only), each tensor as
    # the config says: for the Megatron trainer, which converts them, in its terms; for
    # the torch trainer, the model transformers builds from the config
    if shape is None:
        check_weights_build(src)
    else:
        check_weights_fit(shape, src)
    _check_tokenizer(src, chat=chat)
    shards = sorted({p.name for p in weights.values()})
    if (src / INDEX).is_file():
        shards.append(INDEX)
    small = [f for f in sorted(src.iterdir()) if f.is_file() and not is_weight_file(f.name)]
    for target, names in ((Path(model_dir), [f.name for f in small]),
                          (Path(weights_dir), shards)):
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        if tmp.exists():
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        tmp.mkdir(parents=True)
        for name in names:
            (tmp / name).symlink_to(src / name)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():  # an earlier start of this run stopped before its config.yaml
            shutil.rmtree(target)  # links only: their targets are not followed
        os.replace(tmp, target)
    return {"files": len(small), "weights": len(shards)}

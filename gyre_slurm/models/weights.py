"""The weights of a Hugging Face model directory, read tensor by tensor.

A checkpoint holds `model.safetensors`, or shards `model-0000i-of-0000N.safetensors`
listed by `model.safetensors.index.json` (every published model past a few GB).
`HFWeights(dir)` is a read-only mapping name -> tensor over either, opening each file
lazily and reading a tensor only when asked for it: a training rank that needs its
slices of a 30B model reads those tensors, not the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """{tensor name: file} of a weights directory; ValueError naming what is missing."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc!r})") from None
        files = {name: model_dir / f for name, f in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise ValueError(f"{index} lists shards that are not there: {missing[:3]}")
        return files
    single = model_dir / SINGLE
    if not single.is_file():
        raise ValueError(f"{model_dir}: no {SINGLE} and no {INDEX} (a Hugging Face weights "
                         "directory in safetensors is needed; .bin checkpoints are not read)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


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

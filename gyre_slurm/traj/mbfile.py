"""A micro-batch as the training ranks read it: one safetensors file.

The coordinator hands each micro-batch to the ranks of the training world as a file on
the shared filesystem (`RUN_DIR/stream/stepNNNNNN_mbNNNNN.safetensors`, written once,
atomically, read by every rank). Four tensors hold every trajectory's tokens end to end,
and `offsets` where each begins:

    token_ids  int32   [N]      the trajectory's tokens (prompt and generated)
    loss_mask  uint8   [N]      1 where the token is trained
    logprobs   float32 [N]      the sampling logprob of each trained token
    versions   int32   [N]      the policy version of each trained token, -1 elsewhere
    offsets    int64   [T + 1]  trajectory j is [offsets[j], offsets[j + 1])

and the header's metadata, `format` (`gyre-microbatch/1`) and `trajectories`: a JSON list
of each trajectory's other fields (`run_id`, `policy_version`, `advantage`, ...).

It was a JSON list of trajectory lines: 32 bytes a token, and 1.7 s of the
coordinator's event loop to write a 1.4M-token micro-batch (the presets' are 4-8M
tokens; `tools/bench_microbatch_io.py`); this is 13 bytes a token of fixed-size values,
written with no per-token Python (safetensors, the format the model's weights already
use, so every training environment reads it). A reader gets the trajectories back as
dicts whose arrays are numpy arrays (views of the file's tensors): everything that
takes a trajectory line takes them (`gyre_slurm.traj.treepack`, the row packer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "gyre-microbatch/1"
SUFFIX = ".safetensors"
ARRAYS = {"token_ids": np.int32, "loss_mask": np.uint8, "logprobs": np.float32,
          "versions": np.int32}


class BadMicrobatch(ValueError):
    """A micro-batch file that cannot be what the coordinator wrote."""


def encode(trajectories: Sequence[dict[str, Any]]) -> bytes:
    """The file's bytes for these trajectories (dicts: the trajectory line, its arrays as
    lists or numpy arrays)."""
    from safetensors.numpy import save

    if not trajectories:
        raise ValueError("a micro-batch holds at least one trajectory")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ARRAYS}
    meta, offsets = [], [0]
    for t in trajectories:
        n = len(t["token_ids"])
        for key, dtype in ARRAYS.items():
            if key not in t:
                raise ValueError(f"trajectory of run {t.get('run_id')!r} has no {key}")
            arr = np.asarray(t[key], dtype=dtype)
            if arr.shape != (n,):
                raise ValueError(f"trajectory of run {t.get('run_id')!r}: {key} holds "
                                 f"{arr.size} values for {n} tokens")
            parts[key].append(arr)
        offsets.append(offsets[-1] + n)
        meta.append({k: v for k, v in t.items() if k not in ARRAYS})
    tensors = {k: np.ascontiguousarray(np.concatenate(v)) for k, v in parts.items()}
    tensors["offsets"] = np.asarray(offsets, dtype=np.int64)
    return save(tensors, metadata={"format": FORMAT,
                                   "trajectories": json.dumps(meta, default=_plain)})


def _plain(value: Any) -> Any:
    """A numpy scalar among a trajectory's other fields, as the Python number it is."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON: {value!r}")


def write(path: Path, trajectories: Sequence[dict[str, Any]]) -> int:
    """Write the micro-batch file atomically (temp name, fsync, rename); its size."""
    from gyre_slurm.common.fsio import write_bytes_atomic

    data = encode(trajectories)
    write_bytes_atomic(path, data)
    return len(data)


def read(path: Path) -> list[dict[str, Any]]:
    """The trajectories of a micro-batch file; BadMicrobatch (naming the file and what is
    wrong) for anything the writer could not have made."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != FORMAT:
                raise BadMicrobatch(f"{path}: not a micro-batch file (format "
                                    f"{meta.get('format')!r}, expected {FORMAT!r})")
            if names != set(ARRAYS) | {"offsets"}:
                raise BadMicrobatch(f"{path}: tensors {sorted(names)}, expected "
                                    f"{sorted(set(ARRAYS) | {'offsets'})}")
            arrays = {k: f.get_tensor(k) for k in names}
    except BadMicrobatch:
        raise
    except Exception as exc:  # safetensors' own errors: a torn or foreign file
        raise BadMicrobatch(f"{path}: unreadable micro-batch file ({exc})") from exc
    try:
        fields = json.loads(meta.get("trajectories", ""))
    except ValueError as exc:
        raise BadMicrobatch(f"{path}: its trajectories' fields are not JSON ({exc})") from exc
    offsets = arrays["offsets"]
    n = len(arrays["token_ids"])
    for key, dtype in ARRAYS.items():
        if arrays[key].dtype != dtype or arrays[key].shape != (n,):
            raise BadMicrobatch(f"{path}: {key} is {arrays[key].dtype}{list(arrays[key].shape)}"
                                f", expected {np.dtype(dtype)}[{n}]")
    if (not isinstance(fields, list) or not all(isinstance(m, dict) for m in fields)
            or offsets.dtype != np.int64 or offsets.shape != (len(fields) + 1,)
            or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) < 0)):
        raise BadMicrobatch(f"{path}: offsets {offsets.shape} do not split {n} tokens "
                            f"into its {len(fields) if isinstance(fields, list) else '?'} "
                            "trajectories")
    bounds = offsets.tolist()
    return [{**m, **{k: arrays[k][a:b] for k in ARRAYS}}
            for m, a, b in zip(fields, bounds[:-1], bounds[1:])]

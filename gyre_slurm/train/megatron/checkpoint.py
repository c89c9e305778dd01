"""`CheckpointIO`: the `MegatronWorker` methods that write, read and fingerprint a rank's
trainer state: `save_checkpoint` / `load_checkpoint` (a `dist_checkpointing` directory
of `state.sharded_state`, resharded on load), `digests` (sha256 of parameters, optimizer
state and gradients, for tests that compare layouts) and `memory_bytes` (the memory
calculator's figures, counted from the tensors). A mixin: it uses the worker's `core`,
`ddp`, `optimizer`, `layout`, `rank`, `tp`, `world_size` and `version`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gyre_slurm.train.megatron import state


class CheckpointIO:
    def save_checkpoint(self, path: Path) -> Path:
        """COLLECTIVE: every rank of the world calls it. Writes a dist_checkpointing
        directory at `path` (temp dir, barrier, rank 0 renames it into place) holding
        model, optimizer state (`state.sharded_state`), version and the gradients
        accumulated so far, consolidated (`state.consolidate_grads`), so that training
        may go on in this world, or in another layout, after a mid-step save."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        state.consolidate_grads(self.ddp, self.core)
        if (self.rank or 0) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        meta = {"version": self.version, "format": "gyre-megatron-2",
                "precision": self.layout.precision,
                "optimizer_parts": len(state.torch_optimizers(self.optimizer))}
        dist_checkpointing.save(state.sharded_state(self.core, self.optimizer, meta=meta,
                                                    loading=False), str(tmp))
        self._barrier()
        if (self.rank or 0) == 0:
            old = path.with_name(f".{path.name}.old")
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        return path

    def load_checkpoint(self, path: Path) -> None:
        """COLLECTIVE: load a `save_checkpoint` directory into this world's model,
        optimizer and gradient buffers, resharded to its layout."""
        from megatron.core import dist_checkpointing

        if self.core is None:
            raise RuntimeError("load_checkpoint needs a world: call join first")
        path = Path(path)
        if not (path / "metadata.json").exists():
            raise FileNotFoundError(f"{path}: not a Megatron checkpoint (no metadata.json)")
        self._check_optimizer_parts(path)
        meta = {"version": 0, "format": "", "precision": "", "optimizer_parts": 0}
        sharded = state.sharded_state(self.core, self.optimizer, meta=meta, loading=True)
        loaded = dist_checkpointing.load(sharded, str(path))
        meta = state.apply_loaded(self.core, self.optimizer, loaded, source=str(path),
                                  lr=self.lr)
        self.version = int(meta["version"])

    def _check_optimizer_parts(self, path: Path) -> None:
        """Megatron keeps a MoE model's expert parameters in an optimizer of their own
        (a chained optimizer, keys `chained_N.`) only when they are expert- or tensor-
        parallel (EP > 1 or TP > 1): a checkpoint of one kind does not load into the
        other. Say so, rather than fail deep in dist_checkpointing."""
        from megatron.core.dist_checkpointing import load_common_state_dict

        saved = (load_common_state_dict(str(path)).get("meta") or {}).get("optimizer_parts")
        mine = len(state.torch_optimizers(self.optimizer))
        if saved is not None and saved != mine:
            raise ValueError(
                f"{path}: a checkpoint of a layout whose optimizer has {saved} part(s) cannot "
                f"load into this one's {mine} (TP {self.tp}, EP {self.layout.ep}): a MoE "
                "model's experts get an optimizer of their own only when TP > 1 or EP > 1; "
                "keep TP > 1 or EP > 1 on both sides of a layout change, or both at 1")

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # ---- digests ---------------------------------------------------------------------------

    def digests(self) -> dict[str, Any]:
        """sha256 of this rank's parameters + optimizer state (master weights, moments,
        step) + version ("state") and of its local gradients ("grads"); ranks of one
        layout position compare equal."""
        h = hashlib.sha256(str(self.version).encode())
        for p in self.core.parameters():
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        for opt in state.torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
                    for key in ("exp_avg", "exp_avg_sq", "step"):
                        h.update(opt.state[p][key].detach().float().cpu().numpy().tobytes())
        g = hashlib.sha256()
        for buf in [*self.ddp.buffers, *self.ddp.expert_parallel_buffers]:
            g.update(buf.grad_data.float().cpu().numpy().tobytes())
        return {"state": h.hexdigest(), "grads": g.hexdigest(), "version": self.version}

    def memory_bytes(self) -> dict[str, int]:
        """This rank's model state in bytes, counted from its tensors (the memory
        calculator's figures, `models/memory.py`): "weights" its parameters, "grads"
        DDP's gradient buffers, "optimizer" the Adam moments plus the fp32 master weights
        of bf16 parameters (a view of an fp32 parameter is no new memory), "params" the
        parameter count; "max_rss" the process's peak resident set."""
        import resource

        def nbytes(t):
            return t.numel() * t.element_size()

        params = list(self.core.parameters())
        optimizer = 0
        for opt in state.torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    optimizer += nbytes(p) if self.layout.bf16 else 0
                    optimizer += sum(nbytes(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")
                                     if k in opt.state[p])
        grads = sum(nbytes(b.grad_data)
                    for b in [*self.ddp.buffers, *self.ddp.expert_parallel_buffers])
        return {"weights": sum(nbytes(p) for p in params), "grads": grads,
                "optimizer": optimizer, "params": sum(p.numel() for p in params),
                "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

"""`TrainerWorker`: one per node, long-lived, a data-parallel training rank that survives
handoffs (the node agent holds it; model and optimizer stay in memory across rebuilds
for members that stay).

Protocol of a rebuild (the coordinator drives it; micro-batch boundaries are the only
places a world changes):

1. every member of the OLD world calls `flush(keep_rank=K)`: all-reduce(sum) of the
   locally accumulated gradients, kept on old rank K only (zero elsewhere); K must be a
   member that stays (`layout.plan_handoff(...).keep_old_rank`);
2. members that go away call `leave()` (group destroyed, model and optimizer freed);
3. every member of the NEW world calls `join(spec, rank, src_rank=S, ...)`: the old group
   is destroyed, the new generation's group is created, a member without a model builds
   one, then rank S (a member of the old world) broadcasts model parameters, AdamW state
   (exp_avg, exp_avg_sq, step) and the policy version to all. Gradients are NOT
   broadcast: members keep theirs and newcomers start at zero, so the sum of local
   gradients over the world stays the step's accumulated gradient.

Invariant: within a world all members hold bit-identical parameters and optimizer
state; the sum over members of their local gradients is the gradient accumulated since
the last optimizer step. `train_microbatch` adds this rank's shard (whole runs, tree
packed; or with rows packing, trajectories i with i % world_size == rank) without
communicating; `optimizer_step` all-reduces (sum),
clips, steps AdamW and zeroes. The loss is normalised by the step's global token count
(see `loss`), so sums are exact, never averages.

Gradients live in one flat buffer (each parameter's `.grad` is a view into it) so that a
flush or a step is a single all-reduce. Checkpoints (`save_checkpoint`, rank 0 only,
temp file then rename) hold model, optimizer, version and RNG; they are taken between
optimizer steps, when gradients are zero.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gyre_slurm.train import dist as gdist
from gyre_slurm.train.dist import WorldSpec
from gyre_slurm.train.loss import LossSettings, rows_from_trajectories
from gyre_slurm.train.metrics import SKIPPED
from gyre_slurm.train.signals import loss_and_signals
from gyre_slurm.train.tree import register_hf_attention, to_inputs, tree_loss_and_signals
from gyre_slurm.train.wsync.endpoint import StreamSender
from gyre_slurm.traj import treepack

logger = logging.getLogger(__name__)


def flat_grads_and_adamw(params: list, *, lr: float):
    """One flat gradient buffer for `params` (each `.grad` a view into it, so a flush or
    a step is one all-reduce) and AdamW with its state made eagerly (every member of a
    world, and every checkpoint, has the same layout). Returns (grads, optimizer)."""
    if len({p.dtype for p in params}) != 1:
        raise TypeError("all trained parameters must share one dtype")
    grads = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                        device=params[0].device)
    offset = 0
    for p in params:
        p.grad = grads[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    optimizer = torch.optim.AdamW(params, lr=lr)
    for p in params:
        optimizer.state[p].update(step=torch.tensor(0.0, dtype=torch.float32),
                                  exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    return grads, optimizer


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The configured learning rate on every group: torch's `load_state_dict` restores the
    saved one, so a run resumed with `--set optimizer.lr=...` kept the old rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class TrainerWorker(StreamSender):
    def __init__(self, *, model_dir: Path, node_index: int, lr: float = 1e-3, seed: int = 0,
                 grad_clip: float = 1.0, loss: LossSettings | dict | None = None):
        self.model_dir = Path(model_dir)
        self.loss = loss if isinstance(loss, LossSettings) else LossSettings(**(loss or {}))
        self.node_index = node_index
        self.lr, self.seed, self.grad_clip = lr, seed, grad_clip
        self.version = 0
        self.spec: WorldSpec | None = None
        self.rank: int | None = None
        self.model = None
        self.optimizer: torch.optim.AdamW | None = None
        self._params: list[torch.nn.Parameter] = []
        self._grads: torch.Tensor | None = None
        self.device = torch.device("cpu")

    # ---- building and freeing -------------------------------------------------------

    def warm(self) -> float:
        """Pay a first build's one-time costs now, holding no memory: the model is built
        on the meta device and dropped. A rank starts with the job and its first join
        comes when its cell first moves to training; without this, that join built the
        model from cold (transformers imports the model's classes on first use), about
        1.6 s alone and 4.7 s with four nodes joining at once on 2 cores, and every member
        of the world waited for it. Later builds take about 0.01 s. Returns seconds."""
        t0 = time.perf_counter()
        with torch.device("meta"):
            self._new_model()
        return time.perf_counter() - t0

    def _new_model(self):
        """The model `_build` starts from (and `warm` builds once on the meta device)."""
        from gyre_slurm.models.tiny import new_model

        return new_model(self.model_dir, seed=self.seed,
                         attn_implementation=register_hf_attention())

    def _build(self, init_weights: Path | None, *, backend: str | None = None) -> None:
        from gyre_slurm.models.tiny import load_weights

        on_gpu = torch.cuda.is_available() and backend in (None, "nccl")
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu \
            else torch.device("cpu")
        model = self._new_model()
        if init_weights is not None:
            load_weights(model, init_weights)
        self.model = model.to(self.device).train()
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._grads, self.optimizer = flat_grads_and_adamw(self._params, lr=self.lr)

    def _free(self) -> None:
        for p in self._params:
            p.grad = None
        self.model = self.optimizer = self._grads = None
        self._params = []
        self.version = 0
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _load_optimizer(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if "optimizer" in state:
            self.version = int(state.get("version", self.version))
            state = state["optimizer"]
        self.optimizer.load_state_dict(state)
        set_lr(self.optimizer, self.lr)

    # ---- world membership -----------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.spec.world_size if self.spec is not None else 1

    def join(self, spec: WorldSpec, rank: int, *, src_rank: int,
             init_weights: Path | None = None, optimizer_state: Path | None = None,
             checkpoint: Path | None = None, timeout_s: float = 120.0) -> dict[str, float]:
        """Join world `spec` as `rank`; rank `src_rank` broadcasts its state to all.

        `init_weights` (a safetensors weights dir) and `optimizer_state` (a file written
        by `save_checkpoint`, or a torch-saved optimizer state dict) are used only by a
        member that has no model yet. `checkpoint` (a `save_checkpoint` file: model,
        optimizer, version, RNG and the accumulated gradients) is loaded only by the
        member that will broadcast (`rank == src_rank`) when it has no model: the way
        state crosses into a world nobody of the last one stays in. Returns {"destroy_s",
        "init_s", "broadcast_s", "build_s"} (build_s is 0.0 for a member that kept its
        model)."""
        if not 0 <= src_rank < spec.world_size:
            raise ValueError(f"src_rank {src_rank} outside a world of {spec.world_size}")
        self.spec, self.rank = None, None  # the old world ends here, whatever happens next
        self.wsync_leave()  # a transfer group is of one world's layout
        build_s = 0.0
        if self.model is None:
            t0 = time.perf_counter()
            if checkpoint is not None and rank == src_rank:
                self._build(None, backend=spec.backend)
                self.load_checkpoint(Path(checkpoint))
            else:
                self._build(None if init_weights is None else Path(init_weights),
                            backend=spec.backend)
                if optimizer_state is not None:
                    self._load_optimizer(Path(optimizer_state))
            build_s = time.perf_counter() - t0
        times = gdist.join_world(spec, rank, timeout_s=timeout_s)
        self.spec, self.rank = spec, rank
        t0 = time.perf_counter()
        if spec.world_size > 1:
            self._broadcast_state(src_rank)
        times.update(broadcast_s=time.perf_counter() - t0, build_s=build_s)
        return times

    def _optimizer_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        states = [self.optimizer.state[p] for p in self._params]
        return ([s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states])

    def _broadcast_state(self, src_rank: int) -> None:
        moments, steps = self._optimizer_tensors()
        meta = torch.tensor([float(self.version)] + [float(s) for s in steps],
                            dtype=torch.float64, device=self.device)
        dist.broadcast(meta, src_rank)
        tensors = [p.data for p in self._params] + moments
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src_rank)
        if self.rank == src_rank:
            return
        self.version = int(meta[0].item())
        for s, value in zip(steps, meta[1:].tolist()):
            s.fill_(value)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def flush(self, *, keep_rank: int = 0) -> None:
        """Sum the accumulated gradients over the world onto `keep_rank`; zero elsewhere."""
        if self.world_size > 1:
            dist.all_reduce(self._grads)
            if self.rank != keep_rank:
                self._grads.zero_()

    def leave(self) -> dict[str, float]:
        """Destroy the group and free the model and optimizer (a rejoin gets them back by
        broadcast). Unflushed gradients are lost: call `flush` first."""
        if self._grads is not None and bool(self._grads.any()):
            logger.warning("node %d leaves with unflushed gradients", self.node_index)
        self.wsync_leave()
        destroy_s = gdist.leave_world()
        self._free()
        self.spec, self.rank = None, None
        return {"destroy_s": destroy_s}

    # ---- training ---------------------------------------------------------------------

    def train_microbatch(self, mb: list, *, num_step_tokens: int,
                         packing: str = "tree") -> dict[str, Any]:
        """Forward/backward this rank's shard of the micro-batch; gradients accumulate.

        `packing` "tree": whole runs per rank, each run's prefix tree fed once with the
        tree attention mask (`gyre_slurm.train.tree`); "rows": every world_size-th
        trajectory, right-padded rows. Returns the shard's sums
        (`gyre_slurm.train.signals`), its trajectory count and the positions it computed
        (`fed_tokens`, of which `pad_tokens` padding)."""
        trajs = [t.to_json() if hasattr(t, "to_json") else t for t in mb]
        shard = treepack.shard(trajs, rank=self.rank or 0, world_size=self.world_size,
                               packing=packing)
        if not shard:
            return {"trajectories": 0, "tokens": 0, "fed_tokens": 0, "pad_tokens": 0}
        if packing == "tree":
            loss, stats = self._tree_loss(shard, num_step_tokens)
        else:
            loss, stats = self._rows_loss(shard, num_step_tokens)
        loss.backward()
        if self._params[0].grad.data_ptr() != self._grads.data_ptr():
            raise RuntimeError("autograd replaced the flat gradient buffer")
        return {"trajectories": len(shard), **stats}

    def _rows_loss(self, shard: list[dict], num_step_tokens: int):
        rows = rows_from_trajectories(shard, pad_id=self.model.config.pad_token_id or 0,
                                      device=self.device)
        logits = self.model(input_ids=rows["token_ids"], use_cache=False).logits
        loss, stats = loss_and_signals(logits, rows, settings=self.loss,
                                       num_step_tokens=num_step_tokens,
                                       trainer_version=self.version)
        fed = rows["token_ids"].numel()
        return loss, dict(stats, fed_tokens=fed,
                          pad_tokens=fed - sum(len(t["token_ids"]) for t in shard))

    def _tree_loss(self, shard: list[dict], num_step_tokens: int):
        tree = to_inputs(treepack.pack_trees(shard), self.device)
        logits = self.model(**tree.hf_inputs()).logits
        loss, stats = tree_loss_and_signals(logits, tree, settings=self.loss,
                                            num_step_tokens=num_step_tokens,
                                            trainer_version=self.version)
        return loss, dict(stats, fed_tokens=tree.num_tokens, pad_tokens=0)

    def optimizer_step(self, *, publish_dir: Path | None = None,
                       num_step_tokens: int | None = None) -> dict[str, Any]:
        """All-reduce(sum) gradients, clip, AdamW step, zero; rank 0 publishes weights.
        A non-finite gradient norm skips the update (`skipped`); the version advances
        all the same and the unchanged weights are published as it, so that the servers
        load the version the runtime counts (they had no weights to load, and restarted).

        Streaming trains micro-batches before the step's token count is known: they can
        accumulate unnormalised sums (`train_microbatch(num_step_tokens=1)`) and the
        step divides by `num_step_tokens` here (gradients are linear in the loss).

        `num_step_tokens=0`: the step trained nothing (no run of it ended ok, or none
        generated a token). Its update is skipped too (`empty`, no gradient norm):
        AdamW on zero gradients would still move every weight, by its momentum from the
        steps before and by weight decay, a policy no trajectory asked for."""
        t0 = time.perf_counter()
        empty = num_step_tokens == 0  # the same on every rank: no collective is skipped alone
        if self.world_size > 1 and not empty:
            dist.all_reduce(self._grads)
        if num_step_tokens:
            self._grads.div_(float(num_step_tokens))
        t1 = time.perf_counter()
        norm = None if empty else float(torch.nn.utils.clip_grad_norm_(self._params,
                                                                        self.grad_clip))
        skipped = empty or not math.isfinite(norm)
        if not empty and skipped:
            logger.warning(SKIPPED, norm)
        if not skipped:
            self.optimizer.step()
        self.version += 1  # a skipped step is a step too: its policy is the one before
        self._grads.zero_()
        t2 = time.perf_counter()
        if publish_dir is not None and (self.rank or 0) == 0:
            from gyre_slurm.models.tiny import save_weights

            save_weights(self.model, publish_dir)
        return {"version": self.version, "grad_norm": norm, "skipped": skipped,
                "empty": empty, "lr": self.optimizer.param_groups[0]["lr"],
                "allreduce_s": t1 - t0, "step_s": t2 - t1,
                "publish_s": time.perf_counter() - t2}

    # ---- streamed weight sync (gyre_slurm.train.wsync) -------------------------------------------

    def wsync_layout(self):
        from gyre_slurm.train.wsync.plan import TrainerLayout

        return TrainerLayout("replicated", self.world_size)

    def hf_pieces(self) -> dict[str, tuple[torch.Tensor, None]]:
        """The whole model in Hugging Face checkpoint names (every rank holds all of it;
        `tiny.checkpoint_state`: Qwen3-MoE's fused experts one by one, as views)."""
        from gyre_slurm.models.tiny import checkpoint_state

        return {k: (v.detach(), None) for k, v in checkpoint_state(self.model).items()}

    # ---- state, digests, checkpoints -------------------------------------------------------

    def digests(self) -> dict[str, Any]:
        """sha256 of parameters + optimizer state + version ("state") and of the local
        gradients ("grads"): equal "state" digests mean bit-identical members."""
        h = hashlib.sha256(str(self.version).encode())
        moments, steps = self._optimizer_tensors()
        for t in [p.data for p in self._params] + moments + steps:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        g = hashlib.sha256(self._grads.cpu().numpy().tobytes())
        return {"state": h.hexdigest(), "grads": g.hexdigest(), "version": self.version}

    def flat_params(self):
        """All parameters as one float64 numpy vector (tests, small models)."""
        return torch.cat([p.detach().reshape(-1).double().cpu() for p in self._params]).numpy()

    def state_dict(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "version": self.version, "rng": rng, "grads": self._grads.detach().cpu()}

    def save_checkpoint(self, path: Path, *, writer: int = 0) -> Path | None:
        """Rank `writer` (or a worker outside any world) writes `path` atomically; others
        no-op (every member holds the same state)."""
        if (self.rank or 0) != writer:
            return None
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(self.state_dict(), tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, optimizer, version and RNG (builds the model if needed)."""
        if self.model is None:
            self._build(None)
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        set_lr(self.optimizer, self.lr)
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())
        if "grads" in state:  # gradients accumulated before a handover
            self._grads.copy_(state["grads"].to(self._grads.device))
        else:
            self._grads.zero_()

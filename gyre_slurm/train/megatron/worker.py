"""`MegatronWorker`: the Megatron-core training backend, with `TrainerWorker`'s API.

One per rank process, long-lived; every rebuild of the world builds a new `GPTModel`
for the new layout (TP x PP x EP, data-parallel over the rest; `build.Layout`) with
Megatron's DDP wrapper and optimizer (fp32, or bf16 with fp32 master weights and
moments; optionally the distributed optimizer, which shards those over the
data-parallel ranks). The state crosses the rebuild through a `dist_checkpointing`
checkpoint, which reshards it (`state`):

1. every member of the OLD world calls `save_checkpoint(path)` (collective): model,
   optimizer state, policy version and the gradients accumulated since the last step
   (consolidated: each sum on one rank of its group, so a world may end mid-step);
2. members that go away call `leave()`; `flush()` is a no-op (the sums happen in the
   save);
3. every member of the NEW world calls `join(spec, rank, checkpoint=path)`: old Megatron
   state and group destroyed, generation `spec.generation` joined through
   `gyre_slurm.train.dist.join_world`, model parallelism initialised, a model built for
   the new layout and the checkpoint loaded into it, resharded over TP, PP, EP and DP.

Rank layout (Megatron's "tp-cp-ep-dp-pp" order): rank = tp + TP * (dp + DP * pp); the
experts: rank = ep + EP * (edp + EDP * pp) within a stage (expert TP is 1).
`train_microbatch` takes this replica's shard (tree packing: whole runs,
`treepack.assign_runs`; rows: trajectories `mb[dp_rank::dp_size]`); every TP/PP rank of
a data-parallel replica runs the same shard through `get_forward_backward_func()` (1F1B
over the stages when PP > 1). Tree-packed sequences go through `GPTModel` with the tree
mask as the attention mask (`train/megatron/tree.py`: core attention, RoPE positions).
Logits are gathered over TP (`parallel_output=False`) and the loss (`loss.kind`) and its
signals are `gyre_slurm.train.signals.loss_and_signals` (tree: `train.tree`) on the
full, unpadded vocabulary, as in the torch backend. Gradients accumulate in the DDP
buffers (fp32); `optimizer_step` finishes them with Megatron's `finalize_model_grads`
(sum over DP), divides by `num_step_tokens` if given, clips by the global norm and steps
AdamW (weight decay 0.01 on every parameter, as torch's AdamW in the torch backend).

Statistics (`tokens`, `loss_sum`, the mismatch sums of `gyre_slurm.train.signals`, ...)
are reported by one rank per data-parallel replica (TP rank 0 of the last stage, which
holds the gathered logits; the others report zeros), so merging them over the world's
members (`gyre_slurm.train.metrics.merge`) gives the totals, as with the torch backend.
The entropy is taken from those gathered, full-vocabulary logits.

Without a GPU, `cpu_shim.activate()` (called at construction) makes Megatron's CUDA
calls run on CPU; on a GPU it does nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gyre_slurm.models import tiny
from gyre_slurm.models.shape import ModelShape
from gyre_slurm.models.weights import HFWeights
from gyre_slurm.train import dist as gdist
from gyre_slurm.train.dist import WorldSpec
from gyre_slurm.train.loss import LossSettings, token_logprobs
from gyre_slurm.train.metrics import SKIPPED, merge_all
from gyre_slurm.train.signals import loss_and_signals
from gyre_slurm.train.megatron import build, convert, state
from gyre_slurm.train.megatron.build import Layout
from gyre_slurm.train.megatron.checkpoint import CheckpointIO
from gyre_slurm.train.megatron.tree import pad_tree, schedule_batches
from gyre_slurm.train.tree import tree_loss_and_signals
from gyre_slurm.train.wsync.endpoint import StreamSender
from gyre_slurm.traj import treepack

logger = logging.getLogger(__name__)



def _sharded_sync_writes() -> None:
    """Make `dist_checkpointing.save` write without a helper process.

    Megatron's synchronous save still collects write results through a
    `multiprocessing.Manager().Queue()`, created on first use, which starts a server
    process (seconds: a spawned interpreter). The writes run in this process, so a
    plain in-process queue carries the results just as well."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


class MegatronWorker(CheckpointIO, StreamSender):
    def __init__(self, *, model_dir: Path, node_index: int, lr: float = 1e-3, seed: int = 0,
                 grad_clip: float = 1.0, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 expert_parallel: int = 1, precision: str = "fp32",
                 distributed_optimizer: bool = False, loss: LossSettings | dict | None = None):
        from gyre_slurm.train.megatron import cpu_shim

        self.model_dir = Path(model_dir)
        self.shape = ModelShape.from_model_dir(self.model_dir)
        self.layout = Layout(tp=tensor_parallel, pp=pipeline_parallel, ep=expert_parallel,
                             precision=precision,
                             distributed_optimizer=bool(distributed_optimizer))
        self.shape.check_layout(self.layout.tp, self.layout.pp, self.layout.ep)
        self.node_index = node_index
        self.lr, self.seed, self.grad_clip = lr, seed, grad_clip
        self.loss = loss if isinstance(loss, LossSettings) else LossSettings(**(loss or {}))
        self.version = 0
        self.spec: WorldSpec | None = None
        self.rank: int | None = None
        self.core = None  # the GPTModel of this rank's stage
        self.ddp = None  # the DistributedDataParallel around it (what runs)
        self.optimizer = None  # Megatron's optimizer over the DDP buffers
        cpu_shim.activate()
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        _sharded_sync_writes()

    @property
    def model(self):
        """The GPTModel of this rank's stage (None outside a world)."""
        return self.core

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    # ---- layout -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.spec.world_size if self.spec is not None else 1

    def layout_info(self) -> dict[str, Any]:
        """This rank's coordinates (tp/pp/dp/ep rank and size) and the precision."""
        from megatron.core import parallel_state as ps

        return {"tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": self.tp,
                "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp_size": self.pp,
                "dp_rank": ps.get_data_parallel_rank(),
                "dp_size": ps.get_data_parallel_world_size(),
                "ep_rank": ps.get_expert_model_parallel_rank(), "ep_size": self.layout.ep,
                "precision": self.layout.precision,
                "distributed_optimizer": self.layout.distributed_optimizer}

    def _is_reporter(self) -> bool:
        """TP rank 0 of the last stage: reports this data-parallel replica's stats."""
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    # ---- building and freeing -------------------------------------------------------

    def _build(self, init_weights: Path | None) -> None:
        """This layout's model (Megatron's initialisation, or `init_weights`), its DDP
        wrapper and optimizer (AdamW state made now: see state.init_adam_state)."""
        from gyre_slurm.train.megatron.tree import TreePositions

        self.core = build.build_core(self.shape, self.layout, device=self.device)
        self._positions = TreePositions(self.core)
        if init_weights is not None:
            self._load_hf(Path(init_weights))
        self.ddp, self.optimizer = build.wrap(self.core, self.layout, lr=self.lr,
                                              grad_clip=self.grad_clip)
        state.init_adam_state(self.optimizer)
        self.ddp.train()

    def _free(self) -> None:
        self.core = self.ddp = self.optimizer = None
        self.version = 0

    def _load_hf(self, weights_dir: Path) -> None:
        from megatron.core import parallel_state as ps

        shard = convert.hf_to_megatron_shard(
            HFWeights(weights_dir), self.shape, tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=self.tp, pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=self.pp,
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=self.layout.ep)
        own = {k for k in self.core.state_dict() if not k.endswith("_extra_state")}
        if set(shard) != own:
            raise ValueError(f"{weights_dir}: converted names differ from the model's: "
                             f"missing {sorted(own - set(shard))}, extra "
                             f"{sorted(set(shard) - own)}")
        with torch.no_grad():
            params = dict(self.core.named_parameters())
            for name, value in shard.items():
                if params[name].shape != value.shape:
                    raise ValueError(f"{weights_dir}: {name} has shape {tuple(value.shape)}, "
                                     f"the model wants {tuple(params[name].shape)}")
                params[name].copy_(value)

    # ---- world membership -----------------------------------------------------------

    def join(self, spec: WorldSpec, rank: int, *, src_rank: int = 0,
             init_weights: Path | None = None, checkpoint: Path | None = None,
             timeout_s: float = 120.0, tensor_parallel: int | None = None,
             pipeline_parallel: int | None = None, expert_parallel: int | None = None,
             precision: str | None = None,
             distributed_optimizer: bool | None = None) -> dict[str, float]:
        """Join world `spec` as `rank` and build this layout's model.

        State comes from `checkpoint` (a `save_checkpoint` directory, resharded to this
        layout) or else `init_weights` (a Hugging Face weights dir: model.safetensors or
        sharded with an index); with neither, Megatron's own initialisation (seeded;
        depends on the layout). `src_rank` is accepted for API compatibility and
        ignored: state always travels through the checkpoint. `tensor_parallel`,
        `pipeline_parallel`, `expert_parallel`, `precision`, `distributed_optimizer`,
        when given, change the layout from this world on (all members must agree; a
        checkpoint loads into any of them). Returns {"destroy_s", "init_s",
        "mp_init_s", "build_s", "load_s"}."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        del src_rank
        changes = {k: int(v) for k, v in (("tp", tensor_parallel), ("pp", pipeline_parallel),
                                          ("ep", expert_parallel)) if v is not None}
        if precision is not None:
            changes["precision"] = precision
        if distributed_optimizer is not None:
            changes["distributed_optimizer"] = bool(distributed_optimizer)
        layout = dataclasses.replace(self.layout, **changes)
        layout.check(self.shape, spec.world_size)
        self.layout = layout
        self.spec, self.rank = None, None
        self.wsync_leave()  # a transfer group is of one world's layout
        self._free()
        t0 = time.perf_counter()
        ps.destroy_model_parallel()
        mp_destroy_s = time.perf_counter() - t0
        times = gdist.join_world(spec, rank, timeout_s=timeout_s)
        times["destroy_s"] += mp_destroy_s
        self.spec, self.rank = spec, rank
        t1 = time.perf_counter()
        ps.initialize_model_parallel(self.tp, self.pp, expert_model_parallel_size=layout.ep,
                                     expert_tensor_parallel_size=1,
                                     create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(self.seed)
        t2 = time.perf_counter()
        self._build(None if checkpoint is not None else init_weights)
        t3 = time.perf_counter()
        if checkpoint is not None:
            self.load_checkpoint(Path(checkpoint))
        times.update(mp_init_s=t2 - t1, build_s=t3 - t2, load_s=time.perf_counter() - t3)
        return times

    def flush(self, *, keep_rank: int = 0) -> None:
        """Nothing to do: `save_checkpoint` sums the gradients over data parallelism and
        the next world loads them from the checkpoint (`keep_rank` is ignored)."""
        del keep_rank

    def leave(self) -> dict[str, float]:
        """Destroy Megatron's parallel state and the group; free model and optimizer."""
        from megatron.core import parallel_state as ps

        t0 = time.perf_counter()
        self.wsync_leave()
        ps.destroy_model_parallel()
        gdist.leave_world()
        self._free()
        self.spec, self.rank = None, None
        return {"destroy_s": time.perf_counter() - t0}

    # ---- forward / backward -----------------------------------------------------------

    def _run(self, trajs: list, *, num_step_tokens: int, forward_only: bool,
             packing: str = "tree", keep_logits: bool = False) -> list[dict]:
        """Run the shard through the schedule; returns per-micro-batch results (last
        stage): the loss's sums and signals, plus `fed_tokens` and `pad_tokens`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches, seq, size = schedule_batches(
            trajs, treepack.check_packing(packing), pipelined=self.pp > 1,
            pad_id=self.shape.pad_token_id, device=self.device)
        if self.layout.sequence_parallel(self.shape):
            batches, seq = self._pad_for_sequence_parallel(batches)
        vocab = self.shape.vocab_size

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            if "tree" in b:
                return self._tree_step(b["tree"], model, num_step_tokens)
            tokens = b["token_ids"]
            pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            output = model(tokens, pos, attention_mask=None)

            def loss_func(logits):
                logits = logits[..., :vocab].float()
                loss, s = loss_and_signals(logits, b, settings=self.loss,
                                           num_step_tokens=num_step_tokens,
                                           trainer_version=self.version)
                s.update(fed_tokens=b["fed"], pad_tokens=b["pad"])
                if keep_logits:
                    s["logprobs"] = token_logprobs(logits.detach(), tokens)
                return loss, torch.tensor(s["tokens"], dtype=torch.int), s

            return output, loss_func

        self.ddp.train(not forward_only)
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[self.ddp],
            num_microbatches=len(batches), seq_length=seq, micro_batch_size=size,
            forward_only=forward_only)
        return list(out or [])

    def _pad_for_sequence_parallel(self, batches: list[dict]) -> tuple[list[dict], int]:
        """With sequence parallelism each TP rank holds an equal slice of the sequence:
        lengths are padded on to a multiple of TP. Padding comes after every real token
        and outside the loss (rows: mask 0; trees: isolated nodes nothing attends to and
        no entry reads), so it changes nothing but the work."""
        pad_id, tp = self.shape.pad_token_id, self.tp
        fill = {"token_ids": pad_id, "loss_mask": 0, "logprobs": 0.0, "versions": -1}
        out = []
        for b in batches:
            if "tree" in b:
                out.append({"tree": pad_tree(b["tree"], -b["tree"].num_tokens % tp,
                                             pad_id=pad_id)})
                continue
            extra = -b["token_ids"].shape[1] % tp
            b = dict(b)
            for key, value in fill.items():
                if extra and key in b:
                    b[key] = torch.nn.functional.pad(b[key], (0, extra), value=value)
            b["pad"] += extra * b["token_ids"].shape[0]
            b["fed"] += extra * b["token_ids"].shape[0]
            out.append(b)
        seq = max(b["tree"].num_tokens if "tree" in b else b["token_ids"].shape[1]
                  for b in out)
        return out, seq

    def _tree_step(self, tree, model, num_step_tokens: int):
        """One tree-packed sequence through this stage (RoPE at the tokens' depths, the
        tree mask as the attention mask); the loss on the last stage."""
        vocab = self.shape.vocab_size
        with self._positions.use(tree.position_ids):
            output = model(tree.token_ids, tree.position_ids, attention_mask=tree)

        def loss_func(logits):
            loss, s = tree_loss_and_signals(logits[..., :vocab].float(), tree,
                                            settings=self.loss,
                                            num_step_tokens=num_step_tokens,
                                            trainer_version=self.version)
            s.update(fed_tokens=tree.num_tokens, pad_tokens=0)
            return loss, torch.tensor(s["tokens"], dtype=torch.int), s

        return output, loss_func

    def _shard(self, mb: list, packing: str = "tree") -> list:
        from megatron.core import parallel_state as ps

        return treepack.shard(list(mb), rank=ps.get_data_parallel_rank(),
                              world_size=ps.get_data_parallel_world_size(), packing=packing)

    def train_microbatch(self, mb: list, *, num_step_tokens: int,
                         packing: str = "tree") -> dict[str, Any]:
        """Forward/backward this data-parallel replica's shard (`packing` as in
        `TrainerWorker.train_microbatch`); gradients accumulate. The reporter returns the
        shard's sums (`gyre_slurm.train.signals`, `fed_tokens`, `pad_tokens`), the other
        ranks {"trajectories": 0, "tokens": 0}."""
        shard = self._shard(mb, packing)
        reporter = self._is_reporter()
        if not shard:
            return {"trajectories": 0, "tokens": 0}
        results = self._run(shard, num_step_tokens=num_step_tokens, forward_only=False,
                            packing=packing)
        if not reporter:
            return {"trajectories": 0, "tokens": 0}
        return {"trajectories": len(shard), **merge_all(results)}

    def _sum_over_world(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value)
        return value

    def eval_loss(self, mb: list, *, num_step_tokens: int, packing: str = "tree") -> float:
        """The micro-batch's global loss (all DP shards), forward only; same on every rank."""
        shard = self._shard(mb, packing)
        total = torch.zeros(1, dtype=torch.float64)
        if shard:
            with torch.no_grad():
                results = self._run(shard, num_step_tokens=num_step_tokens,
                                    forward_only=True, packing=packing)
            if self._is_reporter():
                total += sum(r["loss_sum"] for r in results) / num_step_tokens
        return float(self._sum_over_world(total).item())

    def token_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-prob (fp32, full vocabulary) of each token given its prefix; position 0 is
        0.0. Every rank returns the same list."""
        from megatron.core import parallel_state as ps

        n = len(token_ids)
        traj = {"token_ids": list(token_ids), "loss_mask": [0] * n, "logprobs": [0.0] * n,
                "advantage": 0.0}
        with torch.no_grad():
            results = self._run([traj], num_step_tokens=1, forward_only=True,
                                packing="rows", keep_logits=True)
        out = torch.zeros(n, dtype=torch.float64)
        if self._is_reporter() and ps.get_data_parallel_rank() == 0:
            out += results[0]["logprobs"][0][:n].double().cpu()
        return self._sum_over_world(out).tolist()

    # ---- optimizer step ---------------------------------------------------------------

    def _clip_and_step(self) -> tuple[float, bool]:
        """Megatron's optimizer step, made of its parts so that a non-finite gradient
        norm skips the step (Megatron's bf16 path has no such check without a loss
        scaler): main gradients ready, global norm (all stages, TP shards, experts; each
        duplicate counted once), clip by it, AdamW (+ bf16 copy-back and, with the
        distributed optimizer, the parameter all-gather). Returns (norm, skipped)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            return norm, True
        if self.grad_clip > 0:
            for part in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
                params = part.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=self.grad_clip,
                                                 total_norm=norm)
        self.optimizer.step_with_ready_grads()
        return norm, False

    def optimizer_step(self, *, publish_dir: Path | None = None,
                       num_step_tokens: int | None = None) -> dict[str, Any]:
        """Finish the gradients (`finalize_model_grads`: all-reduce, or reduce-scatter
        with the distributed optimizer, over DP; TP sums of partial gradients), divide
        by `num_step_tokens` if given, clip by the global norm, AdamW, zero. Publishing
        is decided by global rank 0: when it got `publish_dir`, every rank takes part in
        gathering the full model and rank 0 writes `publish_dir/model.safetensors`
        (Hugging Face names; temp dir, then rename). `num_step_tokens=0`: the step
        trained nothing, and its update is skipped (`empty`; as the torch trainer's)."""
        from megatron.core.distributed import finalize_model_grads

        t0 = time.perf_counter()
        empty = num_step_tokens == 0  # the same on every rank
        finalize_model_grads([self.ddp])  # also where empty: it ends any reduce begun
        if num_step_tokens:
            self.ddp.scale_gradients(1.0 / float(num_step_tokens))
        t1 = time.perf_counter()
        norm, skipped = (None, True) if empty else self._clip_and_step()
        if skipped and not empty:
            logger.warning(SKIPPED, norm)
        self.version += 1  # a skipped step is a step too: its policy is the one before
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        t2 = time.perf_counter()
        target = str(publish_dir) if publish_dir is not None else None
        if self.world_size > 1:
            target = gdist.broadcast_text(target, src=0)
        if target is not None:  # skipped too: the servers load the version counted
            self.publish(Path(target))
        return {"version": self.version, "grad_norm": norm, "skipped": skipped, "empty": empty,
                "lr": state.torch_optimizers(self.optimizer)[0].param_groups[0]["lr"],
                "allreduce_s": t1 - t0, "step_s": t2 - t1,
                "publish_s": time.perf_counter() - t2}

    # ---- Hugging Face export ------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model in Hugging Face names (the training dtype) on global rank 0
        (None elsewhere). Collective: the dense parameters of the data-parallel rank 0
        replica and the experts of expert-data-parallel rank 0 are gathered (with EP the
        experts of one replica may sit on other DP ranks; convert.gather_hf_state)."""
        from megatron.core import parallel_state as ps

        local = {k: v for k, v in self.core.state_dict().items()
                 if not k.endswith("_extra_state")}
        return convert.gather_hf_state(
            local, self.shape, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=self.tp,
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=self.pp,
            dp_rank=ps.get_data_parallel_rank(), rank=self.rank or 0,
            world_size=self.world_size, ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=self.layout.ep, edp_rank=ps.get_expert_data_parallel_rank())

    def wsync_layout(self):
        from gyre_slurm.train.wsync.plan import TrainerLayout

        return TrainerLayout("megatron", self.world_size, tp=self.tp, pp=self.pp,
                             ep=self.layout.ep)

    def hf_pieces(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """This rank's shard in Hugging Face names: views of its parameters (q/k/v: made
        bucket by bucket), each with the dimension along which the TP pieces
        concatenate (streamed weight sync)."""
        from megatron.core import parallel_state as ps

        local = {k: v.detach() for k, v in self.core.state_dict().items()
                 if not k.endswith("_extra_state")}
        return convert.megatron_shard_to_hf_pieces(
            local, self.shape, tp_size=self.tp,
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=self.pp,
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=self.layout.ep, lazy=True)

    def publish(self, out_dir: Path) -> Path | None:
        """Collective: write the full model to `out_dir/model.safetensors` (rank 0)."""
        state = self.hf_state_dict()
        if state is None:
            return None
        return tiny.save_state(state, Path(out_dir))

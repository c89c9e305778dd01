"""`MegatronWorker`: the Megatron-core training backend, with `TrainerWorker`'s API.

One per node (or local process), long-lived; every rebuild of the world builds a new
`GPTModel` for the new layout (TP x PP, data-parallel over the rest) and the state
crosses the rebuild through a `dist_checkpointing` checkpoint, which reshards it:

1. every member of the OLD world calls `save_checkpoint(path)` (collective): model,
   AdamW moments (sharded like their parameters), step count, policy version and the
   gradients accumulated since the last step (summed over data-parallel replicas, so a
   world may end mid-step);
2. members that go away call `leave()`; `flush()` is a no-op (the DP sum happens in
   the save);
3. every member of the NEW world calls `join(spec, rank, checkpoint=path)`: old Megatron
   state and group destroyed, generation `spec.generation` joined through
   `gyre_slurm.train.dist.join_world`, model parallelism initialised, a model built for
   the new layout and the checkpoint loaded into it. The accumulated gradients land on
   data-parallel rank 0 (zero elsewhere): the sum over DP ranks stays the step's gradient.

Rank layout (Megatron's "tp-cp-ep-dp-pp" order): rank = tp + TP * (dp + DP * pp).
`train_microbatch` takes this replica's shard (tree packing: whole runs,
`treepack.assign_runs`; rows: trajectories `mb[dp_rank::dp_size]`); every TP/PP rank of
a data-parallel replica runs the same shard through `get_forward_backward_func()` (1F1B
over the stages when PP > 1). Tree-packed sequences go through `GPTModel` with the tree
mask as the attention mask (`train/megatron/tree.py`: core attention, RoPE positions).
Logits are gathered over TP (`parallel_output=False`) and the loss (`loss.kind`) and its
signals are `gyre_slurm.train.signals.loss_and_signals` (tree: `train.tree`) on the
full, unpadded vocabulary, as in the torch backend. Gradients accumulate in one flat
buffer per rank;
`optimizer_step` sums it over DP, divides by `num_step_tokens` if given, clips by the
global norm (TP-duplicated parameters counted once, all stages) and steps a plain torch
AdamW over this rank's parameters.

Statistics (`tokens`, `loss_sum`, the mismatch sums of `gyre_slurm.train.signals`, ...)
are reported by one rank per data-parallel replica (TP rank 0 of the last stage, which
holds the gathered logits; the others report zeros), so merging them over the world's
members (`gyre_slurm.train.metrics.merge`) gives the totals, as with the torch backend.
The entropy is taken from those gathered, full-vocabulary logits.

Without a GPU, `cpu_shim.activate()` (called at construction) makes Megatron's CUDA
calls run on CPU; on a GPU it does nothing.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gyre_slurm.models import tiny
from gyre_slurm.train import dist as gdist
from gyre_slurm.train.dist import WorldSpec
from gyre_slurm.train.loss import LossSettings, token_logprobs
from gyre_slurm.train.metrics import merge_all
from gyre_slurm.train.signals import loss_and_signals
from gyre_slurm.train.megatron import convert
from gyre_slurm.train.megatron.convert import ModelShape
from gyre_slurm.train.megatron.tree import schedule_batches
from gyre_slurm.train.tree import tree_loss_and_signals
from gyre_slurm.traj import treepack
from gyre_slurm.train.worker import flat_grads_and_adamw
from gyre_slurm.train.wsync.endpoint import StreamSender

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


class MegatronWorker(StreamSender):
    def __init__(self, *, model_dir: Path, node_index: int, lr: float = 1e-3, seed: int = 0,
                 grad_clip: float = 1.0, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 loss: LossSettings | dict | None = None):
        from gyre_slurm.train.megatron import cpu_shim

        if tensor_parallel < 1 or pipeline_parallel < 1:
            raise ValueError(f"tensor_parallel {tensor_parallel} and pipeline_parallel "
                             f"{pipeline_parallel} must be >= 1")
        self.model_dir = Path(model_dir)
        self.shape = ModelShape.from_model_dir(self.model_dir)
        self.shape.check_layout(tensor_parallel, pipeline_parallel)
        self.node_index = node_index
        self.lr, self.seed, self.grad_clip = lr, seed, grad_clip
        self.loss = loss if isinstance(loss, LossSettings) else LossSettings(**(loss or {}))
        self.tp, self.pp = tensor_parallel, pipeline_parallel
        self.version = 0
        self.spec: WorldSpec | None = None
        self.rank: int | None = None
        self.model = None
        self.optimizer: torch.optim.AdamW | None = None
        self._params: list[torch.nn.Parameter] = []
        self._grads: torch.Tensor | None = None
        cpu_shim.activate()
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        _sharded_sync_writes()

    # ---- layout -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.spec.world_size if self.spec is not None else 1

    def layout(self) -> dict[str, int]:
        """This rank's coordinates: tp/pp/dp rank and size."""
        from megatron.core import parallel_state as ps

        return {"tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": self.tp,
                "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp_size": self.pp,
                "dp_rank": ps.get_data_parallel_rank(),
                "dp_size": ps.get_data_parallel_world_size()}

    def _is_reporter(self) -> bool:
        """TP rank 0 of the last stage: reports this data-parallel replica's stats."""
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    # ---- building and freeing -------------------------------------------------------

    def _transformer_config(self):
        from megatron.core.transformer import TransformerConfig

        s = self.shape
        config = TransformerConfig(
            num_layers=s.num_layers, hidden_size=s.hidden_size,
            num_attention_heads=s.num_heads, num_query_groups=s.num_kv_heads,
            kv_channels=s.head_dim, ffn_hidden_size=s.ffn_hidden_size,
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            normalization="RMSNorm", layernorm_epsilon=s.rms_norm_eps,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, add_qkv_bias=s.qkv_bias,
            hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=self.device.type == "cpu",
            bias_activation_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
            params_dtype=torch.float32, pipeline_dtype=torch.float32,
            attention_softmax_in_fp32=True, calculate_per_token_loss=True)
        # Tree-packed micro-batches differ in length: the pipeline stages exchange shapes.
        # Set after construction: the config refuses it whenever the MoE dispatcher is
        # "allgather", its default even for dense models, where no dispatcher runs.
        config.variable_seq_lengths = self.pp > 1
        return config

    def _build(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from gyre_slurm.train.megatron.tree import TreePositions, with_tree_attention

        s = self.shape
        model = GPTModel(
            config=self._transformer_config(),
            transformer_layer_spec=with_tree_attention(
                get_gpt_layer_local_spec(normalization="RMSNorm")),
            vocab_size=s.padded_vocab_size, max_sequence_length=s.max_positions,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            parallel_output=False, share_embeddings_and_output_weights=False,
            position_embedding_type="rope", rotary_base=int(s.rope_theta))
        self.model = model.to(self.device).train()
        self._positions = TreePositions(self.model)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._grads, self.optimizer = flat_grads_and_adamw(self._params, lr=self.lr)

    def _free(self) -> None:
        for p in self._params:
            p.grad = None
        self.model = self.optimizer = self._grads = None
        self._params = []
        self.version = 0

    def _load_hf(self, weights_dir: Path) -> None:
        from safetensors.torch import load_file

        from megatron.core import parallel_state as ps

        hf = load_file(str(Path(weights_dir) / tiny.WEIGHTS_FILE))
        shard = convert.hf_to_megatron_shard(
            hf, self.shape, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=self.tp,
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=self.pp)
        own = {k for k in self.model.state_dict() if not k.endswith("_extra_state")}
        if set(shard) != own:
            raise ValueError(f"{weights_dir}: converted names differ from the model's: "
                             f"missing {sorted(own - set(shard))}, extra "
                             f"{sorted(set(shard) - own)}")
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, value in shard.items():
                if params[name].shape != value.shape:
                    raise ValueError(f"{weights_dir}: {name} has shape {tuple(value.shape)}, "
                                     f"the model wants {tuple(params[name].shape)}")
                params[name].copy_(value)

    # ---- world membership -----------------------------------------------------------

    def join(self, spec: WorldSpec, rank: int, *, src_rank: int = 0,
             init_weights: Path | None = None, checkpoint: Path | None = None,
             timeout_s: float = 120.0, tensor_parallel: int | None = None,
             pipeline_parallel: int | None = None) -> dict[str, float]:
        """Join world `spec` as `rank` and build this layout's model.

        State comes from `checkpoint` (a `save_checkpoint` directory, resharded to this
        layout) or else `init_weights` (a dir with model.safetensors in Hugging Face
        names); with neither, Megatron's own initialisation (seeded; depends on the
        layout). `src_rank` is accepted for API compatibility and ignored: state always
        travels through the checkpoint. `tensor_parallel` / `pipeline_parallel`, when
        given, change the layout from this world on (all members must agree). Returns
        {"destroy_s", "init_s", "mp_init_s", "build_s", "load_s"}."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        del src_rank
        tp = self.tp if tensor_parallel is None else int(tensor_parallel)
        pp = self.pp if pipeline_parallel is None else int(pipeline_parallel)
        if tp < 1 or pp < 1:
            raise ValueError(f"tensor_parallel {tp} and pipeline_parallel {pp} must be >= 1")
        self.shape.check_layout(tp, pp)
        self.tp, self.pp = tp, pp
        if spec.world_size % (self.tp * self.pp):
            raise ValueError(f"a world of {spec.world_size} ranks cannot hold tensor_parallel "
                             f"{self.tp} x pipeline_parallel {self.pp} (world size must be a "
                             "multiple of TP * PP)")
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
        ps.initialize_model_parallel(self.tp, self.pp, create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(self.seed)
        t2 = time.perf_counter()
        self._build()
        t3 = time.perf_counter()
        if checkpoint is not None:
            self.load_checkpoint(Path(checkpoint))
        elif init_weights is not None:
            self._load_hf(Path(init_weights))
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

        self.model.train(not forward_only)
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[self.model],
            num_microbatches=len(batches), seq_length=seq, micro_batch_size=size,
            forward_only=forward_only)
        return list(out or [])

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
        if self._params and self._params[0].grad.data_ptr() != self._grads.data_ptr():
            raise RuntimeError("autograd replaced the flat gradient buffer")
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
            out += results[0]["logprobs"][0].double().cpu()
        return self._sum_over_world(out).tolist()

    # ---- optimizer step ---------------------------------------------------------------

    def _reduce_grads_over_dp(self) -> None:
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(self._grads, group=ps.get_data_parallel_group())

    def _global_grad_norm(self) -> float:
        """L2 norm of the whole model's gradient: all stages, TP shards, each TP-duplicated
        parameter (norms, ...) counted once."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in self._params:
            if param_is_not_tensor_parallel_duplicate(p):
                sq += p.grad.double().pow(2).sum()
        if self.tp * self.pp > 1:
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return math.sqrt(float(sq.item()))

    def optimizer_step(self, *, publish_dir: Path | None = None,
                       num_step_tokens: int | None = None) -> dict[str, Any]:
        """All-reduce(sum) gradients over DP, normalise, clip by the global norm, AdamW,
        zero. Publishing is decided by global rank 0: when it got `publish_dir`, every
        rank takes part in gathering the full model and rank 0 writes
        `publish_dir/model.safetensors` (Hugging Face names; temp dir, then rename)."""
        t0 = time.perf_counter()
        self._reduce_grads_over_dp()
        if num_step_tokens is not None:
            self._grads.div_(float(num_step_tokens))
        t1 = time.perf_counter()
        norm = self._global_grad_norm()
        skipped = not math.isfinite(norm)
        if skipped:
            logger.warning("non-finite gradient norm: step skipped, gradients dropped")
        else:
            coef = self.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                self._grads.mul_(coef)
            self.optimizer.step()
            self.version += 1
        self._grads.zero_()
        t2 = time.perf_counter()
        target = str(publish_dir) if publish_dir is not None else None
        if self.world_size > 1:
            target = gdist.broadcast_text(target, src=0)
        if target is not None and not skipped:
            self.publish(Path(target))
        return {"version": self.version, "grad_norm": norm, "skipped": skipped,
                "allreduce_s": t1 - t0, "step_s": t2 - t1,
                "publish_s": time.perf_counter() - t2}

    # ---- Hugging Face export ------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model in Hugging Face names on global rank 0 (None elsewhere).
        Collective: the data-parallel rank 0 replica's shards are gathered."""
        from megatron.core import parallel_state as ps

        local = {k: v for k, v in self.model.state_dict().items()
                 if not k.endswith("_extra_state")}
        return convert.gather_hf_state(local, self.shape, tp_rank=ps.get_tensor_model_parallel_rank(),
                               tp_size=self.tp, pp_rank=ps.get_pipeline_model_parallel_rank(),
                               pp_size=self.pp, dp_rank=ps.get_data_parallel_rank(),
                               rank=self.rank or 0, world_size=self.world_size)

    def wsync_layout(self):
        from gyre_slurm.train.wsync.plan import TrainerLayout

        return TrainerLayout("megatron", self.world_size, tp=self.tp, pp=self.pp)

    def hf_pieces(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """This rank's shard in Hugging Face names: views of its parameters (q/k/v: made
        bucket by bucket), each with the dimension along which the TP pieces
        concatenate (streamed weight sync)."""
        from megatron.core import parallel_state as ps

        local = {k: v.detach() for k, v in self.model.state_dict().items()
                 if not k.endswith("_extra_state")}
        return convert.megatron_shard_to_hf_pieces(
            local, self.shape, tp_size=self.tp,
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=self.pp, lazy=True)

    def publish(self, out_dir: Path) -> Path | None:
        """Collective: write the full model to `out_dir/model.safetensors` (rank 0)."""
        state = self.hf_state_dict()
        if state is None:
            return None
        return tiny.save_state(state, Path(out_dir))

    # ---- checkpoints ------------------------------------------------------------------------

    def _sharded_state(self) -> dict[str, Any]:
        """Model, AdamW moments and gradients as ShardedTensors; version and step common."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor)

        model_sd = self.model.sharded_state_dict()
        by_id = get_param_id_to_sharded_param_map(model_sd, self._params)
        if len(by_id) != len(self._params):
            raise RuntimeError("some parameters have no sharded counterpart")
        state = {"model": model_sd, "optimizer": {}, "grads": {}}
        for key in ("exp_avg", "exp_avg_sq"):
            state["optimizer"][key] = {
                i: make_sharded_optimizer_tensor(by_id[i], self.optimizer.state[p][key],
                                                 prefix=f"optimizer.state.{key}")
                for i, p in enumerate(self._params)}
        state["grads"] = {i: make_sharded_optimizer_tensor(by_id[i], p.grad, prefix="grads")
                          for i, p in enumerate(self._params)}
        steps = {float(self.optimizer.state[p]["step"]) for p in self._params}
        if len(steps) != 1:
            raise RuntimeError(f"AdamW steps differ between parameters: {steps}")
        state["meta"] = {"version": self.version, "adam_step": steps.pop(),
                         "format": "gyre-megatron-1"}
        return state

    def save_checkpoint(self, path: Path) -> Path:
        """COLLECTIVE: every rank of the world calls it. Writes a dist_checkpointing
        directory at `path` (temp dir, barrier, rank 0 renames it into place) holding
        model, AdamW state, version and the gradients accumulated so far, summed over
        data parallelism. The sum stays on DP rank 0 here too (zero elsewhere), so
        training may go on in this world after a mid-step save."""
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps

        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        self._reduce_grads_over_dp()
        if ps.get_data_parallel_rank() != 0:
            self._grads.zero_()
        if (self.rank or 0) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        dist_checkpointing.save(self._sharded_state(), str(tmp))
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
        resharded to its layout. Gradients are kept on DP rank 0 only."""
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps

        if self.model is None:
            raise RuntimeError("load_checkpoint needs a world: call join first")
        path = Path(path)
        if not (path / "metadata.json").exists():
            raise FileNotFoundError(f"{path}: not a Megatron checkpoint (no metadata.json)")
        state = self._sharded_state()
        loaded = dist_checkpointing.load(state, str(path))
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(loaded["model"], strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise RuntimeError(f"{path}: missing {missing}, unexpected {unexpected}")
            step = torch.tensor(float(loaded["meta"]["adam_step"]), dtype=torch.float32)
            for i, p in enumerate(self._params):
                st = self.optimizer.state[p]
                st["exp_avg"].copy_(loaded["optimizer"]["exp_avg"][i])
                st["exp_avg_sq"].copy_(loaded["optimizer"]["exp_avg_sq"][i])
                st["step"] = step.clone()
                p.grad.copy_(loaded["grads"][i])
            if ps.get_data_parallel_rank() != 0:
                self._grads.zero_()
        self.version = int(loaded["meta"]["version"])

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # ---- digests ---------------------------------------------------------------------------

    def digests(self) -> dict[str, Any]:
        """sha256 of this rank's parameters + AdamW state + version ("state") and of its
        local gradients ("grads"); ranks of one layout position compare equal."""
        h = hashlib.sha256(str(self.version).encode())
        for p in self._params:
            st = self.optimizer.state[p]
            for t in (p.data, st["exp_avg"], st["exp_avg_sq"], st["step"]):
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
        g = hashlib.sha256(self._grads.cpu().numpy().tobytes())
        return {"state": h.hexdigest(), "grads": g.hexdigest(), "version": self.version}

"""The trainer state of a Megatron world as one `dist_checkpointing` sharded state dict,
and the gradients accumulated mid-step, which must survive a change of world.

A world may end between micro-batches of a step. Its gradients then live in each rank's
DDP buffers, not yet reduced: `consolidate_grads` performs, once, every sum that
`finalize_model_grads` would perform at the step (over the data-parallel group for
dense parameters, the expert-data-parallel group for experts, the tensor-parallel group
for the parameters whose gradients are partial per TP rank: q/k norms, and with
sequence parallelism the norms and the router), and keeps each sum on ONE rank of its
group (zero on the others). The sums at the step then give the same total, in this
world or in the next one: `keep_grads_on_owners` zeroes the copies that a resharded
load hands to every replica.

`sharded_state` = {"model": the model's ShardedTensors; "optimizer": Megatron's
optimizer sharded state (fp32 master weights when the model is bf16, AdamW moments;
with the distributed optimizer each rank's slice of them, in the model's coordinates:
`fully_sharded_model_space`, so a load reshards over TP, PP, EP and DP alike); "grads":
the consolidated gradients, sharded like their parameters; "meta": version}.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (one, or one per chained part)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [p.optimizer for p in parts if getattr(p, "optimizer", None) is not None]


def _saved_groups_at(sd, lr: float) -> None:
    """Give a saved optimizer state's parameter groups the configured learning rate
    before it loads. Megatron finds each saved group by a key that includes its
    `max_lr`, so a state saved at another rate (a run resumed with `--set
    optimizer.lr=...`) did not load ("Could not find parameter group"), and torch's
    `load_state_dict` would have put the saved rate back (the torch trainer:
    `train.worker.set_lr`)."""
    if isinstance(sd, dict):
        for group in sd.get("param_groups") or ():
            if isinstance(group, dict):
                group["lr"] = lr
                if "max_lr" in group:
                    group["max_lr"] = lr
        for key, value in sd.items():
            if key != "param_groups":
                _saved_groups_at(value, lr)


def init_adam_state(optimizer) -> None:
    """Create AdamW's state (step 0, zero moments) now, not at the first step: every
    world, and every checkpoint, then has the same layout, even before a step."""
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p].update(step=torch.tensor(0.0, dtype=torch.float32),
                                        exp_avg=torch.zeros_like(p.data),
                                        exp_avg_sq=torch.zeros_like(p.data))


def is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)


def tp_partial(name: str, param, config) -> bool:
    """Gradients that each TP rank holds a part of (summed over TP by Megatron's
    `_allreduce_non_tensor_model_parallel_grads`; the same test)."""
    return bool((config.sequence_parallel and getattr(param, "sequence_parallel", False))
                or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)))


def _groups():
    from megatron.core import parallel_state as ps

    return {"dp": (ps.get_data_parallel_group(), ps.get_data_parallel_rank()),
            "edp": (ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_rank()),
            "tp": (ps.get_tensor_model_parallel_group(),
                   ps.get_tensor_model_parallel_rank())}


def _reduce(t: torch.Tensor, group) -> None:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)


def consolidate_grads(ddp, core) -> None:
    """Sum the accumulated gradients over their groups, once; keep each sum on one rank."""
    groups = _groups()
    for buffers, key in ((ddp.buffers, "dp"), (ddp.expert_parallel_buffers, "edp")):
        group, rank = groups[key]
        for buf in buffers:
            _reduce(buf.grad_data, group)
            if rank != 0:
                buf.grad_data.zero_()
    tp_group, tp_rank = groups["tp"]
    for name, p in core.named_parameters():
        if p.requires_grad and tp_partial(name, p, core.config):
            _reduce(p.main_grad, tp_group)
            if tp_rank != 0:
                p.main_grad.zero_()


def keep_grads_on_owners(core) -> None:
    """After a load: each replica got the whole consolidated sum; keep it on the owners
    `consolidate_grads` keeps it on (DP / expert-DP rank 0, TP rank 0 for TP partials)."""
    groups = _groups()
    for name, p in core.named_parameters():
        if not p.requires_grad:
            continue
        rank = groups["edp" if is_expert(p) else "dp"][1]
        if rank != 0 or (groups["tp"][1] != 0 and tp_partial(name, p, core.config)):
            p.main_grad.zero_()


def sharded_state(core, optimizer, *, meta: dict, loading: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor)

    model_sd = core.sharded_state_dict()
    params = [p for p in core.parameters() if p.requires_grad]
    by_id = get_param_id_to_sharded_param_map(model_sd, params)
    if len(by_id) != len(params):
        raise RuntimeError("some parameters have no sharded counterpart")
    grads = {i: make_sharded_optimizer_tensor(by_id[i], p.main_grad, prefix="grads")
             for i, p in enumerate(params)}
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=SHARDING)
    _keep_zero_step(opt_sd)
    return {"model": model_sd, "optimizer": opt_sd, "grads": grads, "meta": meta}


def _keep_zero_step(sd) -> None:
    """Megatron's FP32 and mixed-precision optimizers save AdamW's step once, as
    "common_step", but only `if step:`, so a state saved before the first step (a world
    rebuilt before any step) has none, and loading it fails in torch (KeyError 'step').
    Put the zero back."""
    if isinstance(sd, dict):
        state = sd.get("state")
        if isinstance(state, dict) and "param_groups" in sd and "common_step" not in state \
                and any(isinstance(k, int) for k in state):
            state["common_step"] = torch.tensor(0.0, dtype=torch.float32)
        for value in sd.values():
            _keep_zero_step(value)


def unshare_steps(optimizer) -> None:
    """Give each parameter's AdamW state its own "step" tensor.

    Megatron 0.19.2's DistributedOptimizer.load_state_dict (without Apex or Transformer
    Engine, i.e. with torch's AdamW) sets `s["step"] = step` for every state: ONE tensor
    object for all of them. torch's AdamW then adds 1 to it once per parameter at each
    step (`step_t += 1`, in place), so after a load the bias correction of every later
    step was that of step ~N_params x steps: a resharded optimizer diverged from an
    uninterrupted one (measured: relative parameter error 33 after 2 steps)."""
    for opt in torch_optimizers(optimizer):
        for st in opt.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].detach().clone()


def apply_loaded(core, optimizer, loaded: dict, *, source: str, lr: float) -> dict:
    """Put a loaded `sharded_state` into the model, optimizer (at learning rate `lr`, the
    configured one, whatever the state was saved at) and gradient buffers."""
    params = [p for p in core.parameters() if p.requires_grad]
    with torch.no_grad():
        missing, unexpected = core.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"{source}: missing {missing}, unexpected {unexpected}")
        _saved_groups_at(loaded["optimizer"], lr)
        optimizer.load_state_dict(loaded["optimizer"])
        unshare_steps(optimizer)
        for i, p in enumerate(params):
            p.main_grad.copy_(loaded["grads"][i])
    keep_grads_on_owners(core)
    return loaded["meta"]

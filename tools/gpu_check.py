"""What can only be checked on a GPU: run once on a machine with one NVIDIA GPU, no network.

    bash tools/gpu_check.sh              # on the GPU machine (see its header)
    tools/gyre-env python tools/gpu_check.py --allow-cpu   # the same checks on CPU/gloo

Checks, each timed, each a row of the table printed at the end:
  device      torch, CUDA, the GPU, bf16 support
  nccl        NCCL process groups rebuilt generation after generation on one TCPStore
              (gyre_slurm.train.dist.join_world: a new PrefixStore each time), an
              all-reduce in each; median rebuild seconds. One GPU: worlds of one rank
              (NCCL refuses two ranks on one device).
  torch       the torch backend's TrainerWorker on CUDA: micro-batches, optimizer steps,
              a published policy reloaded by transformers with the same log-probs, a
              handoff through a checkpoint that restores the state bit for bit
  bf16        the tiny model in bf16 against fp32 (log-prob difference), a bf16 step
  losses      every loss.kind trains a micro-batch sampled by the model in bf16 (a
              bf16 sampler against the fp32 trainer): finite loss, entropy and grad norm,
              and the trainer/sampler mismatch it reports
  megatron    Megatron-core TP=1/PP=1 with its real CUDA path (no CPU shim): weights from
              the HF checkpoint give transformers' log-probs, steps train, a
              dist_checkpointing save/load round trip keeps the loss, the export reloads
              (skipped with a reason when megatron-core is not importable)
  megatron_bf16  Megatron-core bf16 with the distributed optimizer on a Qwen3-MoE model:
              tracks fp32 (eval loss within 2% after 3 steps), the sharded optimizer
              state survives a checkpoint, the export's log-probs, the model state's
              bytes within 1% of the calculator's (models/memory.py; DDP pads its buffers)
  tree        tree packing's GPU kernel: compiled FlexAttention with the tree block mask
              against SDPA run by run (the CPU path), forward and backward, on branchy
              runs; the torch trainer's tree-packed gradient against rows; Megatron's
              tree-packed loss against rows (when importable); and the kernels' times
              on a larger batch (docs/tree-training.md)
  wsync       the streamed weight sync between processes (NCCL on two GPUs, gloo through
  vllm-sleep  host memory on one) and vLLM's sleep and wake around a streamed round:
              see tools/gpu_check_wsync.py (vllm-sleep needs --vllm-python PATH)
Exit status: 0 when no check failed (a skip is not a failure), 1 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

ROWS: list[tuple[str, str, str]] = []
VOCAB = 512


def row(name: str, status: str, detail: str) -> None:
    ROWS.append((name, status, detail))
    print(f"[{status}] {name}: {detail}", flush=True)


def check(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                detail = fn(*args, **kwargs)
                status = "PASS"
                if isinstance(detail, tuple):
                    status, detail = detail
            except Exception as exc:  # noqa: BLE001 - every failure is a row
                traceback.print_exc()
                status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
            row(name, status, f"{detail} ({time.perf_counter() - t0:.1f} s)")
        return run
    return wrap


def micro_batch(seed: int, n: int = 8, vocab: int = VOCAB):
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(12, 40))
        mask = [0] * 4 + [int(x) for x in rng.random(length - 4) < 0.8]
        out.append({"run_id": f"s{seed}-{i}",
                    "token_ids": rng.integers(0, vocab, length).tolist(),
                    "loss_mask": mask,
                    "logprobs": [float(-math.log(vocab) + rng.normal(scale=0.3)) if m else 0.0
                                 for m in mask],
                    "advantage": float(rng.normal())})
    return out


def branchy_batch(seed: int, *, runs: int = 4, branches: int = 4, vocab: int = VOCAB,
                  base: int = 40):
    """Runs whose trajectories share prefixes (a prompt, then branches leaving an earlier
    branch at a random point), each trained token in one trajectory only."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for r in range(runs):
        paths = []
        for j in range(branches):
            if j == 0:
                ids = rng.integers(0, vocab, base + int(rng.integers(0, base))).tolist()
                mask = [0] * 4 + [1] * (len(ids) - 4)
            else:
                src = paths[int(rng.integers(0, j))]
                cut = int(rng.integers(4, len(src)))
                new = rng.integers(0, vocab, int(rng.integers(4, base))).tolist()
                new[0] = (src[cut] + 1) % vocab if cut < len(src) and new[0] == src[cut] \
                    else new[0]
                ids, mask = src[:cut] + new, [0] * cut + [1] * len(new)
            paths.append(ids)
            out.append({"run_id": f"t{seed}-{r}", "token_ids": ids, "loss_mask": mask,
                        "logprobs": [float(-math.log(vocab) + rng.normal(scale=0.3)) if m
                                     else 0.0 for m in mask],
                        "advantage": float(rng.normal())})
    return out


def n_tokens(*mbs) -> int:
    return sum(sum(t["loss_mask"]) for mb in mbs for t in mb)


def hf_logprobs(model_dir: Path, weights: Path, token_ids: list[int], device, dtype=None):
    import torch

    from gyre_slurm.models import tiny

    model = tiny.new_model(model_dir)
    tiny.load_weights(model, weights)
    model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    with torch.no_grad():
        ids = torch.tensor([token_ids], device=device)
        logits = model(input_ids=ids, use_cache=False).logits.float()
        lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return [0.0] + lp.cpu().tolist()


@check("device")
def check_device(args):
    import torch

    if not torch.cuda.is_available():
        return "SKIP" if args.allow_cpu else "FAIL", f"torch {torch.__version__}: no CUDA device"
    p = torch.cuda.get_device_properties(0)
    return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, "
            f"{p.total_memory / 2**30:.0f} GiB, bf16 {torch.cuda.is_bf16_supported()}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")


@check("nccl")
def check_nccl(args, store_port, gens):
    from gyre_slurm.train import dist as gdist

    backend = args.backend
    times = []
    for _ in range(args.rebuilds):
        spec = gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=backend)
        t0 = time.perf_counter()
        gdist.join_world(spec, 0)
        total = gdist.all_reduce_sum(2.5)
        times.append(time.perf_counter() - t0)
        if total != 2.5:
            raise AssertionError(f"all-reduce gave {total}, expected 2.5")
    gdist.leave_world()
    return (f"{backend}: {args.rebuilds} generations, rebuild + all-reduce median "
            f"{statistics.median(times) * 1e3:.1f} ms (first {times[0] * 1e3:.0f} ms)")


@check("torch")
def check_torch(args, store_port, gens, model_dir: Path, work: Path):
    import torch

    from gyre_slurm.models import tiny
    from gyre_slurm.train import dist as gdist
    from gyre_slurm.train.worker import TrainerWorker

    w = TrainerWorker(model_dir=model_dir, node_index=0, lr=1e-3, seed=0)
    spec = gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=args.backend)
    w.join(spec, 0, src_rank=0, init_weights=work / "v0")
    if args.backend == "nccl" and w.device.type != "cuda":
        raise AssertionError(f"the worker trains on {w.device}, not CUDA")
    losses, t0 = [], time.perf_counter()
    for step in range(3):
        mbs = [micro_batch(10 * step + i) for i in range(2)]
        n = n_tokens(*mbs)
        for mb in mbs:
            losses.append(w.train_microbatch(mb, num_step_tokens=n)["loss_sum"])
        res = w.optimizer_step(publish_dir=work / f"torch-v{step + 1}")
    step_s = (time.perf_counter() - t0) / 3
    if not all(math.isfinite(x) for x in losses) or res["version"] != 3:
        raise AssertionError(f"losses {losses}, version {res['version']}")
    ids = micro_batch(99, n=1)[0]["token_ids"]
    ours = w.model(input_ids=torch.tensor([ids], device=w.device), use_cache=False).logits
    ours = torch.log_softmax(ours[0, :-1].float(), -1).gather(
        -1, torch.tensor(ids[1:], device=w.device)[:, None])[:, 0].tolist()
    ref = hf_logprobs(model_dir, work / "torch-v3", ids, w.device)[1:]
    diff = max(abs(a - b) for a, b in zip(ours, ref))
    if diff > 1e-4:
        raise AssertionError(f"published weights give log-probs {diff:.2e} away")
    before = w.digests()["state"]
    w.save_checkpoint(work / "torch-state.pt")
    w.leave()
    w.join(gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=args.backend), 0,
           src_rank=0, checkpoint=work / "torch-state.pt")
    if w.digests()["state"] != before:
        raise AssertionError("the state after a checkpoint handoff differs")
    w.leave()
    del tiny
    return (f"{w.device}: 3 steps, {step_s:.2f} s/step; published v3 reloads with log-probs "
            f"within {diff:.1e}; checkpoint handoff restores the state bit for bit")


@check("bf16")
def check_bf16(args, model_dir: Path, work: Path):
    import torch

    from gyre_slurm.models import tiny

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = micro_batch(7, n=1)[0]["token_ids"]
    fp32 = hf_logprobs(model_dir, work / "v0", ids, device)
    bf16 = hf_logprobs(model_dir, work / "v0", ids, device, dtype=torch.bfloat16)
    diff = max(abs(a - b) for a, b in zip(fp32, bf16))
    model = tiny.new_model(model_dir).to(device).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.tensor([ids], device=device)
    loss = torch.nn.functional.cross_entropy(
        model(input_ids=x, use_cache=False).logits[0, :-1].float(), x[0, 1:])
    loss.backward()
    opt.step()
    if not math.isfinite(float(loss)) or diff > 0.5:
        raise AssertionError(f"bf16 loss {float(loss)}, log-prob difference {diff}")
    return f"{device}: bf16 vs fp32 log-probs max |diff| {diff:.3f}; a bf16 step, loss {float(loss):.3f}"


@check("losses")
def check_losses(args, store_port, gens, model_dir: Path, work: Path):
    """Every loss.kind trains a micro-batch whose sampling logprobs come from the
    model in bf16 (a bf16 sampler against the fp32 trainer): finite loss and signals,
    and the mismatch they report is the bf16/fp32 difference."""
    import torch

    from gyre_slurm.train import dist as gdist
    from gyre_slurm.train.loss import LOSS_NAMES
    from gyre_slurm.train.worker import TrainerWorker

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mb = micro_batch(11, n=4)
    for t in mb:  # the bf16 sampler's logprobs of its own tokens, at version 0
        lp = hf_logprobs(model_dir, work / "v0", t["token_ids"], device, dtype=torch.bfloat16)
        t["logprobs"] = [x if m else 0.0 for x, m in zip(lp, t["loss_mask"])]
        t["versions"] = [0 if m else -1 for m in t["loss_mask"]]
    found = []
    for name in LOSS_NAMES:
        w = TrainerWorker(model_dir=model_dir, node_index=0, lr=1e-3, seed=0,
                          loss={"name": name})
        spec = gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=args.backend)
        w.join(spec, 0, src_rank=0, init_weights=work / "v0")
        s = w.train_microbatch(mb, num_step_tokens=n_tokens(mb))
        res = w.optimizer_step()
        w.leave()
        figures = [s["loss_sum"], s["entropy_sum"], s["mismatch_abs_sum"], res["grad_norm"]]
        if not all(math.isfinite(x) for x in figures) or s["mismatch_abs_max"] <= 0:
            raise AssertionError(f"{name}: {s}, grad norm {res['grad_norm']}")
        found.append(f"{name} {s['loss_sum'] / s['tokens']:+.4f}")
    return (f"{device}: bf16 sampler vs fp32 trainer, mean |d| "
            f"{s['mismatch_abs_sum'] / s['tokens']:.4f}, max {s['mismatch_abs_max']:.4f}, "
            f"k3 {s['mismatch_k3_sum'] / s['tokens']:.2e}; loss per token: " + ", ".join(found))


@check("megatron")
def check_megatron(args, store_port, gens, model_dir: Path, work: Path):
    try:
        from gyre_slurm.train.megatron.worker import MegatronWorker
    except ImportError as exc:
        return "SKIP", f"megatron-core not importable ({exc}); carry its wheel (gpu_check.sh)"
    import torch

    from gyre_slurm.train import dist as gdist

    device = torch.device("cuda" if args.backend == "nccl" else "cpu")

    def world():
        return gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=args.backend)

    w = MegatronWorker(model_dir=model_dir, node_index=0, lr=1e-3, seed=0,
                       tensor_parallel=1, pipeline_parallel=1)
    t0 = time.perf_counter()
    w.join(world(), 0, src_rank=0, init_weights=work / "v0")
    build_s = time.perf_counter() - t0
    ids = micro_batch(5, n=1)[0]["token_ids"]
    ref = hf_logprobs(model_dir, work / "v0", ids, device)
    diff0 = max(abs(a - b) for a, b in zip(w.token_logprobs(ids), ref))
    t0 = time.perf_counter()
    for step in range(3):
        mbs = [micro_batch(100 + 10 * step + i) for i in range(2)]
        n = n_tokens(*mbs)
        for mb in mbs:
            w.train_microbatch(mb, num_step_tokens=n)
        res = w.optimizer_step(publish_dir=work / f"meg-v{step + 1}")
    step_s = (time.perf_counter() - t0) / 3
    probe = micro_batch(555)
    loss_before = w.eval_loss(probe, num_step_tokens=n_tokens(probe))
    t0 = time.perf_counter()
    w.save_checkpoint(work / "meg-ckpt")
    save_s = time.perf_counter() - t0
    w.leave()
    t0 = time.perf_counter()
    w.join(world(), 0, src_rank=0, checkpoint=work / "meg-ckpt")
    load_s = time.perf_counter() - t0
    loss_after = w.eval_loss(probe, num_step_tokens=n_tokens(probe))
    exported = hf_logprobs(model_dir, work / "meg-v3", ids, device)
    diff3 = max(abs(a - b) for a, b in zip(w.token_logprobs(ids), exported))
    w.leave()
    if res["version"] != 3 or diff0 > 1e-3 or diff3 > 1e-3 or \
            abs(loss_after - loss_before) > 1e-5 * max(1.0, abs(loss_before)):
        raise AssertionError(f"version {res['version']}, HF parity {diff0:.2e} / export "
                             f"{diff3:.2e}, loss {loss_before} -> {loss_after}")
    return (f"{device} TP1/PP1: build {build_s:.1f} s, {step_s:.2f} s/step, save {save_s:.1f} s, "
            f"load {load_s:.1f} s; HF parity {diff0:.1e}, export parity {diff3:.1e}, "
            f"loss across the checkpoint {loss_before:.6f} -> {loss_after:.6f}")


@check("megatron_bf16")
def check_megatron_bf16(args, store_port, gens, work: Path):
    """Megatron-core in bf16 with its distributed optimizer on the GPU (CUDA path, no CPU
    shim), a Qwen3-MoE model (8 experts, top-2): three steps in fp32 and in bf16 from
    the same weights (eval loss within 2%), a save/load round trip of the sharded
    optimizer state (the same eval loss), the export against the trainer, and the
    model state's GPU memory against the calculator (models/memory.py)."""
    try:
        from gyre_slurm.train.megatron.worker import MegatronWorker
    except ImportError as exc:
        return "SKIP", f"megatron-core not importable ({exc}); carry its wheel (gpu_check.sh)"
    import torch

    from gyre_slurm.models import tiny
    from gyre_slurm.models.memory import TrainLayout, _state_bytes, stage_params
    from gyre_slurm.models.shape import ModelShape
    from gyre_slurm.train import dist as gdist

    model_dir = tiny.make_model_dir(work / "moe", family="qwen3_moe", vocab_size=VOCAB,
                                    hidden_size=128, num_layers=2, num_heads=4,
                                    num_kv_heads=2, max_positions=512, num_experts=8,
                                    experts_per_token=2)
    tiny.save_weights(tiny.new_model(model_dir, seed=0), work / "moe-v0")

    def world():
        return gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=args.backend)

    probe, losses, figures = micro_batch(777), {}, {}
    for precision, distopt in (("fp32", False), ("bf16", True)):
        w = MegatronWorker(model_dir=model_dir, node_index=0, lr=1e-3, seed=0,
                           precision=precision, distributed_optimizer=distopt)
        if args.backend == "nccl":
            torch.cuda.reset_peak_memory_stats()
        w.join(world(), 0, src_rank=0, init_weights=work / "moe-v0")
        for step in range(3):
            mbs = [micro_batch(300 + 10 * step + i) for i in range(2)]
            for mb in mbs:
                w.train_microbatch(mb, num_step_tokens=n_tokens(*mbs))
            w.optimizer_step(publish_dir=work / f"moe-{precision}-v{step + 1}")
        losses[precision] = w.eval_loss(probe, num_step_tokens=n_tokens(probe))
        mem = w.memory_bytes()
        figures[precision] = mem
        if precision == "bf16":
            w.save_checkpoint(work / "moe-ckpt")
            w.leave()
            w.join(world(), 0, src_rank=0, checkpoint=work / "moe-ckpt")
            again = w.eval_loss(probe, num_step_tokens=n_tokens(probe))
            ids = probe[0]["token_ids"]
            device = torch.device("cuda" if args.backend == "nccl" else "cpu")
            exported = hf_logprobs(model_dir, work / "moe-bf16-v3", ids, device)
            export_diff = max(abs(a - b) for a, b in zip(w.token_logprobs(ids), exported))
            peak = torch.cuda.max_memory_allocated() if args.backend == "nccl" else 0
        w.leave()
    shape = ModelShape.from_model_dir(model_dir)
    lay = TrainLayout(world_size=1, precision="bf16", distributed_optimizer=True)
    want = _state_bytes(stage_params(shape, lay, first=True, last=True), lay)
    got = figures["bf16"]
    rel = abs(losses["bf16"] - losses["fp32"]) / abs(losses["fp32"])
    if rel > 0.02 or abs(again - losses["bf16"]) > 1e-6 * abs(losses["bf16"]) \
            or export_diff > 0.05 or any(abs(got[k] - want[k]) > 0.01 * want[k] for k in want):
        raise AssertionError(f"loss fp32 {losses['fp32']} bf16 {losses['bf16']} (rel {rel:.2e}),"
                             f" after the checkpoint {again}; export {export_diff:.2e}; state "
                             f"bytes {got} vs calculator {want}")
    return (f"qwen3_moe bf16 + distributed optimizer: eval loss {losses['bf16']:.5f} vs fp32 "
            f"{losses['fp32']:.5f} (rel {rel:.1e}), same after the checkpoint; export "
            f"parity {export_diff:.1e}; state {sum(got[k] for k in want) / 2**20:.2f} MiB, "
            f"calculator {sum(want.values()) / 2**20:.2f} MiB; peak allocated "
            f"{peak / 2**20:.0f} MiB")


def _kernel_parity(device, *, dtype, runs: int, base: int, heads=4, kv_heads=2, dim=32):
    """Flex vs SDPA run by run on the same tree batch: max |diff| of the output and of
    the q/k/v gradients, and the median seconds of forward + backward of each."""
    import torch

    from gyre_slurm.train.tree import to_inputs, tree_attention
    from gyre_slurm.traj.treepack import pack_trees

    tree = to_inputs(pack_trees(branchy_batch(3, runs=runs, base=base)), device)
    n = tree.num_tokens
    gen = torch.Generator(device="cpu").manual_seed(0)
    qkv = [torch.randn(1, h, n, dim, generator=gen).to(device, dtype).requires_grad_()
           for h in (heads, kv_heads, kv_heads)]
    out, grads, times = {}, {}, {}
    for kernel in ("flex", "paths"):
        runs_s = []
        for _ in range(4):
            for x in qkv:
                x.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = tree_attention(*qkv, tree, kernel=kernel)
            y.float().square().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            runs_s.append(time.perf_counter() - t0)
        out[kernel], grads[kernel] = y.detach(), [x.grad.clone() for x in qkv]
        times[kernel] = statistics.median(runs_s[1:])  # the first compiles
    diff = max([float((out["flex"] - out["paths"]).abs().max())]
               + [float((a - b).abs().max()) for a, b in zip(grads["flex"], grads["paths"])])
    return n, diff, times


@check("tree")
def check_tree(args, store_port, gens, model_dir: Path, work: Path):
    import torch

    from gyre_slurm.train import dist as gdist
    from gyre_slurm.train.worker import TrainerWorker
    from gyre_slurm.traj.treepack import tree_tokens

    kernels = "FlexAttention: CUDA only (no backward on CPU)"
    if args.backend == "nccl":
        device = torch.device("cuda")
        n_small, diff, _ = _kernel_parity(device, dtype=torch.float32, runs=4, base=40)
        if diff > 1e-4:
            raise AssertionError(f"flex vs sdpa differ by {diff:.2e} ({n_small} tokens)")
        n_big, diff_big, t = _kernel_parity(device, dtype=torch.bfloat16, runs=8, base=1500)
        kernels = (f"flex vs sdpa (fp32, {n_small} tokens) max |diff| {diff:.1e} incl. "
                   f"gradients; bf16 {n_big} tokens fwd+bwd: flex {t['flex'] * 1e3:.1f} ms, "
                   f"sdpa path by path {t['paths'] * 1e3:.1f} ms (diff {diff_big:.1e})")
    mb = branchy_batch(11)
    n = n_tokens(mb)
    w = TrainerWorker(model_dir=model_dir, node_index=0, lr=1e-3, seed=0)
    w.join(gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=args.backend), 0,
           src_rank=0, init_weights=work / "v0")
    grads = {}
    for packing in ("tree", "rows"):
        stats = w.train_microbatch(mb, num_step_tokens=n, packing=packing)
        grads[packing] = w._grads.clone()
        w._grads.zero_()
    w.leave()
    gdiff = float((grads["tree"] - grads["rows"]).abs().max() / grads["rows"].abs().max())
    if gdiff > 1e-4 or stats["tokens"] != n:
        raise AssertionError(f"torch trainer: tree vs rows gradient differs by {gdiff:.2e}")
    meg = "megatron not importable"
    try:
        from gyre_slurm.train.megatron.worker import MegatronWorker
    except ImportError:
        MegatronWorker = None
    if MegatronWorker is not None:
        m = MegatronWorker(model_dir=model_dir, node_index=0, lr=1e-3, seed=0)
        m.join(gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=args.backend),
               0, src_rank=0, init_weights=work / "v0")
        lt, lr = (m.eval_loss(mb, num_step_tokens=n, packing=p) for p in ("tree", "rows"))
        m.train_microbatch(mb, num_step_tokens=n, packing="tree")
        m.leave()
        if abs(lt - lr) > 1e-4 * max(1.0, abs(lr)):
            raise AssertionError(f"megatron: tree loss {lt} vs rows {lr}")
        meg = f"megatron tree loss {lt:.6f} = rows {lr:.6f}"
    return (f"{kernels}; torch trainer ({w.device}) tree vs rows gradient rel diff "
            f"{gdiff:.1e} ({tree_tokens(mb)} vs {sum(len(t['token_ids']) for t in mb)} tokens "
            f"computed); {meg}")


def _wsync_checks():
    import gpu_check_wsync as w

    return check("wsync")(w.check_wsync), check("vllm-sleep")(w.check_vllm_sleep)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--allow-cpu", action="store_true",
                   help="without a GPU, run the same checks on CPU with gloo")
    p.add_argument("--rebuilds", type=int, default=20)
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["torch", "bf16", "losses", "megatron", "megatron_bf16", "nccl",
                            "tree", "wsync", "vllm-sleep"])
    p.add_argument("--vllm-python", help="an interpreter with vLLM (its GPU build on a GPU) "
                   "for the vllm-sleep check")
    p.add_argument("--json", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    import torch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        check_device(args)
        print("no CUDA device: run on a GPU machine, or with --allow-cpu to try the checks "
              "on CPU", file=sys.stderr)
        return 1
    args.backend = "nccl" if on_gpu else "gloo"
    from gyre_slurm.models import tiny
    from gyre_slurm.train import dist as gdist

    check_device(args)
    store, port = gdist.host_store("127.0.0.1")
    gens = itertools.count(1)
    with tempfile.TemporaryDirectory(prefix="gyre-gpu-check-") as tmp:
        work = Path(tmp)
        model_dir = tiny.make_model_dir(work / "model", vocab_size=VOCAB, hidden_size=128,
                                        num_layers=2, num_heads=4, num_kv_heads=2,
                                        max_positions=512)
        tiny.save_weights(tiny.new_model(model_dir, seed=0), work / "v0")
        if "nccl" not in args.skip:
            check_nccl(args, port, gens)
        if "torch" not in args.skip:
            check_torch(args, port, gens, model_dir, work)
        if "bf16" not in args.skip:
            check_bf16(args, model_dir, work)
        if "losses" not in args.skip:
            check_losses(args, port, gens, model_dir, work)
        if "megatron" not in args.skip:
            check_megatron(args, port, gens, model_dir, work)
        if "megatron_bf16" not in args.skip:
            check_megatron_bf16(args, port, gens, work)
        if "tree" not in args.skip:
            check_tree(args, port, gens, model_dir, work)
        check_wsync, check_vllm_sleep = _wsync_checks()
        if "wsync" not in args.skip:
            check_wsync(args, store, port, gens, model_dir, work, micro_batch)
        if "vllm-sleep" not in args.skip:
            check_vllm_sleep(args, store, port, gens, model_dir, work, micro_batch)
    del store
    width = max(len(r[0]) for r in ROWS)
    print("\n| check | result | figures |\n|---|---|---|")
    for name, status, detail in ROWS:
        print(f"| {name:<{width}} | {status} | {detail} |")
    if args.json:
        args.json.write_text(json.dumps([dict(zip(("check", "result", "figures"), r))
                                         for r in ROWS], indent=1))
    return 1 if any(r[1] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)

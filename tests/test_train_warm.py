"""A training rank pays its first build's one-time costs when it starts (`warm`), not
at its first join: the warm-up holds no memory and changes nothing the join builds."""

import logging

import torch

from gyre_slurm.models.tiny import make_model_dir
from gyre_slurm.train import rankproc
from gyre_slurm.train.dist import WorldSpec, host_store
from gyre_slurm.train.worker import TrainerWorker

HOST = "127.0.0.1"


def test_warm_holds_no_model_and_the_first_join_builds_the_same_weights(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", vocab_size=300, hidden_size=16,
                               num_layers=1, num_heads=2, max_positions=64)
    store, port = host_store(HOST)
    weights = []
    for gen, warm in ((1, True), (2, False)):
        worker = TrainerWorker(model_dir=model_dir, node_index=0, seed=3)
        if warm:
            assert worker.warm() > 0
            assert worker.model is None and worker.optimizer is None and not worker._params
        times = worker.join(WorldSpec(gen, 1, HOST, port), 0, src_rank=0)
        assert times["build_s"] > 0  # the join still builds (the warm-up kept nothing)
        weights.append({k: v.clone() for k, v in worker.model.state_dict().items()})
        assert all(p.device.type == "cpu" for p in worker.model.parameters())
        worker.leave()
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    del store


def test_warm_up_skips_a_worker_without_it_and_survives_one_that_fails(caplog):
    class Plain:
        pass

    class Broken:
        def warm(self):
            raise OSError("no model dir")

    rankproc.warm_up(Plain())
    with caplog.at_level(logging.INFO, logger=rankproc.__name__):
        rankproc.warm_up(Broken())
    assert "warm-up failed: the first join builds from cold" in caplog.text
    assert "no model dir" in caplog.text


def test_a_step_with_no_token_to_train_leaves_the_weights_and_the_optimizer_alone(tmp_path):
    """A step that trained nothing (no run ended ok): `optimizer_step(num_step_tokens=0)`
    advances the version and changes nothing else. AdamW on its zero gradients moved
    every weight, by the momentum of the step before and by weight decay (0.01)."""
    from batch_helpers import micro_batch, n_tokens

    model_dir = make_model_dir(tmp_path / "model", vocab_size=300, hidden_size=16,
                               num_layers=1, num_heads=2, max_positions=64)
    store, port = host_store(HOST)
    worker = TrainerWorker(model_dir=model_dir, node_index=0, lr=1e-2, seed=3)
    worker.join(WorldSpec(1, 1, HOST, port), 0, src_rank=0)
    try:
        mb = micro_batch(1, 4, 300)
        worker.train_microbatch(mb, num_step_tokens=n_tokens(mb))
        first = worker.optimizer_step()
        assert not first["skipped"] and not first["empty"] and first["grad_norm"] > 0
        params = {k: v.clone() for k, v in worker.model.state_dict().items()}
        moments = [t.clone() for t in worker._optimizer_tensors()[0]]
        empty = worker.optimizer_step(num_step_tokens=0, publish_dir=tmp_path / "v2")
        assert empty["skipped"] and empty["empty"] and empty["grad_norm"] is None
        assert empty["version"] == first["version"] + 1 == 2
        now = worker.model.state_dict()
        assert all(torch.equal(params[k], now[k]) for k in params)
        assert all(torch.equal(a, b) for a, b in zip(moments, worker._optimizer_tensors()[0]))
        assert [float(s) for s in worker._optimizer_tensors()[1]] == [1.0] * (len(moments) // 2)
        assert (tmp_path / "v2" / "model.safetensors").exists()  # the version is published
    finally:
        worker.leave()
        del store

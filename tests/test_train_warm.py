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

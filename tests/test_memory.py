"""The memory calculator (gyre_slurm.models.memory): pure arithmetic, checked against the
parameter counts of the model's shape and the byte counts the issue's rationale states
(fp32 Adam without a sharded optimizer: 16 bytes per parameter on every replica). The
measured CPU check is tools/bench_memory.py (docs/models.md)."""

import pytest

from gyre_slurm.models.memory import (TrainLayout, kv_bytes_per_token, rollout_gpu_bytes,
                                      stage_params, train_rank_bytes)
from gyre_slurm.models.shape import ModelShape
from test_models import QWEN3_MOE_30B

MOE = ModelShape.from_config(QWEN3_MOE_30B)
DENSE = ModelShape.from_config({**QWEN3_MOE_30B, "architectures": ["Qwen3ForCausalLM"],
                                "model_type": "qwen3"})


@pytest.mark.parametrize("shape", [MOE, DENSE])
def test_one_rank_holds_the_whole_model(shape):
    n = stage_params(shape, TrainLayout(world_size=1), first=True, last=True)
    padding = 2 * (shape.padded_vocab_size - shape.vocab_size) * shape.hidden_size
    assert n["dense"] + n["expert"] == shape.num_params()["total"] + padding
    assert n["expert"] == shape.num_params()["expert"]


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (2, 2, 4), (1, 1, 8), (4, 2, 16)])
def test_shards_add_up_to_the_model(tp, pp, ep):
    """The ranks of one replica (TP x PP, experts over EP x PP) hold every parameter
    once, the norms, q/k norms and router once per TP rank."""
    lay = TrainLayout(world_size=max(tp, ep) * pp, tp=tp, pp=pp, ep=ep)
    dense = expert = 0
    for stage in range(pp):
        n = stage_params(MOE, lay, first=stage == 0, last=stage == pp - 1)
        dense, expert = dense + tp * n["dense"], expert + ep * n["expert"]
    h, d = MOE.hidden_size, MOE.head_dim
    replicated = MOE.num_layers * (2 * h + 2 * d + MOE.num_experts * h) + h
    padding = 2 * (MOE.padded_vocab_size - MOE.vocab_size) * h
    assert expert == MOE.num_params()["expert"]
    assert dense - (tp - 1) * replicated == MOE.num_params()["dense"] + padding


def test_fp32_adam_is_16_bytes_per_parameter_on_every_replica():
    lay = TrainLayout(world_size=8, precision="fp32", distributed_optimizer=False)
    b = train_rank_bytes(DENSE, lay)
    assert b["weights"] + b["grads"] + b["optimizer"] == 16 * b["params"]


def test_bf16_and_the_distributed_optimizer_shard_the_state():
    """bf16 weights (2), fp32 grads (4), and 12 bytes of fp32 master weights and moments
    split over the data-parallel ranks; experts over the expert-data-parallel ones."""
    lay = TrainLayout(world_size=8, tp=2, ep=4)  # DP 4, expert DP 2
    b = train_rank_bytes(MOE, lay)
    n = stage_params(MOE, lay, first=True, last=True)
    assert b["weights"] == 2 * b["params"] and b["grads"] == 4 * b["params"]
    assert b["optimizer"] == 12 * (-(-n["dense"] // 4) + -(-n["expert"] // 2))
    plain = train_rank_bytes(MOE, TrainLayout(world_size=8, tp=2, ep=4,
                                              distributed_optimizer=False))
    assert plain["optimizer"] == 12 * b["params"] > 2 * b["optimizer"]  # experts: expert DP 2
    # Qwen3-30B-A3B on 8 ranks with TP2 x EP4: a quarter of its 29B of experts and half
    # of its dense 1.3B per rank, ~100 GiB with its gradients and optimizer share
    assert 7.5e9 < b["params"] < 8.5e9 and 90 < b["total"] / 2**30 < 110, b


def test_a_layout_the_model_cannot_take_is_refused():
    with pytest.raises(ValueError, match="num_experts 128 % EP 3"):
        train_rank_bytes(MOE, TrainLayout(world_size=6, ep=3))
    with pytest.raises(ValueError, match="multiple of both"):
        train_rank_bytes(MOE, TrainLayout(world_size=6, tp=2, ep=4))


def test_rollout_weights_and_kv_cache():
    # 48 layers x 4 KV heads x 128 x K and V x 2 bytes = 96 KiB a token on one GPU
    assert kv_bytes_per_token(MOE, 1) == 2 * 48 * 4 * 128 * 2
    assert kv_bytes_per_token(MOE, 8) == 2 * 48 * 1 * 128 * 2  # KV heads replicated past 4
    r = rollout_gpu_bytes(MOE, tp=2, gpu_bytes=80 * 2**30)
    assert r["weights"] == MOE.num_params()["total"]  # bf16 over 2 GPUs: 2 bytes / 2
    assert r["kv_tokens"] == (int(80 * 2**30 * 0.9) - r["weights"]) // r["kv_per_token"]


def test_gyre_memory_prints_each_layout_the_world_allows(gyre, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE_30B))
    out = gyre("memory", str(tmp_path), "--world", "16", "--tp", "2").stdout
    assert "qwen3_moe: 30.53B parameters (28.99B in experts)" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("TP2 PP1")]
    assert [r[2] for r in rows] == ["EP1", "EP2", "EP4", "EP8", "EP16"]
    b = train_rank_bytes(MOE, TrainLayout(world_size=16, tp=2, ep=8))
    ep8 = next(r for r in rows if r[2] == "EP8")
    assert float(ep8[-2]) == round(b["total"] / 2**30, 2)  # the busiest rank, GiB
    assert float(ep8[-1]) == round(8 * b["total"] / 2**30, 1)  # a node of 8
    assert "KV cache 48.0 KiB a token" in out
    bad = gyre("memory", str(tmp_path), "--world", "6", "--tp", "2", "--ep", "4", check=False)
    assert bad.returncode == 2 and "multiple of both" in bad.stderr
    missing = gyre("memory", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 2 and "no config.json" in missing.stderr
    (tmp_path / "notes.txt").write_text("not json\n")
    not_json = gyre("memory", str(tmp_path / "notes.txt"), check=False)
    assert not_json.returncode == 2 and "not a model's config.json" in not_json.stderr
    for flags, message in ((["--gpu-gib", "nan"], "--gpu-gib must be"),
                           (["--gpu-gib", "-1"], "--gpu-gib must be"),
                           (["--ep", "0"], "--ep must be >= 1"),
                           (["--rollout-tp", "0"], "--rollout-tp must be >= 1")):
        proc = gyre("memory", str(tmp_path), *flags, check=False)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
    split = gyre("memory", str(tmp_path), "--world", "9", "--tp", "3", "--ep", "1", check=False)
    assert split.returncode == 2 and "cannot split" in split.stderr
    assert split.stdout == ""  # refused before any table is printed

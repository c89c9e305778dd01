"""Streamed weight sync, the core (gyre_slurm.train.wsync): the plan (pure), and rounds
between real processes over real gloo groups (tests/wsync_procs.py): every tensor arrives
exact when buckets cut across TP/PP shards; a receiver that dies mid-round does not stop
the others; one that hangs fails the round loudly; a stale generation is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre_slurm.models import tiny
from gyre_slurm.train.dist import (StaleGeneration, TransferSpec, announce_transfer_generation,
                                   host_store, join_transfer_group)
from gyre_slurm.train.wsync import plan as planlib
from gyre_slurm.train.wsync.endpoint import Endpoint

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
MB = 1 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (model_dir, meta state)}: 4 layers, 4 heads of 32, 2 KV heads (GQA)."""
    root = tmp_path_factory.mktemp("wsync-models")
    out = {}
    for family in ("llama", "qwen2"):
        d = tiny.make_model_dir(root / family, family=family, hidden_size=128, num_layers=4,
                                num_heads=4, num_kv_heads=2, max_positions=512)
        out[family] = (d, planlib.hf_meta_state(d))
    return out


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    """reference(family): a safetensors file of the state dict of the tiny model made
    with seed 7, which the processes' senders hold and their receivers compare with."""
    from safetensors.torch import save_file

    root, made = tmp_path_factory.mktemp("wsync-reference"), {}

    def get(family: str) -> Path:
        if family not in made:
            state = tiny.new_model(models[family][0], seed=7).state_dict()
            made[family] = root / f"{family}.safetensors"
            save_file({k: v.detach().clone().contiguous() for k, v in state.items()},
                      str(made[family]))
        return made[family]
    return get


def _covered(plan: planlib.Plan) -> dict[str, torch.Tensor]:
    """How many pieces cover each element of each tensor."""
    count = {name: torch.zeros(shape, dtype=torch.int8) for name, shape in plan.params}
    for p in plan.pieces:
        t = count[plan.params[p.param][0]]
        (t if p.dim is None else t.narrow(p.dim, p.offset, p.length)).add_(1)
    return count


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind,world,tp,pp,bucket", [
    ("replicated", 1, 1, 1, 64 * MB), ("replicated", 3, 1, 1, 40_000),
    ("megatron", 2, 2, 1, 100_000), ("megatron", 4, 1, 2, 1), ("megatron", 8, 2, 2, 300_000)])
def test_plan_tiles_every_tensor_once_from_a_rank_that_holds_it(models, family, kind, world,
                                                                tp, pp, bucket):
    model_dir, hf = models[family]
    layout = planlib.TrainerLayout(kind, world, tp=tp, pp=pp)
    plan = planlib.build_plan(model_dir, layout, bucket_bytes=bucket, hf=hf)
    assert [n for n, _ in plan.params] == list(hf)  # the Hugging Face order
    assert all(bool((c == 1).all()) for c in _covered(plan).values())
    held = {(t, p): planlib.shard_pieces(hf, model_dir, layout, t, p)
            for t, p in layout.coords()}
    for b in range(len(plan.buckets)):
        pieces = plan.bucket_pieces(b)
        size = sum(plan.param_bytes(i) for i in {p.param for p in pieces})
        assert size <= bucket or len({p.param for p in pieces}) == 1
        for p in pieces:
            name = plan.params[p.param][0]
            assert name in held[(p.tp, p.pp)]  # the sender's coordinate holds it
            rank = p.sender
            assert layout.rank(tp=p.tp, pp=p.pp, dp=b % layout.dp) == rank
    assert [p.tag for p in plan.pieces] == list(range(len(plan.pieces)))
    assert plan.model_bytes == sum(t.numel() * 4 for t in hf.values())


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2), (1, 2)])
def test_lazy_qkv_pieces_are_the_eager_ones_and_nothing_is_copied_before_a_bucket(
        models, tp, pp):
    """A trainer's pieces are views of its shard; q/k/v (strided in the fused tensor) are
    made when their bucket is sent, so a rank never holds every layer's copy at once."""
    from gyre_slurm.train.megatron import convert

    model_dir, _ = models["qwen2"]
    hf = tiny.new_model(model_dir, seed=1).state_dict()
    shape = convert.ModelShape.from_model_dir(model_dir)
    for t in range(tp):
        for p in range(pp):
            shard = convert.hf_to_megatron_shard(hf, shape, tp_rank=t, tp_size=tp,
                                                 pp_rank=p, pp_size=pp)
            eager = convert.megatron_shard_to_hf_pieces(shard, shape, tp_size=tp, pp_rank=p,
                                                        pp_size=pp)
            lazy = convert.megatron_shard_to_hf_pieces(shard, shape, tp_size=tp, pp_rank=p,
                                                       pp_size=pp, lazy=True)
            assert lazy.keys() == eager.keys()
            storages = {v.untyped_storage().data_ptr() for v in shard.values()}
            for name, (piece, dim) in lazy.items():
                assert dim == eager[name][1]
                if callable(piece):
                    assert "_proj." in name and name.split(".")[-2][0] in "qkv"
                    piece = piece()
                else:  # a view of the shard: no copy
                    assert piece.untyped_storage().data_ptr() in storages, name
                assert torch.equal(piece, eager[name][0]), name


def test_plan_round_trips_as_json_and_refuses_tampering(models):
    model_dir, hf = models["qwen2"]
    plan = planlib.build_plan(model_dir, planlib.TrainerLayout("megatron", 4, tp=2, pp=2),
                              bucket_bytes=200_000, hf=hf)
    data = json.loads(json.dumps(plan.to_json()))
    assert planlib.from_json(data) == plan
    data["pieces"][3][4] += 1  # one offset moved
    with pytest.raises(ValueError, match="fingerprint"):
        planlib.from_json(data)
    with pytest.raises(ValueError, match="not a transfer plan"):
        planlib.from_json({"format": 1})
    with pytest.raises(ValueError, match="cannot hold"):
        planlib.TrainerLayout("megatron", 3, tp=2)


# ---- rounds between processes --------------------------------------------------------

class Group:
    """A transfer generation of processes: senders (training ranks) then receivers."""

    def __init__(self, tmp: Path, model_dir: Path, weights: Path, plan: planlib.Plan, *,
                 receivers: int, timeout_s: float = 30.0, generation: int = 1):
        self.tmp, self.model_dir, self.weights, self.plan = tmp, model_dir, weights, plan
        self.store, port = host_store(HOST)
        announce_transfer_generation(self.store, generation)
        self.generation = generation
        self.senders = plan.layout.world_size
        self.size = self.senders + receivers
        self.transfer = {"generation": generation, "world_size": self.size,
                         "store_host": HOST, "store_port": port, "backend": "gloo",
                         "timeout_s": timeout_s}
        self.procs: list[subprocess.Popen] = []

    def start(self, rank: int, role: str, **extra) -> subprocess.Popen:
        args = {"role": role, "model_dir": str(self.model_dir),
                "weights": str(self.weights), "rank": rank,
                "plan": self.plan.to_json(), "transfer": self.transfer, **extra}
        path = self.tmp / f"args-{rank}.json"
        path.write_text(json.dumps(args))
        proc = subprocess.Popen([sys.executable, str(HERE / "wsync_procs.py"), str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def run(self, *, rounds: int = 1, faults: dict | None = None, targets=None):
        receivers = list(range(self.senders, self.size))
        targets = receivers if targets is None else targets
        for r in receivers:
            self.start(r, "recv", rounds=rounds, generation=self.generation,
                       fault=(faults or {}).get(r))
        for r in range(self.senders):
            self.start(r, "send", rounds=[{"generation": self.generation,
                                           "targets": targets}] * rounds)
        return self

    def results(self, timeout_s: float = 120.0) -> dict[int, dict]:
        out = {}
        for rank, proc in enumerate(self.procs):
            try:
                stdout, stderr = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                continue
            if proc.returncode == 0:
                res = json.loads(stdout.strip().splitlines()[-1])
                out[res["rank"]] = res
            else:
                out.setdefault(-1 - rank, {"code": proc.returncode, "stderr": stderr[-2000:]})
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("kind,world,tp,pp", [("megatron", 4, 2, 2), ("replicated", 2, 1, 1)])
def test_buckets_cut_across_tp_and_pp_shards_and_every_tensor_arrives_exact(
        models, reference, tmp_path, kind, world, tp, pp):
    model_dir, hf = models["qwen2"]
    layout = planlib.TrainerLayout(kind, world, tp=tp, pp=pp)
    # a few tensors per bucket: buckets end mid-layer, and one holds the end of stage 0
    # and the start of stage 1, both TP ranks' pieces of each
    plan = planlib.build_plan(model_dir, layout, bucket_bytes=200_000, hf=hf)
    if kind == "megatron":
        mixed = [b for b in range(len(plan.buckets))
                 if len({(p.tp, p.pp) for p in plan.bucket_pieces(b)}) == 4]
        assert mixed, "no bucket holds pieces of both TP ranks of both stages"
    else:  # the replicas take turns
        assert set(plan.senders()) == {0, 1}
    group = Group(tmp_path, model_dir, reference("qwen2"), plan, receivers=2).run(rounds=2)
    try:
        res = group.results()
    finally:
        group.close()
    assert set(res) == set(range(world + 2)), res
    for r in range(world, world + 2):
        for got in res[r]["rounds"]:
            assert "error" not in got, got
            assert got["max_diff"] == 0.0 and got["names"] == sorted(hf)
            assert got["buckets"] == len(plan.buckets)
    sent = [sum(x["bytes"] for x in res[r]["rounds"]) for r in range(world)]
    assert sum(sent) == 2 * 2 * plan.model_bytes  # each tensor once, to each receiver


@pytest.mark.slow
def test_a_receiver_lost_mid_round_does_not_stop_the_others(models, reference, tmp_path):
    model_dir, hf = models["llama"]
    plan = planlib.build_plan(model_dir, planlib.TrainerLayout("replicated", 1),
                              bucket_bytes=150_000, hf=hf)
    group = Group(tmp_path, model_dir, reference("llama"), plan, receivers=2)
    group.run(faults={2: {"at_bucket": 2, "how": "die"}})
    try:
        res = group.results()
    finally:
        group.close()
    sent = res[0]["rounds"][0]
    assert list(sent["failed_targets"]) == ["2"], sent
    got = res[1]["rounds"][0]
    assert got["max_diff"] == 0.0 and got["names"] == sorted(hf)


@pytest.mark.slow
def test_a_receiver_that_hangs_fails_the_round_loudly(models, reference, tmp_path):
    model_dir, hf = models["llama"]
    plan = planlib.build_plan(model_dir, planlib.TrainerLayout("replicated", 1),
                              bucket_bytes=150_000, hf=hf)
    group = Group(tmp_path, model_dir, reference("llama"), plan, receivers=2, timeout_s=3.0)
    group.run(faults={2: {"at_bucket": 1, "how": "stop"}})
    try:
        sender = group.procs[-1]
        stdout, _ = sender.communicate(timeout=60)
        sent = json.loads(stdout.strip().splitlines()[-1])["rounds"][0]
        healthy = group.procs[0]
        stdout, _ = healthy.communicate(timeout=60)
        got = json.loads(stdout.strip().splitlines()[-1])["rounds"][0]
    finally:
        group.close()
    assert sent == {"timed_out_target": 2}
    assert "error" in got  # its pieces stopped coming: half loaded, and it says so


def test_a_stale_transfer_generation_is_refused(models, tmp_path):
    model_dir, hf = models["llama"]
    store, port = host_store(HOST)
    plan = planlib.build_plan(model_dir, planlib.TrainerLayout("replicated", 1),
                              bucket_bytes=MB, hf=hf)
    info = {"world_size": 2, "store_host": HOST, "store_port": port, "timeout_s": 20,
            "plan": plan.to_json()}
    announce_transfer_generation(store, 2)
    with pytest.raises(StaleGeneration, match="generation 1 refused: the current one is 2"):
        join_transfer_group(TransferSpec(1, 2, HOST, port, timeout_s=5), 0, host=HOST)
    args = tmp_path / "hold.json"
    args.write_text(json.dumps({"role": "hold", "model_dir": str(model_dir),
                                "rank": 1, "plan": info.pop("plan"),
                                "transfer": {**info, "generation": 2}}))
    other = subprocess.Popen([sys.executable, str(HERE / "wsync_procs.py"), str(args)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ep = Endpoint()
    try:
        ep.join({**info, "plan": plan.to_json(), "generation": 2}, rank=0, host=HOST)
        assert json.loads(other.stdout.readline())["generation"] == 2
        with pytest.raises(StaleGeneration, match="generation 1 refused"):
            ep.check(1)
        with pytest.raises(StaleGeneration, match="in generation 2 already"):
            ep.join({**info, "plan": plan.to_json(), "generation": 1}, rank=0, host=HOST)
        assert ep.generation == 2  # a refused join leaves the member as it was
        ep.check(2)
    finally:
        ep.leave()
        other.communicate(timeout=30)
    with pytest.raises(StaleGeneration, match="in no transfer group"):
        ep.check(2)


@pytest.mark.parametrize("world,tp,pp,ep", [(4, 2, 1, 2), (4, 1, 1, 4), (8, 2, 2, 2),
                                            (8, 1, 1, 2)])
def test_plan_sends_each_expert_from_the_rank_that_holds_it(tmp_path, world, tp, pp, ep):
    """Qwen3-MoE with expert parallelism: every tensor once; an expert's tensors whole,
    from a rank whose EP rank holds that expert (Megatron's expert order, checked against
    Megatron's own ranks in test_train_megatron's expert-parallel test); dense ones as
    without EP. Each rank's held pieces (convert.py on its own shard) cover what the plan
    makes it send."""
    from gyre_slurm.train.megatron import convert

    model_dir = tiny.make_model_dir(tmp_path / "moe", family="qwen3_moe", vocab_size=300,
                                    hidden_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, num_experts=8, experts_per_token=2)
    hf = planlib.hf_meta_state(model_dir)
    layout = planlib.TrainerLayout("megatron", world, tp=tp, pp=pp, ep=ep)
    plan = planlib.build_plan(model_dir, layout, bucket_bytes=50_000, hf=hf)
    assert all(bool((c == 1).all()) for c in _covered(plan).values())
    shape = convert.ModelShape.from_model_dir(model_dir)
    for rank in range(world):
        coords = {"tp": rank % tp, "pp": rank // (world // pp),
                  "ep": rank % ep}  # Megatron: tp-cp-dp-pp dense, tp-cp-ep-dp-pp experts
        held = planlib.shard_pieces(hf, model_dir, layout, coords["tp"], coords["pp"],
                                    coords["ep"])
        mine = [p for p in plan.pieces if p.sender == rank]
        for p in mine:
            name = plan.params[p.param][0]
            assert name in held, (rank, name)
            if ".experts." in name:
                e = int(name.split(".experts.")[1].split(".")[0])
                assert e in convert.rank_experts(shape, coords["ep"], ep)
                assert p.dim is None
    senders = {p.sender for p in plan.pieces if ".experts." in plan.params[p.param][0]}
    assert senders == set(range(world))  # expert replicas take turns, as dense ones do
    data = json.loads(json.dumps(plan.to_json()))
    assert planlib.from_json(data) == plan and data["layout"]["ep"] == ep

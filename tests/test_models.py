"""Model families without an engine: what `ModelShape` reads from (and refuses in) a
config.json, the tiny-model maker's checkpoints as transformers itself loads them, and
weights read from single-file and sharded safetensors directories."""

import json

import pytest
import torch

from gyre_slurm.models import tiny
from gyre_slurm.models.shape import ModelShape
from gyre_slurm.models.weights import HFWeights

QWEN3_MOE_30B = {  # the published Qwen3-30B-A3B config.json, the fields that matter
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "attention_bias": False}


def test_shape_of_a_real_qwen3_moe_config():
    s = ModelShape.from_config(QWEN3_MOE_30B)
    assert (s.family, s.num_experts, s.moe_top_k, s.moe_ffn_hidden_size, s.head_dim) == (
        "qwen3_moe", 128, 8, 768, 128)
    assert s.qk_norm and not s.qkv_bias and s.is_moe
    n = s.num_params()
    assert 30.0e9 < n["total"] < 31.0e9, n  # "30B total"
    active = n["dense"] + n["expert"] * s.moe_top_k // s.num_experts
    assert 3.0e9 < active < 3.5e9, active  # "A3B": 3.3B active
    s.check_layout(4, 2, 8)
    with pytest.raises(ValueError, match="num_experts 128 % EP 3"):
        s.check_layout(1, 1, 3)


def test_shape_of_a_tied_model_counts_its_embedding_once():
    """Qwen3-0.6B's published config (tie_word_embeddings): "0.6B parameters, 0.44B
    non-embedding"; its checkpoint has no lm_head.weight."""
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
              "max_position_embeddings": 40960, "tie_word_embeddings": True}
    s = ModelShape.from_config(config)
    assert s.tied_embeddings
    n = s.num_params()
    assert 0.59e9 < n["total"] < 0.61e9, n
    assert 0.43e9 < n["total"] - n["embedding"] < 0.45e9, n
    assert "lm_head.weight" not in s.hf_tensor_shapes()
    untied = ModelShape.from_config({**config, "tie_word_embeddings": False})
    assert untied.num_params()["total"] - n["total"] == 151936 * 1024
    assert "lm_head.weight" in untied.hf_tensor_shapes()


@pytest.mark.parametrize("change,key", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"mlp_only_layers": [0, 1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "supports"),
])
def test_shape_refuses_what_it_cannot_train_faithfully(change, key):
    with pytest.raises(ValueError, match=key):
        ModelShape.from_config({**QWEN3_MOE_30B, **change}, source="x/config.json")


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"hidden_size": "2048"}, "hidden_size = '2048' must be a whole number"),
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0 must be a whole number in 1.."),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers = 1.5"),
    ({"vocab_size": True}, "vocab_size = True"),
    ({"vocab_size": 1e308}, "vocab_size = 1e[+]308"),
    ({"num_attention_heads": []}, "num_attention_heads = \\[\\]"),
    ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads 5"),
    ({"rope_theta": float("nan")}, "rope_theta = nan must be a number"),
    ({"rms_norm_eps": -1}, "rms_norm_eps = -1"),
    ({"max_position_embeddings": {}}, "max_position_embeddings = {}"),
    ({"num_experts": 2**63}, "num_experts = 9223372036854775808"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok = 0"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size is missing"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob = 'yes' must be true or false"),
    ({"architectures": "Qwen3MoeForCausalLM"}, "must be a list of names"),
    ({"model_type": ["llama"], "architectures": []}, "supports"),
    ({"rope_scaling": "yarn"}, "rope_scaling = 'yarn': must be an object"),
])
def test_shape_names_the_key_of_a_malformed_config(change, message):
    """A hand-edited or garbled config.json is a ValueError naming the key and the value
    (it was a KeyError, TypeError, OverflowError or ZeroDivisionError from deep inside)."""
    with pytest.raises(ValueError, match=message):
        ModelShape.from_config({**QWEN3_MOE_30B, **change}, source="x/config.json")
    with pytest.raises(ValueError, match="a model config is a JSON object, not list"):
        ModelShape.from_config([QWEN3_MOE_30B], source="x/config.json")


def test_shape_without_config_says_what_a_model_dir_holds(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelShape.from_model_dir(tmp_path)
    with pytest.raises(ValueError, match="neither a model directory nor a config.json"):
        ModelShape.from_model_dir("/dev/zero")
    (tmp_path / "config.json").symlink_to("/dev/zero")  # read no further than 64 MB
    with pytest.raises(ValueError, match="holds more than 64 MB"):
        ModelShape.from_model_dir(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_bytes(b"\xff{}")
    with pytest.raises(ValueError, match="not UTF-8"):
        ModelShape.from_model_dir(tmp_path)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_tiny_checkpoint_loads_in_transformers_as_the_model(family, tmp_path):
    """The maker's directory is a Hugging Face checkpoint: transformers' own
    from_pretrained gives the model's logits; load_weights into a fresh model too."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny.make_model_dir(tmp_path / family, family=family, vocab_size=300,
                                    num_heads=4, num_kv_heads=2)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [tiny.ARCHITECTURES[family]]
    model = tiny.new_model(model_dir, seed=3)
    tiny.save_weights_into(model, model_dir)
    ids = torch.tensor([[1, 5, 9, 20, 200, 7]])
    with torch.no_grad():
        want = model(ids).logits
        ref = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
        again = tiny.new_model(model_dir, seed=9)
        tiny.load_weights(again, model_dir)
        assert torch.equal(ref(ids).logits, want)
        assert torch.equal(again(ids).logits, want)
    shape = ModelShape.from_model_dir(model_dir)
    assert shape.family == family
    assert shape.num_params()["total"] == sum(p.numel() for p in model.parameters())
    names = set(tiny.checkpoint_state(model))
    if family == "qwen3_moe":  # per expert on disk, as published checkpoints are
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
        assert not any(n.endswith("experts.gate_up_proj") for n in names)


def test_weights_read_from_single_and_sharded_safetensors(tmp_path):
    from safetensors.torch import save_file

    state = {f"t{i}": torch.full((2, 3), float(i)) for i in range(5)}
    single = tmp_path / "single"
    single.mkdir()
    save_file(state, str(single / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weight_map = {}
    for shard, names in enumerate((["t0", "t1"], ["t2", "t3", "t4"])):
        fname = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in names}, str(sharded / fname))
        weight_map.update({n: fname for n in names})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    for d in (single, sharded):
        w = HFWeights(d)
        assert sorted(w) == sorted(state) and len(w) == 5
        assert all(torch.equal(w[n], state[n]) for n in state)
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            w["nope"]
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="lists shards that are not there"):
        HFWeights(sharded)
    with pytest.raises(ValueError, match="no model.safetensors"):
        HFWeights(tmp_path)


def test_a_hugging_face_dir_starts_a_run_by_links(tmp_path):
    """model.path: the run's model dir links the checkpoint's config and tokenizer, its
    version 0 the shards and their index, which every loader reads (verified whole)."""
    from gyre_slurm.models.weights import import_model_dir

    src = tiny.make_model_dir(tmp_path / "hf", family="qwen3_moe", num_experts=4)
    model = tiny.new_model(src, seed=3)
    tiny.save_weights_into(model, src, shards=3)
    assert len(list(src.glob("model-*-of-00003.safetensors"))) == 3
    got = import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0",
                           layout=(1, 1, 2))
    assert got == {"files": len([f for f in src.iterdir()
                                 if not f.name.startswith("model")]), "weights": 4}
    assert (tmp_path / "run" / "model" / "config.json").is_symlink()
    assert not list((tmp_path / "run" / "model").glob("*.safetensors"))
    again = tiny.new_model(tmp_path / "run" / "model", seed=0)
    tiny.load_weights(again, tmp_path / "run" / "w0")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    # A start stopped before its config.yaml leaves the links: the next start makes them
    # again (os.replace onto a folder that is not empty failed), the checkpoint untouched.
    (tmp_path / "run" / "model" / "stray").touch()
    import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0",
                     layout=(1, 1, 2))
    assert not (tmp_path / "run" / "model" / "stray").exists()
    assert (src / "config.json").is_file() and len(list(src.glob("model-*"))) == 3
    with pytest.raises(ValueError, match="num_experts 4 % EP 3"):
        import_model_dir(src, tmp_path / "x" / "model", tmp_path / "x" / "w0", layout=(1, 1, 3))
    (src / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "garbled"}}')
    with pytest.raises(ValueError, match="its tokenizer .* does not load"):
        import_model_dir(src, tmp_path / "z" / "model", tmp_path / "z" / "w0")
    assert not (tmp_path / "z").exists()
    (src / "tokenizer.json").unlink()
    (src / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer"):
        import_model_dir(src, tmp_path / "y" / "model", tmp_path / "y" / "w0")


def test_a_truncated_shard_is_named(tmp_path):
    src = tiny.make_model_dir(tmp_path / "hf", family="qwen3")
    tiny.save_weights_into(tiny.new_model(src, seed=0), src, shards=2)
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(tiny.CorruptWeights, match="00002-of-00002.safetensors.*truncated"):
        tiny.verify_weights(src)


@pytest.mark.parametrize("change,message", [
    ({"model.norm.weight": 5}, "weight_map must map each tensor name"),
    ({"model.norm.weight": "../outside.safetensors"}, "shards outside its directory"),
    ({"model.norm.weight": "/abs/model-00001-of-00002.safetensors"}, "outside its directory"),
    ({"model.norm.weight": "sub/model-00001-of-00002.safetensors"}, "outside its directory"),
    ({"model.layers.9.bogus": "model-00001-of-00002.safetensors"},
     "places 1 tensor.* in model-00001-of-00002.safetensors, which does not hold them"),
])
def test_an_index_that_names_shards_wrongly_is_refused_before_loading(tmp_path, change,
                                                                       message):
    """A safetensors index is outside input: a shard path leading out of the directory
    (read, or linked as a dangling file into a run), a shard that lacks what the index
    places there (a SafetensorError deep in a trainer), a non-string entry (a TypeError)
    are each a ValueError naming the index, at import and at load."""
    from gyre_slurm.models.weights import import_model_dir

    src = tiny.make_model_dir(tmp_path / "hf", family="qwen3")
    tiny.save_weights_into(tiny.new_model(src, seed=0), src, shards=2)
    index = src / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].update(change)
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=message):
        tiny.load_weights(tiny.new_model(src, seed=1), src)
    data["weight_map"] = [1, 2]
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="weight_map must map"):
        tiny.verify_weights(src)


def test_a_garbled_single_weights_file_is_a_value_error(tmp_path):
    from gyre_slurm.models.weights import import_model_dir, weight_files

    src = tiny.make_model_dir(tmp_path / "hf", family="llama")
    (src / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="model.safetensors: not a whole safetensors file"):
        weight_files(src)
    with pytest.raises(ValueError, match="model.safetensors"):
        import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0")


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_the_tensors_a_config_implies_are_what_the_conversion_reads(family, tmp_path):
    """ModelShape.hf_tensor_shapes (the import's check) and the Megatron conversion name
    the same tensors with the same shapes: a checkpoint that passes the check converts."""
    from gyre_slurm.train.megatron.convert import hf_to_megatron_shard

    src = tiny.make_model_dir(tmp_path / family, family=family, num_kv_heads=2,
                              num_experts=4, **({"head_dim": 32} if family == "qwen3" else {}))
    shape = ModelShape.from_model_dir(src)
    want = shape.hf_tensor_shapes()
    read = set()

    class Recording(dict):
        def __getitem__(self, name):
            read.add(name)
            return super().__getitem__(name)

    state = Recording({n: torch.zeros(s) for n, s in want.items()})
    hf_to_megatron_shard(state, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    assert read == set(want)
    tiny.save_weights_into(tiny.new_model(src, seed=0), src)
    tiny.check_weights_fit(shape, src)  # the family's real checkpoint fits


def test_a_checkpoint_of_another_model_is_refused_at_import(tmp_path):
    """config.json edited without its weights (or weights from another model): named at
    import, with the tensor and both shapes, before a trainer converts anything."""
    from safetensors.torch import load_file, save_file

    from gyre_slurm.models.weights import import_model_dir

    src = tiny.make_model_dir(tmp_path / "hf", family="qwen3")
    tiny.save_weights_into(tiny.new_model(src, seed=0), src)
    config = json.loads((src / "config.json").read_text())
    for change, message in (
            ({"hidden_size": 128, "head_dim": 32}, r"model.embed_tokens.weight is \[\d+, 64\], "
                                                   r"the config says \[\d+, 128\]"),
            ({"num_hidden_layers": 3}, r"tensor\(s\) missing, e.g. \['model.layers.2.")):
        (src / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match="not the model its config.json describes.*"
                                             + message):
            import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0",
                             layout=(1, 1, 1))
    (src / "config.json").write_text(json.dumps(config))
    state = load_file(str(src / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight is I32"):
        import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0",
                         layout=(1, 1, 1))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config,weights,message", [
    ({"hidden_size": 128}, None,
     r"model.embed_tokens.weight is \[512, 64\], the config says \[512, 128\]"),
    ({"vocab_size": 256}, None, r"lm_head.weight is \[512, 64\], the config says \[256, 64\]"),
    ({"num_key_value_heads": 2}, None, r"k_proj.weight is \[64, 64\], the config says \[32, 64\]"),
    ({"num_hidden_layers": 1}, None, r"18 tensor\(s\) the model does not have|9 tensor\(s\) "
                                     r"the model does not have, e.g. \['model.layers.1."),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, None,
     r"\(GPT2LMHeadModel, .*tensor\(s\) missing, e.g. \['transformer.wte.weight'"),
    ({"hidden_act": "no-such-activation"}, None,
     "config.json does not describe a model transformers can build .*no-such-activation"),
    ({"rope_scaling": {"rope_type": "no-such-rope", "factor": 2.0}}, None,
     "config.json does not describe a model transformers can build .*no-such-rope"),
    ({"model_type": "no-such-model", "architectures": []}, None,
     "config.json does not describe a model transformers can build .*no-such-model"),
    ({}, "drop lm_head", r"1 tensor\(s\) missing, e.g. \['lm_head.weight'\]"),
    ({}, "add a tensor", r"1 tensor\(s\) the model does not have, e.g. \['model.extra.weight'\]"),
    ({}, "int8 lm_head", "lm_head.weight is I8"),
])
def test_weights_the_torch_trainer_cannot_load_are_refused_at_import(tmp_path, config,
                                                                     weights, message):
    """model.path with the torch trainer (no Megatron layout to check against): the
    checkpoint must be exactly the model transformers builds from its config.json, each
    tensor of its shape and a floating dtype. Before, a config edited without its weights,
    weights of another model, an unknown activation or rope type each passed the import
    and failed every training rank's first load with a traceback (the job's exit 1)."""
    from safetensors.torch import load_file, save_file

    from gyre_slurm.models.weights import import_model_dir

    src = tiny.make_model_dir(tmp_path / "hf", family="llama", hidden_size=64, num_heads=4)
    tiny.save_weights_into(tiny.new_model(src, seed=0), src)
    import_model_dir(src, tmp_path / "ok" / "model", tmp_path / "ok" / "w0")  # as made: fits
    data = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**data, **config}))
    if weights:
        state = load_file(str(src / "model.safetensors"))
        if weights == "drop lm_head":
            del state["lm_head.weight"]
        elif weights == "add a tensor":
            state["model.extra.weight"] = torch.zeros(3)
        else:
            state["lm_head.weight"] = state["lm_head.weight"].to(torch.int8)
        save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tied_embeddings_are_one_tensor_in_checkpoints_loads_and_streams(family, tmp_path):
    """tie_word_embeddings (most small published models: the output layer is the input
    embedding): the checkpoint holds model.embed_tokens.weight and no lm_head.weight, as
    transformers writes it and vLLM reads it. It imports, loads with the two names one
    parameter, and every write of the policy (published weights, the stream's pieces)
    names it once; before, the import passed, the load failed on the missing
    lm_head.weight, and a tied model's first publish failed in safetensors (one tensor,
    two names). A checkpoint that also holds lm_head.weight imports if it is the
    embedding's copy and is refused if not (vLLM would serve it, untied)."""
    from safetensors.torch import load_file, save_file

    from gyre_slurm.models.weights import import_model_dir

    src = tiny.make_model_dir(tmp_path / "hf", family=family, hidden_size=64, num_heads=4)
    data = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**data, "tie_word_embeddings": True}))
    model = tiny.new_model(src, seed=0)
    assert tiny.tied_weights(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    tiny.save_weights_into(model, src)
    saved = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0")
    again = tiny.new_model(tmp_path / "run" / "model", seed=1)
    tiny.load_weights(again, tmp_path / "run" / "w0")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.lm_head.weight, model.model.embed_tokens.weight)
    assert "lm_head.weight" not in tiny.checkpoint_state(again)
    tiny.save_weights(again, tmp_path / "v1")  # a publish
    assert set(load_file(str(tmp_path / "v1" / "model.safetensors"))) == set(saved)
    # a checkpoint may also hold the tied copy (equal): it imports and loads as one
    saved["lm_head.weight"] = saved["model.embed_tokens.weight"].clone()
    save_file(saved, str(src / "model.safetensors"))
    import_model_dir(src, tmp_path / "run2" / "model", tmp_path / "run2" / "w0")
    third = tiny.new_model(src, seed=2)
    tiny.load_weights(third, src)
    assert torch.equal(third.lm_head.weight, model.model.embed_tokens.weight)
    # a copy of other values: vLLM would serve it untied while the trainer trains the
    # embedding, and no update would reach it
    saved["lm_head.weight"] = torch.zeros_like(saved["model.embed_tokens.weight"])
    save_file(saved, str(src / "model.safetensors"))
    for layout in (None, (1, 1, 1)):  # the torch trainer's check, and Megatron's
        with pytest.raises(ValueError, match="ties lm_head.weight to model.embed_tokens.weight"
                                             " \\(tie_word_embeddings\\) but the checkpoint"):
            import_model_dir(src, tmp_path / "run3" / "model", tmp_path / "run3" / "w0",
                             layout=layout)
        assert not (tmp_path / "run3").exists()


@pytest.mark.parametrize("template,message", [
    (None, "its tokenizer has no chat template, and the agents' model calls are chat "
           "completions"),
    ("{% for m in messages %}{{ m['content'] }", "its chat template does not render a "
                                                 "user's message .*TemplateSyntaxError"),
    ("{{ raise_exception('this template takes no user turns') }}",
     "does not render a user's message .*this template takes no user turns"),
])
def test_a_chat_template_that_cannot_render_is_refused_where_agents_chat(tmp_path, template,
                                                                          message):
    """Every agent but a `command` scaffold calls /chat/completions, which the gateway
    renders with the model's chat template: a base model (none) or a template that
    fails refused every call of every run (400) until the job stopped for steps that
    trained nothing. Refused at import for chat; a completions-only import takes it."""
    from gyre_slurm.models.weights import import_model_dir

    src = tiny.make_model_dir(tmp_path / "hf", family="llama")
    tiny.save_weights_into(tiny.new_model(src, seed=0), src)
    import_model_dir(src, tmp_path / "ok" / "model", tmp_path / "ok" / "w0", chat=True)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0", chat=True)
    assert not (tmp_path / "run").exists()
    import_model_dir(src, tmp_path / "raw" / "model", tmp_path / "raw" / "w0")


def test_a_server_length_beyond_the_models_positions_is_refused_at_import(tmp_path):
    """rollout.max_model_len (vLLM's --max-model-len) past config.json's
    max_position_embeddings: vLLM refused to start on every cell, after the job had
    started (exit 1); now refused at import, saying what to set."""
    from gyre_slurm.models.weights import import_model_dir

    src = tiny.make_model_dir(tmp_path / "hf", family="llama", max_positions=256)
    tiny.save_weights_into(tiny.new_model(src, seed=0), src)
    import_model_dir(src, tmp_path / "ok" / "model", tmp_path / "ok" / "w0", max_model_len=256)
    with pytest.raises(ValueError, match="rollout.max_model_len = 512 exceeds model.path .* "
                                         "max_position_embeddings = 256 .* at most 256"):
        import_model_dir(src, tmp_path / "run" / "model", tmp_path / "run" / "w0",
                         max_model_len=512)
    assert not (tmp_path / "run").exists()

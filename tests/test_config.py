import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import yaml

from gyre_slurm.common.yamltext import load_yaml
from gyre_slurm.config.keys import iter_keys
from gyre_slurm.config.loader import apply_overrides, dump_yaml, from_dict
from gyre_slurm.config.presets import preset_names, preset_path
from gyre_slurm.config.schema import RENAMED, GyreConfig, load_config
from gyre_slurm.errors import ConfigError

KEYS = iter_keys(GyreConfig)


def test_defaults_load_and_round_trip():
    cfg = load_config(None)
    again = from_dict(GyreConfig, yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("data, fragments", [
    ({"cluster": {"num_nodse": 4}},
     ["unknown key 'cluster.num_nodse'", "Did you mean 'cluster.num_nodes'",
      "Valid keys here: num_nodes, gpus_per_node, cell_nodes"]),
    ({"clustr": {}}, ["unknown key 'clustr'", "'cluster'"]),
    ({"workload": {"duration": {"sigmaa": 1}}}, ["workload.duration.sigmaa", "'workload.duration.sigma'"]),
    ({"cluster": {"num_nodes": "four"}}, ["cluster.num_nodes", "expected an integer", "str 'four'"]),
    ({"cluster": {"num_nodes": 4.5}}, ["expected an integer", "float 4.5"]),
    ({"scheduler": {"policy": "elastik"}}, ["scheduler.policy", "'elastic'", "'elastik'"]),
    ({"scheduler": {"streaming": "yes"}}, ["scheduler.streaming", "true or false"]),
    ({"cluster": {"num_nodes": 6, "cell_nodes": 4}}, ["not a multiple", "cluster.cell_nodes"]),
    ({"cluster": {"num_nodes": 2}, "scheduler": {"min_rollout_cells": 2, "min_train_cells": 1}},
     ["min_rollout_cells + scheduler.min_train_cells = 3", "only 2 cells"]),
    ({"workload": {"llm_time_fraction": 1.5}}, ["llm_time_fraction must be in [0, 1]", "1.5"]),
    ({"training": {"min_replica_nodes": 64}}, ["min_replica_nodes = 64", "cannot train"]),
    ({"cluster": "big"}, ["cluster: expected a mapping", "str 'big'"]),
    ({"training": {"packing": "trees"}}, ["training.packing", "'tree'", "'rows'", "'trees'"]),
    ({"workload": {"rows_reread": 0.5}}, ["workload.rows_reread must be >= 1", "0.5"]),
    ({"cluster": {"num_nodes": 2, "gpus_per_node": 0}, "training": {"min_replica_nodes": 2},
      "scheduler": {"policy": "async", "min_rollout_cells": 0, "min_train_cells": 0}},
     ["scheduler.policy async holds a fixed split", "needs 2 cells", "Use colocate or elastic"]),
    ({"workload": {"tokens_max": 0.5}}, ["workload.tokens_max must be >= 1", "got 0.5"]),
    ({"training": {"microbatch_tokens": 0.999}}, ["training.microbatch_tokens must be >= 1",
                                                  "none would ever train"]),
    ({"scheduler": {"interval_s": 1e5}}, ["scheduler.interval_s must be <= 3,600",
                                          "colocate", "got 100000"]),
    ({"trainer": {"precision": "fp16"}}, ["trainer.precision", "'bf16'", "'fp16'"]),
    ({"trainer": {"distributed_optimizer": True}}, ["distributed_optimizer", "backend: megatron"]),
    ({"trainer": {"backend": "megatron", "python": "env:megatron", "expert_parallel": 2}},
     ["expert_parallel = 2", "model.family llama has none", "qwen3_moe"]),
    ({"trainer": {"backend": "megatron", "python": "env:megatron", "expert_parallel": 3},
      "model": {"family": "qwen3_moe"}}, ["expert_parallel = 3 must divide", "experts = 8"]),
    ({"trainer": {"backend": "megatron", "python": "env:megatron", "expert_parallel": 2},
      "model": {"family": "qwen3_moe"}, "cluster": {"gpus_per_node": 0}},
     ["multiples of 1 ranks", "lower expert_parallel"]),
    ({"model": {"experts": 2, "experts_per_token": 4}}, ["experts_per_token = 4 exceeds"]),
])
def test_bad_config_names_key_and_fix(data, fragments):
    with pytest.raises(ConfigError) as err:
        from_dict(GyreConfig, data)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_overrides_go_through_the_same_checks():
    cfg = load_config(None, ["cluster.num_nodes=8", "workload.duration.sigma=0.5",
                             "sim.async_splits=[1, 2]"])
    assert cfg.cluster.num_nodes == 8
    assert cfg.workload.duration.sigma == 0.5
    assert cfg.sim.async_splits == (1, 2)
    # YAML 1.1 reads 1e9 as a string; a float field takes it as the number it is
    assert load_config(None, ["scheduler.confirm_s=1e9"]).scheduler.confirm_s == 1e9
    with pytest.raises(ConfigError, match="expected a number, got str 'soon'"):
        load_config(None, ["scheduler.confirm_s=soon"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        apply_overrides({}, ["cluster.num_nodes"])
    with pytest.raises(ConfigError, match="'num_nodes' is a value, not a section"):
        apply_overrides({"cluster": {"num_nodes": 4}}, ["cluster.num_nodes.x=1"])
    with pytest.raises(ConfigError, match="unknown key 'cluster.nodes'"):
        load_config(None, ["cluster.nodes=8"])


def test_numbers_past_what_a_float_or_python_reads_are_config_errors():
    """An integer past a float's range in a float key raised OverflowError; one past
    Python's 4,300 digits (or a date with a 13th month) raised ValueError from PyYAML,
    and the --set item came back whole in the message."""
    with pytest.raises(ConfigError, match="scheduler.confirm_s: expected a finite number, "
                                          "got an integer of 401 digits"):
        load_config(None, ["scheduler.confirm_s=1" + "0" * 400])
    with pytest.raises(ConfigError) as err:
        load_config(None, ["workload.num_steps=1" + "0" * 5000])
    msg = str(err.value)
    assert "(5,020 characters): the value is not valid YAML: a value cannot be read" in msg
    assert len(msg) < 600
    with pytest.raises(ConfigError, match="not valid YAML: a value cannot be read: month"):
        load_config(None, ["workload.num_steps=2024-13-45"])


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00cluster: {}\n")
    with pytest.raises(ConfigError, match="binary.yaml is not UTF-8 text"):
        load_config(binary)


@pytest.mark.parametrize("text, message", [
    ('description: "x\\ud800"', "description: 'x\\ud800' holds a lone surrogate"),
    ('agent: {scaffold: {type: command, command: [a, "\\udfff"]}}',
     "agent.scaffold.command[1]: '\\udfff' holds a lone surrogate"),
    ('agent: {scaffold: {type: command, command: [a], env_vars: {A: "x\\0y"}}}',
     "agent.scaffold.env_vars.A: 'x\\x00y' holds a NUL character"),
    ('model: {path: "/m\\0"}', "model.path: '/m\\x00' holds a NUL character"),
])
def test_strings_are_text_every_program_takes(tmp_path, text, message):
    """YAML's escapes make a lone surrogate (no UTF-8 file, environment or path holds
    one) or a NUL (ends a C string): refused with the key at load; they failed later, in
    the run's processes (an env var's value, a command, a path)."""
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value), str(info.value)
    ok = tmp_path / "ok.yaml"
    ok.write_text('description: "gr\\U0001F600\\u00e9"\n')  # the character itself: taken
    assert load_config(ok).description == "gr\U0001F600\u00e9"


BOMB = "".join(f"{x}: &{x} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['1'] * 9)}]\n"
               for p, x in zip([None, *"abcdefgh"], "abcdefghi"))


def test_a_yaml_bomb_is_refused_not_expanded(tmp_path):
    """400 bytes of aliases of aliases are 387 million values once walked: refused at
    load (file or --set value), in well under the time one walk would take; an anchor
    that only saves repeating a section still loads."""
    import time

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="more than 100,000 values once its YAML aliases"):
        load_config(bomb)
    with pytest.raises(ConfigError, match="--set"):
        load_config(None, ["workload.phases=" + "[&a [1,1,1,1,1,1,1,1,1,1], " + ", ".join(
            ["&b%d [%s]" % (i, ", ".join(["*a" if i == 0 else "*b%d" % (i - 1)] * 10))
             for i in range(6)]) + "]"])
    assert time.monotonic() - start < 10
    shared = tmp_path / "anchors.yaml"
    shared.write_text("handoff: &costs {engine_release_s: 5.0}\nworkload: {num_steps: 3}\n"
                      "x-unused: *costs\n")
    with pytest.raises(ConfigError, match="unknown key 'x-unused'"):  # loaded, then checked
        load_config(shared)
    shared.write_text("cluster: &c {num_nodes: 4}\nworkload: {num_steps: 3}\n")
    assert load_config(shared).cluster.num_nodes == 4


@pytest.mark.parametrize("text, key, first", [
    ("cluster:\n  num_nodes: 4\n  cell_nodes: 1\n  num_nodes: 8\n", "'num_nodes'", 2),
    ("cluster: {num_nodes: 2}\nworkload: {num_steps: 3}\ncluster: {num_nodes: 4}\n",
     "'cluster'", 1),
    ("workload:\n  phases: [{from_step: 0, duration_scale: 2, duration_scale: 3}]\n",
     "'duration_scale'", 2),
], ids=["block", "flow-sections", "in-a-list"])
def test_a_key_given_twice_is_refused_not_the_last_kept(tmp_path, text, key, first):
    """PyYAML keeps the last of a key given twice in one mapping: `num_nodes: 4` and a
    later `num_nodes: 8` ran with 8 and no word. Refused, naming the key and both lines,
    in a file and in a --set value; a key a merge (`<<: *base`) brought in may still be
    overridden, as YAML says."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"found the key {key} again \(first on line "
                                          rf"{first}\): YAML would keep only the last"):
        load_config(path)
    with pytest.raises(ConfigError, match="found the key 'mean_s' again"):
        load_config(None, ["workload.duration={mean_s: 10, mean_s: 20}"])
    assert load_yaml("base: &b {num_nodes: 2, cell_nodes: 1}\ncluster:\n  <<: *b\n"
                     "  num_nodes: 4\n", what="merge")["cluster"] == {
        "num_nodes": 4, "cell_nodes": 1}


def test_a_config_path_that_never_ends_is_refused_and_a_pipe_still_reads(tmp_path):
    """/dev/zero (or a runaway pipe) was read for ever; a config is kilobytes, so past
    64 MB the read stops with an error. A pipe of a real config (`<(make-config)`) loads."""
    import os
    import threading

    with pytest.raises(ConfigError, match="/dev/zero holds more than 64 MB"):
        load_config("/dev/zero")
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("workload: {num_steps: 7}\n"))
    writer.start()
    try:
        assert load_config(fifo).workload.num_steps == 7
    finally:
        writer.join(timeout=10)


def test_yaml_nested_too_deeply_is_a_config_error_not_a_crash(tmp_path):
    """PyYAML composes nested collections recursively: past about a thousand levels it
    raised RecursionError, which escaped as a traceback; now a ConfigError like any bad
    YAML, from a file, a --set value, a shell task or a run dir the monitor reads."""
    from gyre_slurm.envs.shell import load_task
    from gyre_slurm.errors import UserError
    from gyre_slurm.monitor.model import cell_capacity

    deep = "workload: " + "[" * 5000 + "]" * 5000 + "\n"
    path = tmp_path / "deep.yaml"
    path.write_text(deep)
    with pytest.raises(ConfigError, match="nests its lists or mappings too deeply"):
        load_config(path)
    with pytest.raises(ConfigError, match="nests its lists or mappings too deeply"):
        load_config(None, ["workload.phases=" + "[" * 5000 + "]" * 5000])
    blocks = "a:\n" + "".join(" " * i + "b:\n" for i in range(1, 3000))
    path.write_text(blocks)
    with pytest.raises(ConfigError, match="too deeply"):
        load_config(path)
    task = tmp_path / "task"
    task.mkdir()
    (task / "task.yaml").write_text(deep)
    with pytest.raises(UserError, match="too deeply"):
        load_task(task)
    (tmp_path / "config.yaml").write_text(deep)
    assert cell_capacity(tmp_path) is None


@pytest.mark.parametrize("name", ["terminalbench-122b", "deepswe-122b", "nl2repo-122b",
                                  "nl2repo-2.4t", "small"])
def test_presets_load(name):
    assert name in preset_names()
    cfg = load_config(preset_path(name))
    assert cfg.name == name


def test_published_settings_in_presets():
    steps = {n: load_config(preset_path(n)).workload.num_steps
             for n in ("terminalbench-122b", "deepswe-122b", "nl2repo-2.4t")}
    assert steps == {"terminalbench-122b": 24, "deepswe-122b": 24, "nl2repo-2.4t": 48}
    tb = load_config(preset_path("terminalbench-122b"))
    assert tb.workload.duration.mean_s == pytest.approx(1.93 * 3600, rel=1e-3)


def test_gyre_config_prints_resolved_yaml(gyre):
    out = gyre("config", "small", "--set", "cluster.num_nodes=16").stdout
    data = yaml.safe_load(out)
    assert data["cluster"]["num_nodes"] == 16
    assert data["scheduler"]["policy"] == "elastic"
    bad = gyre("config", "small", "--set", "cluster.num_nodse=3", check=False)
    assert bad.returncode == 2
    assert "Did you mean 'cluster.num_nodes'" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = gyre("config", "nope.yaml", check=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    unknown = gyre("config", "nopreset", check=False)
    assert unknown.returncode == 2 and "unknown preset 'nopreset'" in unknown.stderr
    folder = gyre("config", "configs", check=False)
    assert folder.returncode == 2 and "configs is a directory" in folder.stderr


@pytest.mark.parametrize("where, message", [
    ("a_file", "is a file, not a folder"),
    ("a_file/run", "a part of that path is a file, not a folder"),
])
def test_a_run_dir_that_cannot_be_a_folder_is_refused_before_the_job_starts(
        gyre, tmp_path, where, message):
    """`gyre run`, `gyre submit` and `gyre sim --slurm` say why their folder cannot be
    made (exit 2, no traceback) before they start or submit anything; the file in the way
    is untouched."""
    (tmp_path / "a_file").write_text("mine\n")
    for argv in (("run", "configs/tiny.yaml", "--run-dir"),
                 ("submit", "configs/tiny.yaml", "--run-dir"),
                 ("sim", "--preset", "small", "--sweep", "cell_nodes=1,2", "--slurm",
                  "--slurm-dir")):
        proc = gyre(*argv, str(tmp_path / where), check=False)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "a_file").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_folder_the_file_system_refuses_is_refused_before_anything_runs(gyre, tmp_path):
    """Every output a command is told to write, in a folder where no file can be made
    (/proc: root passes `os.access` there, yet a new file is refused; other users get
    permission denied): exit 2 naming the path, no traceback, nothing run. Before, `gyre
    traj build -o`, `report -o` and `sim --plot` ran their work and then died at the
    write with a FileNotFoundError traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    (run / "calls.jsonl").write_text("")
    for argv, path in (
            (("run", "configs/tiny.yaml", "--run-dir"), "/proc/gyre-run"),
            (("traj", "build", str(run / "calls.jsonl"), "-o"), "/proc/t.jsonl"),
            (("traj", "export", str(run), "-o"), "/proc/t.jsonl"),
            (("report", str(run), "-o"), "/proc/r.png"),
            (("sim", "--preset", "small", "--no-ablations", "--plot"), "/proc/s.png"),
            (("sim", "--preset", "small", "--sweep", "seed=1,2", "--slurm", "--slurm-dir"),
             "/proc/array")):
        proc = gyre(*argv, path, check=False)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "/proc" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--slurm"], "add --sweep"),
    (["--slurm-arg", "partition=cpu"], "--slurm-arg goes with --slurm"),
    (["--sweep", "seed=1,2", "--slurm-dir", "{tmp}/d", "--slurm-arg", "time=5"],
     "--slurm-arg and --slurm-dir go with --slurm"),
])
def test_slurm_options_of_sim_without_a_slurm_sweep_are_refused(gyre, tmp_path, argv,
                                                                 message):
    """`gyre sim --slurm` runs a sweep's points as a job array; without --sweep, or its
    options without --slurm, the command had run here, quietly ignoring them."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    proc = gyre("sim", "--preset", "small", "--no-ablations", *argv, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def test_a_model_path_the_job_cannot_use_leaves_no_run_behind(gyre, tmp_path):
    """model.path and the roles' interpreters are checked as the run dir is made, before
    any process starts; refused, they leave the run dir with its logs only (no
    config.yaml: the same command, once fixed, is not refused as "already holds a run";
    under sbatch the job's output stays) and the model dir as it was."""
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    run_dir = tmp_path / "run"
    for override, message in ((f"model.path={model}", "no tokenizer"),
                              (f"model.path={tmp_path / 'nope'}", "no config.json"),
                              ("rollout.python=/no/such/python", "no such executable")):
        proc = gyre("run", "configs/tiny.yaml", "--run-dir", str(run_dir), "--set",
                    override, check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert [p.name for p in run_dir.iterdir()] == ["logs"]  # only the logs stay
    assert [p.name for p in model.iterdir()] == ["config.json"]


def test_a_base_model_is_refused_for_chat_agents_and_taken_for_a_command(gyre, tmp_path):
    """A model without a chat template (a base model): the built-in agent chats, so `gyre
    run` refuses it before any process starts, saying so; with a scaffold of type command
    (which may call /v1/completions) the model is taken (the run is refused later, for
    a scaffold on an environment that cannot drive one, so that nothing runs here)."""
    import json

    from gyre_slurm.models import tiny

    model = tiny.make_model_dir(tmp_path / "hf", family="llama")
    tiny.save_weights_into(tiny.new_model(model, seed=0), model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    proc = gyre("run", "configs/tiny.yaml", "--run-dir", str(run_dir), "--set",
                f"model.path={model}", check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"model.path {model}: its tokenizer has no chat template" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [p.name for p in run_dir.iterdir()] == ["logs"]
    proc = gyre("run", "configs/tiny.yaml", "--run-dir", str(run_dir), "--set",
                f"model.path={model}", "--set", "agent.scaffold.type=command", "--set",
                "agent.scaffold.command=[/no/such/scaffold]", check=False)
    assert "chat template" not in proc.stderr, proc.stderr
    assert "cannot be driven by an external scaffold" in proc.stderr, proc.stderr


def test_make_folder_makes_the_folder_and_its_parents(tmp_path):
    from gyre_slurm.common.fsio import make_folder

    made = make_folder(tmp_path / "a" / "b")
    assert made.is_dir()
    assert make_folder(made) == made  # an existing folder is fine


def test_a_config_from_a_pipe_is_read_and_submit_refuses_it(tmp_path):
    """`gyre run <(make-config)`: the shell passes /dev/fd/N, a pipe (it was 'does not
    exist'); `gyre submit` needs a file the job can read again when it starts."""
    import os
    import subprocess
    import sys
    import threading
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "configs" / "tiny.yaml").read_bytes()
    for command, expect in (("config", 0), ("submit", 2)):
        r, w = os.pipe()
        feeder = threading.Thread(target=lambda w=w: (os.write(w, text), os.close(w)))
        feeder.start()
        proc = subprocess.run([sys.executable, "-m", "gyre_slurm", command, f"/dev/fd/{r}"],
                              pass_fds=(r,), cwd=tmp_path, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(root), GYRE_ROOT=str(root)),
                              timeout=120)
        os.close(r)
        feeder.join()
        assert proc.returncode == expect, proc.stderr
        if command == "config":
            assert yaml.safe_load(proc.stdout)["name"] == "tiny"
        else:
            assert "is not a regular file" in proc.stderr


def test_every_key_and_section_has_a_description():
    missing = [k.path for k in KEYS if len(k.help.split()) < 2]
    assert not missing, f"keys without a description: {missing}"
    assert len(KEYS) > 80  # the walk reached every section


def test_sections_are_frozen_and_keyword_only():
    cfg = load_config(None)
    sections = [type(getattr(cfg, k.path)) for k in KEYS if k.is_section and "." not in k.path]
    for cls in [GyreConfig, type(cfg.workload.duration)] + sections:
        params = cls.__dataclass_params__
        assert params.frozen, cls
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls
    with pytest.raises(TypeError):
        type(load_config(None).cluster)(4)  # positional: refused


# A name in two sections is two concepts only where each role has its own: the rollout
# engine's and the trainer's interpreter, image and tensor parallelism. (An item of a list,
# a workload phase, may override a workload key for its steps: `workload.phases[].sigma`.)
PER_ROLE = {"python", "container_image", "tensor_parallel"}


def test_no_concept_has_two_keys():
    names = Counter(k.path.rsplit(".", 1)[-1] for k in KEYS
                    if not k.is_section and "[]." not in k.path)
    assert {n for n, count in names.items() if count > 1} <= PER_ROLE
    texts = Counter(k.help for k in KEYS)
    assert [t for t, count in texts.items() if count > 1] == []
    paths = {k.path for k in KEYS}
    # the concepts the simulator and the runtime once each had a key for
    for old in ("sim.seed", "sim.policy_interval_s", "runtime.policy_interval_s",
                "runtime.runs_per_cell", "trainer.pace_node_tokens_per_s"):
        assert old not in paths and old in RENAMED
    assert {"seed", "scheduler.interval_s", "rollout.runs_per_node",
            "training.node_tokens_per_s"} <= paths


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_old_keys_are_refused_naming_the_new_key(old):
    section, _, name = old.partition(".")
    override = f"{old}=1" if name else f"{old}.bogus=1"  # a whole section: any key in it
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    new = RENAMED[old].split(" ")[0].rstrip(":,")
    assert f"{old} is" in message and RENAMED[old] in message, message
    if name and "." in new:  # the replacement is a key that exists
        assert new in {k.path for k in KEYS}, new


def test_gyre_config_keys_describes_every_key(gyre):
    out = gyre("config", "keys").stdout
    for k in KEYS:
        assert k.path in out
    one = gyre("config", "keys", "faults").stdout
    assert "faults.agent_lost_s" in one and "cluster.num_nodes" not in one
    bad = gyre("config", "keys", "nosuch", check=False)
    assert bad.returncode == 2 and "sections: cluster" in bad.stderr


@pytest.mark.parametrize("name", ["tiny-vllm-megatron-bf16.yaml", "tiny-vllm-megatron-moe.yaml"])
def test_model_family_variants_load(name):
    """The bf16 and MoE variants of configs/tiny-vllm-megatron.yaml (docs/models.md)."""
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / name)
    assert (cfg.trainer.precision, cfg.trainer.distributed_optimizer) == ("bf16", True)
    assert cfg.trainer.expert_parallel == (2 if cfg.model.family == "qwen3_moe" else 1)


TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


@pytest.mark.parametrize("overrides, expected", [
    ([], False),  # tiny.yaml: elastic on CPU (servers pause): no standby
    (["rollout.engine=vllm", "model.heads=2", "cluster.gpus_per_node=8"], True),  # sleeps
    (["rollout.engine=vllm", "model.heads=2", "cluster.gpus_per_node=8",
      "scheduler.policy=async"], False),  # a fixed split moves no cell
    (["rollout.engine=vllm", "model.heads=2", "cluster.gpus_per_node=8",
      "rollout.release=stop"], False),  # a stopped server is no standby
    (["scheduler.policy=async", "rollout.standby=always"], True),
    (["rollout.standby=always"], True),
    (["rollout.engine=vllm", "model.heads=2", "cluster.gpus_per_node=8",
      "rollout.standby=never"], False),
])
def test_standby_servers_follow_the_policy_and_the_engine(overrides, expected):
    cfg = load_config(TINY, overrides)
    assert cfg.standby_engines is expected


def test_standby_always_with_release_stop_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="rollout.standby: always .* rollout.release: stop"):
        load_config(TINY, ["rollout.standby=always", "rollout.release=stop"])

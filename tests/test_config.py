import pytest
import yaml

from gyre_slurm.config.loader import apply_overrides, dump_yaml, from_dict
from gyre_slurm.config.presets import preset_names, preset_path
from gyre_slurm.config.schema import GyreConfig, load_config
from gyre_slurm.errors import ConfigError


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
    assert load_config(None, ["scheduler.train_reserve_s=1e9"]).scheduler.train_reserve_s == 1e9
    with pytest.raises(ConfigError, match="expected a number, got str 'soon'"):
        load_config(None, ["scheduler.train_reserve_s=soon"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        apply_overrides({}, ["cluster.num_nodes"])
    with pytest.raises(ConfigError, match="'num_nodes' is a value, not a section"):
        apply_overrides({"cluster": {"num_nodes": 4}}, ["cluster.num_nodes.x=1"])
    with pytest.raises(ConfigError, match="unknown key 'cluster.nodes'"):
        load_config(None, ["cluster.nodes=8"])


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

"""JSON nested too deeply to decode is bad input like any other, wherever gyre reads JSON
from outside its own process: a clear error naming the file, never a RecursionError that
escapes the reader's handlers (Python's decoder raises RecursionError, not ValueError).
"""

from __future__ import annotations

import json

import pytest

from gyre_slurm.common.fsio import JSONTooDeep, loads_json
from gyre_slurm.envs.shell import load_task
from gyre_slurm.errors import UserError
from gyre_slurm.models.shape import ModelShape
from gyre_slurm.models.weights import weight_files
from gyre_slurm.monitor.summary import end_text
from gyre_slurm.runtime.checkpoint import MANIFEST, CheckpointInvalid, verify_checkpoint

DEEP = "[" * 200_000 + "]" * 200_000


def test_the_python_decoder_raises_recursion_error_which_loads_json_makes_a_value_error():
    with pytest.raises(RecursionError):
        json.loads(DEEP)  # what every reader met before
    with pytest.raises(ValueError, match="nested too deeply") as info:
        loads_json(DEEP)
    assert isinstance(info.value, JSONTooDeep)
    assert loads_json(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}


def test_a_model_directory_whose_config_is_too_deep_is_named(tmp_path):
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(ValueError, match="config.json: not JSON .*nested too deeply"):
        ModelShape.from_model_dir(tmp_path)


def test_a_safetensors_index_too_deep_is_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(DEEP)
    with pytest.raises(ValueError, match="model.safetensors.index.json: not a safetensors index"):
        weight_files(tmp_path)


def test_a_checkpoint_whose_coordinator_file_is_too_deep_is_invalid_not_a_crash(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "coordinator.json").write_text(DEEP)
    with pytest.raises(CheckpointInvalid, match="coordinator.json is garbled .*JSONTooDeep"):
        verify_checkpoint(ckpt, tmp_path)


def test_a_checkpoint_whose_manifest_is_too_deep_is_invalid_not_a_crash(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "coordinator.json").write_text('{"version": 1}')
    (ckpt / MANIFEST).write_text(DEEP)
    with pytest.raises(CheckpointInvalid, match="is garbled .*JSONTooDeep"):
        verify_checkpoint(ckpt, tmp_path)


def test_a_shell_task_too_deep_is_a_user_error(tmp_path):
    (tmp_path / "task.json").write_text(DEEP)
    with pytest.raises(UserError, match="task.json is not valid JSON.*nested too deeply"):
        load_task(tmp_path)


def test_a_status_file_too_deep_still_gives_the_end_summary(tmp_path):
    (tmp_path / "status.json").write_text(DEEP)
    text = end_text(tmp_path, outcome="finished")
    assert "finished" in text

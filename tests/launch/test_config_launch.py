"""Test 6 (bad config) through the real recipe (``python recipes/gpt2.py``): one line on stderr, exit code 2, before
any weights load. The in-process config tests are in tests/unit/test_config.py."""

import os

import pytest
import yaml
from helpers import RECIPE, run


def _yaml(tmp_path, **values):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.fixture
def base(tiny_model, padded_data, tmp_path):
    return {"model_name_or_path": tiny_model, "train_file": padded_data["train_file"],
            "output_dir": str(tmp_path / "out"), "block_size": 32}


def test_recipe_exits_before_loading(base, tmp_path):
    """Through the real recipe: one line on stderr, exit code 2, nothing written, no weights loaded."""
    path = _yaml(tmp_path, **{**base, "block_size": 4096})
    proc = run(["python", RECIPE, "--config", path], check=False)
    assert proc.returncode == 2
    assert "config error: block_size: 4096 exceeds the model's 64 positions" in proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout
    assert not os.path.exists(base["output_dir"])
    proc = run(["python", RECIPE, "--config", path, "--block_size", "32", "--warmup_step", "3"], check=False)
    assert proc.returncode == 2 and "Did you mean 'warmup_steps'" in proc.stderr


def test_dataset_smaller_than_one_global_batch_stops_before_weights(base, tmp_path):
    path = _yaml(tmp_path, **{**base, "per_device_train_batch_size": 40, "gradient_accumulation_steps": 2,
                              "packing": False})
    proc = run(["python", RECIPE, "--config", path], check=False)
    assert proc.returncode == 2
    assert "config error: per_device_train_batch_size: the training set has" in proc.stderr
    assert "fewer than one global batch (1 ranks x 40 x 2 accumulation = 80)" in proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout

"""Test 6 (bad config) through the real recipe (``python recipes/gpt2.py``): one line on stderr, exit code 2, before
any weights load. The in-process config tests are in tests/unit/test_config.py.

The recipe processes of this module are independent: they start all at once (``helpers.run_all``), those of the
tests selected in this session only, and each test reads its own."""

import os

import pytest
import yaml
from helpers import RECIPE, run_all


def _yaml(folder, **values):
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def _base(folder, tiny_model, padded_data):
    return {"model_name_or_path": tiny_model, "train_file": padded_data["train_file"],
            "output_dir": str(folder / "out"), "block_size": 32}


@pytest.fixture(scope="module")
def refused(request, tmp_path_factory, tiny_model, padded_data):
    """test name -> (its output_dir, [the finished recipe processes, in the order the test reads them])."""
    selected = {item.name for item in request.session.items if item.path == request.path}
    cases = {}
    if "test_recipe_exits_before_loading" in selected:
        folder = tmp_path_factory.mktemp("exits")
        base = _base(folder, tiny_model, padded_data)
        path = _yaml(folder, **{**base, "block_size": 4096})
        cases["test_recipe_exits_before_loading"] = (base["output_dir"], [
            ["python", RECIPE, "--config", path],
            ["python", RECIPE, "--config", path, "--block_size", "32", "--warmup_step", "3"]])
    if "test_dataset_smaller_than_one_global_batch_stops_before_weights" in selected:
        folder = tmp_path_factory.mktemp("smaller")
        base = _base(folder, tiny_model, padded_data)
        path = _yaml(folder, **{**base, "per_device_train_batch_size": 40, "gradient_accumulation_steps": 2,
                                "packing": False})
        cases["test_dataset_smaller_than_one_global_batch_stops_before_weights"] = (base["output_dir"], [
            ["python", RECIPE, "--config", path]])
    cmds = [cmd for _, commands in cases.values() for cmd in commands]
    procs = iter(run_all(cmds))
    return {name: (out, [next(procs) for _ in commands]) for name, (out, commands) in cases.items()}


def test_recipe_exits_before_loading(request, refused):
    """Through the real recipe: one line on stderr, exit code 2, nothing written, no weights loaded."""
    output_dir, (proc, typo) = refused[request.node.name]
    assert proc.returncode == 2
    assert "config error: block_size: 4096 exceeds the model's 64 positions" in proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout
    assert not os.path.exists(output_dir)
    assert typo.returncode == 2 and "Did you mean 'warmup_steps'" in typo.stderr


def test_dataset_smaller_than_one_global_batch_stops_before_weights(request, refused):
    output_dir, (proc,) = refused[request.node.name]
    assert proc.returncode == 2
    assert "config error: per_device_train_batch_size: the training set has" in proc.stderr
    assert "fewer than one global batch (1 ranks x 40 x 2 accumulation = 80)" in proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout

"""``python -m toolkit verify``, run for real: a launch config against one process, PASS / FAIL and exit codes."""

import os
import sys

import pytest
from conftest import CONFIGS, args_from, run

DATA = dict(packing=False, block_size=48, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=7,
            per_device_eval_batch_size=3)


def verify(tmp_path, tiny_model, padded_data, *extra, config="zero3.yaml", **fields):
    recipe_args = args_from({"model_name_or_path": tiny_model, **padded_data, **DATA, **fields})
    cmd = [sys.executable, "-m", "toolkit", "verify", "--config_file", os.path.join(CONFIGS, config),
           "--num_processes", "2", "--work_dir", str(tmp_path / "verify"), *extra, *recipe_args]
    return run(cmd, check=False)


@pytest.mark.slow
def test_verify_zero3_passes(tmp_path, tiny_model, padded_data):
    proc = verify(tmp_path, tiny_model, padded_data)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "2 processes x micro batch 2 x accumulation 2 vs 1 process x micro batch 8" in out
    for name, tol in (("sgd", "1e-06"), ("adamw", "1e-04")):
        assert f"{name}: max |dw| = " in out and f"tolerance {tol}: PASS" in out
        assert sum(line.startswith(f"  {name}:    ") for line in out.splitlines()) == 3  # the loss curve, 3 steps
    assert out.rstrip().endswith("PASS")


@pytest.mark.slow
def test_verify_catches_per_micro_batch_averaging(tmp_path, tiny_model, padded_data):
    """The 2024 accumulation bug, injected through the recipe's own switch: verify must say FAIL, exit 1."""
    proc = verify(tmp_path, tiny_model, padded_data, "--optim", "sgd", config="fsdp.yaml",
                  loss_normalization="per_micro_batch")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "tolerance 1e-06: FAIL" in proc.stdout and proc.stdout.rstrip().endswith("FAIL")


def test_verify_usage_errors(tmp_path, tiny_model, padded_data):
    proc = verify(tmp_path, tiny_model, padded_data, "--num_processes", "1")
    assert proc.returncode == 2 and "config error: num_processes" in proc.stderr
    proc = verify(tmp_path, tiny_model, padded_data, learning_rat=0.1)
    assert proc.returncode == 2 and "config error: learning_rat" in proc.stderr and "learning_rate" in proc.stderr

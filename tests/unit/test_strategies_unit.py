"""The shipped launch configs (accelerate_configs/) follow the rules the strategies rely on. The strategies' real runs
are in tests/launch/test_strategies.py."""

import os

import pytest
import yaml
from helpers import CONFIGS


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3", "zero3_offload", "fsdp", "fsdp1"])
def test_launch_configs_follow_the_rules(name):
    path = os.path.join(CONFIGS, f"{name}.yaml")
    text = open(path).read()
    header = text.split("\ncompute_environment")[0]
    assert header.startswith("#") and f"--config_file accelerate_configs/{name}.yaml --num_processes" in header
    config = yaml.safe_load(text)
    assert config["num_machines"] == 1 and config["mixed_precision"] == "no" and not config["use_cpu"]
    ds = config.get("deepspeed_config")
    if ds is not None:
        assert config["distributed_type"] == "DEEPSPEED"
        # the launcher would export it and it would silently beat the recipe's value (accelerate #2210, #3369)
        assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds
        if ds["zero_stage"] == 3:
            assert ds["zero3_save_16bit_model"] is True
    fsdp = config.get("fsdp_config")
    if fsdp is not None:
        assert config["distributed_type"] == "FSDP"
        assert fsdp["fsdp_version"] == (2 if name == "fsdp" else 1)
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert fsdp.get("fsdp_sync_module_states", False) is False  # FSDP1 refuses it on CPU

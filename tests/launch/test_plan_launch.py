"""``python -m toolkit plan`` run as a command (a subprocess) on a 7B Llama config (meta device, no weights). The
arithmetic itself is checked in process in tests/unit/test_plan.py."""

import subprocess
import sys

import pytest
from helpers import ROOT, subprocess_env


@pytest.fixture(scope="module")
def llama7b(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama7b")
    LlamaConfig().save_pretrained(folder)  # the defaults are Llama-2-7B's shape
    return str(folder)


def test_the_command(llama7b):
    proc = subprocess.run([sys.executable, "-m", "toolkit", "plan", "--model", f"{llama7b}/config.json", "--gpus", "8",
                           "--gpu-memory", "80GB"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = {line[:17].strip(): line for line in proc.stdout.splitlines() if line.split()}  # the strategy column
    assert "6.74 B parameters" in proc.stdout
    assert " 107.81 " in lines["DDP"] and lines["DDP"].split()[-6:] == ["no", "no", "accelerate", "launch",
                                                                      "--config_file", "accelerate_configs/ddp.yaml"]
    assert "accelerate_configs/zero3.yaml" in lines["ZeRO-3"] and "accelerate_configs/fsdp.yaml" in lines["FSDP2"]
    assert "accelerate_configs/zero2.yaml --zero_stage 1" in lines["ZeRO-1"]
    assert "accelerate_configs/hsdp.yaml" in lines["HSDP"] and "accelerate_configs/tp.yaml" in lines["TP"]


def test_a_model_that_is_not_there_is_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "toolkit", "plan", "--model", str(tmp_path / "missing"), "--gpus", "8",
                           "--gpu-memory", "80GB"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("plan error: --model ") and "Traceback" not in proc.stderr

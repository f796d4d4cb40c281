"""``python -m toolkit plan`` run as a command (a subprocess) on a 7B Llama config (meta device, no weights). The
arithmetic itself is checked in process in tests/unit/test_plan.py."""

import sys

import pytest
from helpers import run_all


@pytest.fixture(scope="module")
def llama7b(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama7b")
    LlamaConfig().save_pretrained(folder)  # the defaults are Llama-2-7B's shape
    return str(folder)


@pytest.fixture(scope="module")
def commands(request, llama7b, tmp_path_factory):
    """The ``toolkit plan`` commands of the tests below (those selected in this session), started at once
    (helpers.run_all): test name -> the finished process."""
    selected = {item.name for item in request.session.items if item.path == request.path}
    def plan(model: str) -> list[str]:
        return [sys.executable, "-m", "toolkit", "plan", "--model", model, "--gpus", "8", "--gpu-memory", "80GB"]

    cmds = {"test_the_command": plan(f"{llama7b}/config.json"),
            "test_a_model_that_is_not_there_is_one_clear_line": plan(str(tmp_path_factory.mktemp("plan") / "missing"))}
    cmds = {name: cmd for name, cmd in cmds.items() if name in selected}
    return dict(zip(cmds, run_all(list(cmds.values()), timeout=120)))


def test_the_command(request, commands, llama7b):
    proc = commands[request.node.name]  # toolkit plan --model <Llama-2-7B's config.json> --gpus 8 --gpu-memory 80GB
    assert proc.returncode == 0, proc.stderr
    lines = {line[:17].strip(): line for line in proc.stdout.splitlines() if line.split()}  # the strategy column
    assert "6.74 B parameters" in proc.stdout
    assert " 107.81 " in lines["DDP"] and lines["DDP"].split()[-10:] == [
        "no", "no", "accelerate", "launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "8",
        "--mixed_precision", "bf16"]
    assert "accelerate_configs/zero3.yaml" in lines["ZeRO-3"] and "accelerate_configs/fsdp.yaml" in lines["FSDP2"]
    assert "accelerate_configs/zero2.yaml --zero_stage 1" in lines["ZeRO-1"]
    assert "accelerate_configs/hsdp.yaml" in lines["HSDP"] and "accelerate_configs/tp.yaml" in lines["TP"]
    command = next(line for line in proc.stdout.splitlines() if line.startswith("  accelerate launch "))
    assert command.endswith(f"recipes/gpt2.py --config recipes/configs/gpt2.yaml --model_name_or_path {llama7b} "
                            "--per_device_train_batch_size 4 --block_size 2048")


def test_a_model_that_is_not_there_is_one_clear_line(request, commands):
    proc = commands[request.node.name]  # toolkit plan --model <a folder that does not exist> --gpus 8 ...
    assert proc.returncode == 2 and proc.stderr.startswith("plan error: --model ") and "Traceback" not in proc.stderr

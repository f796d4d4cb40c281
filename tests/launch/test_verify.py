"""``python -m toolkit verify``, run for real: a launch config against one process, PASS / FAIL and exit codes.

verify launches the recipe unchanged (``accelerate launch ... recipes/gpt2.py --disable_dropout true``), as a user
would; its own options cannot be mistaken for recipe fields.
"""

import os
import sys

import pytest
from helpers import CONFIGS, ROOT, args_from, run

DATA = dict(packing=False, block_size=48, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=7,
            per_device_eval_batch_size=3)


def verify(tmp_path, tiny_model, padded_data, *extra, config="zero3.yaml", **fields):
    recipe_args = args_from({"model_name_or_path": tiny_model, **padded_data, **DATA, **fields})
    cmd = [sys.executable, "-m", "toolkit", "verify", "--config_file", os.path.join(CONFIGS, config),
           "--num_processes", "2", "--work_dir", str(tmp_path / "verify"), *extra, *recipe_args]
    return run(cmd, check=False)


def _assert_passed(out: str, name: str, tolerance: str) -> None:
    assert f"{name}: max |dw| = " in out and f"tolerance {tolerance}: PASS" in out
    assert sum(line.startswith(f"  {name}:    ") for line in out.splitlines()) == 3  # the loss curve, 3 steps
    assert out.rstrip().endswith("PASS")


@pytest.mark.slow
def test_verify_zero3_passes(tmp_path, tiny_model, padded_data):
    """The AdamW check, clipped inside DeepSpeed's engine at the recipe's max_grad_norm (the SGD check, which both
    checks run by default, is the FSDP test's below; the Muon check the tensor-parallel test's)."""
    proc = verify(tmp_path, tiny_model, padded_data, "--checks", "adamw")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "2 processes x micro batch 2 x accumulation 2 vs 1 process x micro batch 8" in out
    assert "recipes/gpt2.py" in out and "--disable_dropout true" in out  # the user's recipe, dropout off by field
    _assert_passed(out, "adamw", "1e-05")
    # the runs' own output (verify keeps each in a log): no flood of torch's deprecation FutureWarnings that
    # DeepSpeed's ZeRO-3 collectives raise, and no DeepSpeed import in the one-process reference
    logs = {label: open(tmp_path / "verify" / f"adamw-{label}.log").read() for label in ("strategy", "reference")}
    assert "FutureWarning" not in logs["strategy"] and "Setting accelerator to CPU" not in logs["reference"]


@pytest.mark.slow
def test_verify_catches_per_micro_batch_averaging(tmp_path, tiny_model, padded_data):
    """The 2024 accumulation bug, injected through the recipe's own switch: verify must say FAIL, exit 1."""
    proc = verify(tmp_path, tiny_model, padded_data, "--checks", "sgd", config="fsdp.yaml",
                  loss_normalization="per_micro_batch")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "tolerance 1e-06: FAIL" in proc.stdout and proc.stdout.rstrip().endswith("FAIL")


@pytest.mark.slow
def test_verify_tensor_parallel_uses_the_data_parallel_degree(tmp_path, tiny_llama, padded_data):
    """Under tp.yaml both ranks take the same rows: the reference's batch is micro x accumulation x 1, not x 2
    (with the process count it trained on twice the rows and FAILed). The check is Muon's (instead of SGD's: the
    same two launches, and a wrong reference batch fails it as well): optim muon with fp32 iterations, each hidden
    matrix a DTensor split over the 2 ranks (owner-rank Newton-Schulz), its Muon group to 1e-6, the rest to 1e-5
    (measured 2.2e-7 and 1.8e-6)."""
    proc = verify(tmp_path, tiny_llama, padded_data, "--checks", "muon", config="tp.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("2 processes (data-parallel degree 1) x micro batch 2 x accumulation 2 vs 1 process x micro batch 4"
            in proc.stdout)
    _assert_passed(proc.stdout, "muon", "1e-05")
    muon = [line for line in proc.stdout.splitlines() if line.startswith("  muon: max |dw| = ")]
    assert len(muon) == 1 and "tolerance 1e-06 (Muon group); AdamW group max |dw| = " in muon[0], proc.stdout
    assert muon[0].endswith("tolerance 1e-05: PASS") and "(at model.layers." in muon[0]
    log = open(tmp_path / "verify" / "muon-strategy.log").read()
    assert "Newton-Schulz in float32" in log and "optim muon: Muon on the hidden 2-D weights" in log


def test_verify_usage_errors(tmp_path, tiny_model, padded_data):
    proc = verify(tmp_path, tiny_model, padded_data, "--num_processes", "1")
    assert proc.returncode == 2 and "config error: num_processes" in proc.stderr
    proc = verify(tmp_path, tiny_model, padded_data, learning_rat=0.1)
    assert proc.returncode == 2 and "config error: learning_rat" in proc.stderr and "learning_rate" in proc.stderr
    # the Muon check under a strategy that refuses muon: refused before any launch, also when it is not the first
    proc = verify(tmp_path, tiny_model, padded_data, "--checks", "adamw,muon")
    assert proc.returncode == 2 and proc.stderr.startswith("config error: optim: muon"), proc.stderr
    assert not os.path.exists(tmp_path / "verify")


# The installed wheel's `toolkit verify` (its recipes/gpt2.py) and `toolkit train --strategy zero3` (its launch config):
# tests/launch/test_install.py, the suite's one wheel build.


@pytest.mark.slow
def test_verify_accepts_the_sft_recipe_with_lora(tmp_path, tiny_model):
    """``--recipe recipes/sft.py`` with LoRA under FSDP2: verify compares the exported adapters (the base is frozen)."""
    import json as _json

    from toolkit.data.builtin import pydoc_chats

    rows = pydoc_chats()["train"].select(range(24))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(_json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    recipe_args = args_from({"model_name_or_path": tiny_model, "train_file": str(data), "validation_split_percentage": 0,
                             "chat_template": template, "packing": False, "block_size": 64, "seed": 7,
                             "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "use_peft": True,
                             "lora_r": 4, "lora_dropout": 0.0, "lora_target_modules": "all-linear"})
    cmd = [sys.executable, "-m", "toolkit", "verify", "--config_file", os.path.join(CONFIGS, "fsdp.yaml"),
           "--num_processes", "2", "--work_dir", str(tmp_path / "verify"), "--checks", "sgd",
           "--recipe", os.path.join(ROOT, "recipes", "sft.py"), *recipe_args]
    proc = run(cmd, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "recipes/sft.py" in proc.stdout and "tolerance 1e-06: PASS" in proc.stdout

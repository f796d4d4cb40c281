"""Precision: fp32 master weights unless asked otherwise, and no precision the machine cannot do. bf16 mixed
precision under every strategy is the capability matrix's precision dimension (tests/matrix/: its suite cells run
bf16 under DDP, FSDP2, ZeRO-2 and ZeRO-3 against one bf16 process, inside the shared launches).

transformers 5 loads a checkpoint in the dtype it was stored in, and most Hub releases are stored in bf16: without
``torch_dtype: float32`` (our default) the recipe trained them in pure bf16, AdamW rounding small updates away, and
``final/`` came out bf16. Here the same weights stored in bf16 and in fp32 must give the same run and an fp32 export.
"""

import os

import pytest
from helpers import CONFIGS, Runs, args_from, launch, load_weights, max_abs_diff

from toolkit.cli import train as toolkit_launch
from toolkit.errors import ConfigError

COMMON = dict(packing=False, block_size=48, shuffle=True, max_steps=3, logging_steps=1, seed=7, report_to="none",
              per_device_eval_batch_size=3, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              lr_scheduler_type="constant", weight_decay=0)


def plan_runs(pool, tmp_path_factory, stored, padded_data):
    """The two runs from the stored bf16 and fp32 copies, planned (conftest's run_pool): they join the session's 2-rank
    DDP launch."""
    runs = Runs(tmp_path_factory.mktemp("precision"), None, padded_data, COMMON, pool=pool)
    for name, folder in stored.items():
        runs.plan(f"from_{name}", "ddp.yaml", 2, 2, 2, {"model_name_or_path": folder})
    return {"stored_runs": runs}


@pytest.fixture(scope="module")
def stored_runs(run_pool):
    return run_pool.modules[(__name__, "stored_runs")]


def _dtypes(folder: str) -> set:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.mark.slow
def test_bf16_checkpoint_trains_in_fp32_like_its_fp32_copy(stored, stored_runs):
    assert _dtypes(stored["bf16"]) == {"BF16"} and _dtypes(stored["fp32"]) == {"F32"}
    outs = {}
    for name, folder in stored.items():
        outs[name] = stored_runs.get(f"from_{name}", "ddp.yaml", 2, 2, 2, {"model_name_or_path": folder})
    a, b = (load_weights(os.path.join(outs[n], "final")) for n in ("bf16", "fp32"))
    assert max_abs_diff(a, b) <= 1e-6
    assert max_abs_diff(a, load_weights(stored["fp32"])) > 1e-2, "the runs must actually train"
    assert _dtypes(os.path.join(outs["bf16"], "final")) == {"F32"}


@pytest.mark.slow
def test_torch_dtype_auto_keeps_the_stored_dtype(tmp_path, stored, padded_data):
    """Pure bf16 training stays possible, on purpose: torch_dtype auto (the stored dtype), and the log says so."""
    out = tmp_path / "auto"
    cfg = {**COMMON, **padded_data, "model_name_or_path": stored["bf16"], "output_dir": str(out),
           "per_device_train_batch_size": 8, "torch_dtype": "auto", "max_steps": 1}
    proc = launch(args_from(cfg), num_processes=1)
    assert "weights train in bfloat16 (torch_dtype: auto" in proc.stdout + proc.stderr
    assert _dtypes(str(out / "final")) == {"BF16"}


def test_fp16_on_a_cpu_is_refused(tmp_path, tiny_model, padded_data):
    """accelerate would run fp16 on a CPU as plain fp32, exit 0: refused before the weights load. Checked in this
    process, in the environment ``accelerate launch --mixed_precision fp16`` gives 2 DDP ranks (``toolkit.cli.train.check``:
    the checks a rank runs before its Accelerator, ``distributed.check_launch``, and before its weights)."""
    cfg = {**COMMON, **padded_data, "model_name_or_path": tiny_model, "output_dir": str(tmp_path / "out"),
           "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as refused:
        toolkit_launch.check("causal-lm", os.path.join(CONFIGS, "ddp.yaml"), 2, args_from(cfg), mixed_precision="fp16")
    assert f"config error: {refused.value}".startswith("config error: mixed_precision: fp16 needs a GPU")
    assert not os.path.exists(tmp_path / "out" / "final")

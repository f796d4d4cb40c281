"""``toolkit train TASK``, launched for real: a 2-process run through it ends with exactly the weights of the same run
through ``accelerate launch`` (the run pool's, in a shared batch), and it exits with the run's code; a launcher option
(``--main_process_port``) reaches accelerate's launch."""

from __future__ import annotations

import sys

import pytest
from helpers import Runs, args_from, free_port, load_weights, max_abs_diff, run

FIELDS = dict(packing=False, block_size=48, shuffle=True, max_steps=2, logging_steps=1, seed=3, report_to="none",
              per_device_eval_batch_size=3, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              lr_scheduler_type="constant", weight_decay=0)


def plan_runs(pool, tmp_path_factory, tiny_model, padded_data):
    """The accelerate launch twin: one run in the session's 2-rank DDP batch."""
    runs = Runs(tmp_path_factory.mktemp("train-command"), tiny_model, padded_data, FIELDS, pool=pool)
    runs.plan("ddp", "ddp.yaml", 2, 2, 2, {})
    return {"runs": runs}


@pytest.fixture(scope="module")
def runs(run_pool):
    return run_pool.modules[(__name__, "runs")]


@pytest.mark.slow
def test_a_run_through_toolkit_train_equals_the_same_run_through_accelerate_launch(runs, tiny_model, padded_data,
                                                                                     tmp_path):
    twin = runs.get("ddp", "ddp.yaml", 2, 2, 2, {})
    fields = {**FIELDS, **padded_data, "plot": False, "per_device_train_batch_size": 2,
              "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "out")}
    port = str(free_port())  # a launcher option passed on (toolkit train took none: two runs collided on 29500)
    proc = run([sys.executable, "-m", "toolkit", "train", "lm", "--strategy", "ddp", "--num_processes", "2",
                "--main_process_port", port, "--model", tiny_model, *args_from(fields)], check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checked; launching: accelerate launch --config_file" in proc.stdout
    assert f"--num_processes 2 --main_process_port {port} " in proc.stdout
    assert max_abs_diff(load_weights(str(tmp_path / "out" / "final")), load_weights(f"{twin}/final")) == 0.0

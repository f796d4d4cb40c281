"""LoRA on a 4-bit base (QLoRA: load_in_4bit) through real launches of recipes/gpt2.py, tiny Llama: 2 ranks x micro 2
x accumulation 2 end with the adapters of 1 process x 8 (SGD, 1e-6) under DDP, ZeRO-2 and FSDP2, FSDP2 holding half
the packed base on each rank; a resume from a 2-rank checkpoint ends bit for bit as the straight run; the exports
(adapter onto the 4-bit and onto the full-precision base, the merged model in the compute dtype).

Every run is planned into the session's shared launches (``plan_runs``): no launch of its own."""

from __future__ import annotations

import json
import os

import pytest
from helpers import Runs, max_abs_diff

pytestmark = pytest.mark.slow
pytest.importorskip("bitsandbytes")

SGD = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant", weight_decay=0,
           max_steps=3, save_steps=2, logging_steps=1, seed=7, report_to="none", shuffle=True,
           per_device_eval_batch_size=3, packing=False, block_size=48)
QLORA = dict(use_peft=True, load_in_4bit=True, use_bnb_nested_quant=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
             lora_target_modules="all-linear")
STRATEGIES = ("ddp", "zero2", "fsdp")


def plan_runs(pool, tmp_path_factory, tiny_llama, padded_data):
    """The one-process run joins the session's one-process batch, each 2-rank run its launch config's batch."""
    r = Runs(tmp_path_factory.mktemp("qlora"), tiny_llama, padded_data, {**SGD, **QLORA}, pool=pool)
    r.plan("one", "ddp.yaml", 1, 8, 1, {"merge_lora": True})
    for strategy in STRATEGIES:
        r.plan(strategy, f"{strategy}.yaml", 2, 2, 2, {})
    r.plan("resumed", "ddp.yaml", 2, 2, 2, {"resume_from_checkpoint": "latest"}, copy_from=("ddp", 2), probe=False)
    return {"runs": r}


@pytest.fixture(scope="module")
def runs(run_pool):
    return run_pool.modules[(__name__, "runs")]


def _adapter(run) -> dict:
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(os.path.join(run, "final", "adapter_model.safetensors")).items()}


def _probe(run, rank: int) -> dict:
    return json.load(open(os.path.join(run, "probe", f"comm_rank{rank}.json")))


def _losses(run) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if "loss" in r]


def test_qlora_on_two_ranks_equals_one_process(runs):
    """DDP, ZeRO-2, FSDP2: the adapters within 1e-6 of one process, the same losses; under FSDP2 each rank holds half
    of the packed 4-bit base (its storage is float32, which FSDP2 shards: docs/pitfalls.md#qlora-fsdp-storage)."""
    one = runs.get_planned("one")
    reference = _adapter(one)
    assert reference and all("lora_" in k for k in reference)
    assert max(float(v.abs().max()) for k, v in reference.items() if "lora_B" in k) > 0  # B starts at 0: it trained
    for strategy in STRATEGIES:
        run = runs.get_planned(strategy)
        diff = max_abs_diff(reference, _adapter(run))
        print(f"{strategy}: adapters max|d| = {diff:.1e} from one process")
        assert diff <= 1e-6, (strategy, diff)
        assert _losses(run) == pytest.approx(_losses(one), rel=1e-6), strategy
    whole = _probe(one, 0)["held_bytes"]["base_layers"]
    assert whole > 0
    for rank in (0, 1):
        assert _probe(runs.get_planned("ddp"), rank)["held_bytes"]["base_layers"] == whole
        assert abs(_probe(runs.get_planned("fsdp"), rank)["held_bytes"]["base_layers"] - whole / 2) <= 0.02 * whole


def test_qlora_resumes_bit_identically(runs):
    """The 2-rank DDP run's step-2 checkpoint (the adapters, their optimizer, the 4-bit base as loaded) resumed to step
    3 ends with exactly the straight run's adapters."""
    resumed, straight = runs.get_planned("resumed"), runs.get_planned("ddp")
    assert max_abs_diff(_adapter(resumed), _adapter(straight)) == 0.0

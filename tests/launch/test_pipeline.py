"""Pipeline parallelism (toolkit/pipeline.py) on real gloo ranks against one process on the same global batch.

A tied model (tiny GPT-2) and an untied one (tiny Llama), 2 stages on 2 ranks under GPipe and 1F1B, 4 micro-batches
of 2 rows; interleaved 1F1B with 2 stages per rank (a 4-layer Llama); 2 stages x 2 FSDP2 replicas on 4 ranks (SGD and
AdamW); chat SFT; AdamW with clipping (the norm over all stages). Every run is planned into the session's pool: the 2-rank runs join
the shared 2-rank DDP launch, the one-process references the one-process batch, the two 4-rank runs are one launch
(2 stages x 2 DDP replicas, measured by hand to 1.2e-7, has no launch of its own).
Each test asserts the final weights (final/, gathered from the stages), the evaluation (the pipeline's forward) and
the logged loss and grad norm.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import Runs, load_weights, max_abs_diff

pytestmark = pytest.mark.slow

COMMON = dict(packing=False, block_size=48, shuffle=True, max_steps=3, logging_steps=1, seed=7, report_to="none",
              per_device_eval_batch_size=3)
SGD = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant", weight_decay=0)
# clipping at 0.5: the global norms here are 0.6-1.0, so every step clips (a norm of one stage alone would clip less)
ADAMW = dict(optim="adamw_torch", learning_rate=3e-3, max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=0,
             weight_decay=0.01, adam_epsilon=1e-6)
SFT = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant", weight_decay=0,
           max_steps=3, logging_steps=1, seed=7, report_to="none", shuffle=True, per_device_eval_batch_size=3,
           packing=False, block_size=128)


def pp(schedule: str = "1f1b", **extra) -> dict:
    return {"pipeline_parallel_size": 2, "pipeline_schedule": schedule, **extra}


def plan_runs(pool, tmp_path_factory, tiny_model, tiny_llama, padded_data, gpt2_256, chats, bpe_2048):
    from toolkit.offline import save_tiny_llama

    llama4 = save_tiny_llama(str(tmp_path_factory.mktemp("models") / "tiny-llama-4"), num_hidden_layers=4,
                             tokenizer=bpe_2048)
    runs = {}
    for name, model in (("gpt2", tiny_model), ("llama", tiny_llama), ("llama4", llama4)):
        r = runs[name] = Runs(tmp_path_factory.mktemp(f"pipeline-{name}"), model, padded_data, COMMON, pool=pool)
        r.plan("one", None, 1, 8, 1, SGD)  # the one-process SGD reference (gpt2: test_strategies' sgd_1x8x1)
    for name in ("gpt2", "llama"):
        for schedule in ("gpipe", "1f1b"):
            runs[name].plan(schedule, None, 2, 2, 4, {**SGD, **pp(schedule)}, probe=False)
    runs["llama4"].plan("interleaved", None, 2, 2, 4, {**SGD, **pp("interleaved_1f1b", pipeline_stages_per_rank=2)},
                        probe=False)
    runs["gpt2"].plan("one_adamw", None, 1, 8, 1, ADAMW)
    runs["gpt2"].plan("adamw", None, 2, 2, 4, {**ADAMW, **pp()}, probe=False)
    for name, extra in (("fsdp", SGD), ("fsdp_adamw", ADAMW)):  # the one 4-rank launch
        runs["gpt2"].plan(name, "fsdp.yaml", 4, 2, 2, {**extra, **pp()}, probe=False)
    sft = runs["sft"] = Runs(tmp_path_factory.mktemp("pipeline-sft"), gpt2_256, chats, SFT, pool=pool)
    sft.plan("one", None, 1, 8, 1, {}, recipe="sft", probe=False)
    sft.plan("pp", None, 2, 2, 4, pp("gpipe"), recipe="sft", probe=False)
    return {"pipeline_runs": runs}


@pytest.fixture(scope="module")
def pipeline_runs(run_pool):
    return run_pool.modules[(__name__, "pipeline_runs")]


def _metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _assert_equal_runs(one: str, staged: str, weights: float) -> None:
    """final/ weights, every step's loss and grad norm, and the final eval loss of the pipeline run equal one
    process's (the losses to 1e-6 relative: fp32 token sums in another order)."""
    assert max_abs_diff(load_weights(os.path.join(one, "final")), load_weights(os.path.join(staged, "final"))) <= weights
    a, b = _metrics(one), _metrics(staged)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-6 * x["loss"]
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * x["grad_norm"]
    assert "eval_loss" in a[-1] and abs(a[-1]["eval_loss"] - b[-1]["eval_loss"]) <= 1e-6 * a[-1]["eval_loss"]
    assert a[-1]["eval_tokens"] == b[-1]["eval_tokens"]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_on_two_ranks_equal_one_process(pipeline_runs, model, schedule):
    """2 stages on 2 ranks, 4 micro-batches: the tied GPT-2 (its embedding on both stages, the two gradients summed)
    and the untied Llama end with the one-process weights (SGD, 1e-6); final/ is one model from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    runs = pipeline_runs[model]
    one = runs.get("one", None, 1, 8, 1, SGD)
    staged = runs.get(schedule, None, 2, 2, 4, {**SGD, **pp(schedule)})
    _assert_equal_runs(one, staged, 1e-6)
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(staged, "final"))
    assert loaded.config.model_type == model
    if model == "gpt2":  # the tie holds in the export
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    summary = json.load(open(os.path.join(staged, "summary.json")))
    assert summary["data_parallel_size"] == 1


def test_interleaved_1f1b_two_stages_per_rank_equals_one_process(pipeline_runs):
    runs = pipeline_runs["llama4"]
    one = runs.get("one", None, 1, 8, 1, SGD)
    staged = runs.get("interleaved", None, 2, 2, 4, {**SGD, **pp("interleaved_1f1b", pipeline_stages_per_rank=2)})
    _assert_equal_runs(one, staged, 1e-6)


def test_adamw_with_clipping_clips_by_the_norm_over_all_stages(pipeline_runs):
    """AdamW, clipping at 0.5 every step: the logged norm is the one-process norm (over all stages, the tied weight
    once), and the weights end within 1e-5."""
    runs = pipeline_runs["gpt2"]
    one = runs.get("one_adamw", None, 1, 8, 1, ADAMW)
    staged = runs.get("adamw", None, 2, 2, 4, {**ADAMW, **pp()})
    _assert_equal_runs(one, staged, 1e-5)
    assert all(r["grad_norm"] > 0.5 for r in _metrics(staged))  # every step clipped


def test_two_stages_sharded_by_fsdp2_over_two_replicas_equal_one_process(pipeline_runs):
    """fsdp.yaml on 4 ranks: each stage fully_shard-ed over its 2 replicas (the tied embedding sharded on both its
    stages, its shards' gradients summed between them); SGD to 1e-6, and AdamW clipped by the norm over every stage
    and shard to 1e-5; final/ gathered from the shards."""
    runs = pipeline_runs["gpt2"]
    staged = runs.get("fsdp", "fsdp.yaml", 4, 2, 2, {**SGD, **pp()})
    _assert_equal_runs(runs.get("one", None, 1, 8, 1, SGD), staged, 1e-6)
    summary = json.load(open(os.path.join(staged, "summary.json")))
    assert summary["data_parallel_size"] == 2 and summary["distributed_type"] == "FSDP"
    adamw = runs.get("fsdp_adamw", "fsdp.yaml", 4, 2, 2, {**ADAMW, **pp()})
    _assert_equal_runs(runs.get("one_adamw", None, 1, 8, 1, ADAMW), adamw, 1e-5)


def test_chat_sft_padded_chats_under_a_pipeline_equal_one_process(pipeline_runs):
    """recipes/sft.py: padded chats with assistant-only labels; each micro-batch's attention mask reaches every
    stage."""
    runs = pipeline_runs["sft"]
    one = runs.get("one", None, 1, 8, 1, {})
    staged = runs.get("pp", None, 2, 2, 4, pp("gpipe"))
    _assert_equal_runs(one, staged, 1e-6)

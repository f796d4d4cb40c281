"""Pipeline parallelism (toolkit/parallel/pipeline.py) on real gloo ranks against one process on the same global batch.

A tied model (tiny GPT-2) and an untied one (tiny Llama), 2 stages on 2 ranks under GPipe and 1F1B, 4 micro-batches
of 2 rows; interleaved 1F1B with 2 stages per rank (a 4-layer Llama); 2 stages x 2 FSDP2 replicas and 2 stages x 2
DDP replicas on 4 ranks; chat SFT; AdamW with clipping (the norm over all stages); checkpoints (every pipeline run
saves after each step) resumed under a pipeline, DDP and one process, and DDP's under a pipeline; SIGTERM and
SIGKILL; validation rows that split unevenly over the replicas (13 rows, and 1 row: a replica without a share).
Every run but the SIGTERM / SIGKILL test's own is planned into the session's pool: the 2-rank runs join the shared
2-rank DDP launch, the one-process references the one-process batch (a resume from a 2-rank checkpoint the later
one-process launch), the 4-rank runs one FSDP2 and one DDP launch.
Each equality test asserts the final weights (final/, gathered from the stages), the evaluation (the pipeline's
forward) and the logged loss and grad norm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import (
    LAUNCHING,
    ROOT,
    Runs,
    args_from,
    copy_checkpoint,
    kill_job,
    launch_command,
    load_weights,
    max_abs_diff,
    popen,
    steps_logged,
    subprocess_env,
)

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


# test_strategies' AdamW (its 1-process and 2-rank DDP runs are these: shared, no run of their own here), clipping at
# 1.0, a checkpoint at step 2
ADAMW_CKPT = dict(optim="adamw_torch", learning_rate=3e-3, max_grad_norm=1.0, lr_scheduler_type="linear",
                  warmup_steps=0, weight_decay=0.01, save_steps=2, adam_epsilon=1e-6)
RESUME = {"resume_from_checkpoint": "latest"}
# the SIGKILL and SIGTERM test's run: 16 steps of a 6-step epoch, a checkpoint every step (all kept)
KILLED = {**SGD, "max_steps": 16, "save_steps": 1}
# Evaluation on validation rows that split unevenly over 2 replicas (conftest's few_validation_rows): 13 rows in
# batches of 2 (shares of 6 and 7 rows: 3 and 4 forwards), and 1 row (one replica's share empty); one step, evaluated
# at its end. A hang fails its launch after EVAL_TIMEOUT_S (probe_runs.py's watchdog), not the suite's timeout.
EVAL_ROWS = (13, 1)
EVAL_TIMEOUT_S = 120


def uneven_eval(files: dict, rows: int, stages: int = 1) -> dict:
    staged = {"pipeline_parallel_size": stages, "save_final_model": False} if stages > 1 else {}
    return {**SGD, "max_steps": 1, "per_device_eval_batch_size": 2, "validation_file": files[rows], **staged}


def pp(schedule: str = "1f1b", **extra) -> dict:
    """Every pipeline run writes a checkpoint after each step (a save of every schedule, tied and untied, FSDP2)."""
    return {"pipeline_parallel_size": 2, "pipeline_schedule": schedule, "save_steps": 1, **extra}


def plan_runs(pool, tmp_path_factory, tiny_model, tiny_llama, padded_data, gpt2_256, chats, bpe_2048,
              few_validation_rows):
    from toolkit.models.offline import save_tiny_llama

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
    runs["gpt2"].plan("fsdp_adamw_resumed", "fsdp.yaml", 4, 2, 2, {**ADAMW, **pp(), **RESUME}, probe=False,
                      copy_from=("fsdp_adamw", 1))
    _plan_checkpoints(runs["gpt2"])
    for rows in EVAL_ROWS:  # (the one-process references are test_strategies' too: equal runs, one run)
        runs["gpt2"].plan(f"one_eval{rows}", None, 1, 8, 1, uneven_eval(few_validation_rows, rows))
        runs["gpt2"].plan(f"fsdp_eval{rows}", "fsdp.yaml", 4, 2, 2, uneven_eval(few_validation_rows, rows, 2),
                          probe=False, timeout=EVAL_TIMEOUT_S)
    runs["gpt2"].plan("ddp4_eval1", None, 4, 2, 2, uneven_eval(few_validation_rows, 1, 2), probe=False,
                      timeout=EVAL_TIMEOUT_S)
    sft = runs["sft"] = Runs(tmp_path_factory.mktemp("pipeline-sft"), gpt2_256, chats, SFT, pool=pool)
    sft.plan("one", None, 1, 8, 1, {}, recipe="sft", probe=False)
    sft.plan("pp", None, 2, 2, 4, pp("gpipe"), recipe="sft", probe=False)
    return {"pipeline_runs": runs}


def _plan_checkpoints(r) -> None:
    """Checkpoints across layouts, each resume in the launch of its kind after the run it resumes: a pipeline's
    resumed as a pipeline (SGD and AdamW), under DDP on 2 ranks and on one process (a 1-process launch after the
    2-rank one, shared with test_strategies' resumes); DDP's (test_strategies' run) resumed as a pipeline; the
    straight run of the SIGTERM / SIGKILL test."""
    r.plan("sgd_resumed", None, 2, 2, 4, {**SGD, **pp(), **RESUME}, probe=False, copy_from=("1f1b", 1))
    r.plan("pp_adamw", None, 2, 2, 4, {**ADAMW_CKPT, **pp()}, probe=False)
    r.plan("pp_adamw_resumed", None, 2, 2, 4, {**ADAMW_CKPT, **pp(), **RESUME}, probe=False,
           copy_from=("pp_adamw", 1))
    r.plan("pp_adamw_to_ddp", None, 2, 2, 2, {**ADAMW_CKPT, **RESUME}, probe=False, copy_from=("pp_adamw", 1))
    r.plan("pp_adamw_to_one", None, 1, 8, 1, {**ADAMW_CKPT, **RESUME}, probe=False, copy_from=("pp_adamw", 1))
    r.plan("one_adamw_ckpt", None, 1, 8, 1, ADAMW_CKPT)  # test_strategies' adamw_1x8x1
    r.plan("ddp_adamw", None, 2, 2, 2, ADAMW_CKPT)  # test_strategies' adamw_ddp
    r.plan("ddp_adamw_to_pp", None, 2, 2, 4, {**ADAMW_CKPT, **pp(), **RESUME}, probe=False,
           copy_from=("ddp_adamw", 2))
    r.plan("killed_straight", None, 2, 2, 4, {**KILLED, **pp()}, probe=False)
    # the one 4-rank DDP launch: 2 stages x 2 replicas against one process, and the 2-rank pipeline's checkpoint
    # resumed there (the replicas read the same stage's tensors)
    r.plan("ddp4", None, 4, 2, 2, {**SGD, **pp()}, probe=False)
    r.plan("pp_adamw_to_ddp4", None, 4, 2, 2, {**ADAMW_CKPT, **pp(), **RESUME}, probe=False,
           copy_from=("pp_adamw", 1))


@pytest.fixture(scope="module")
def pipeline_runs(run_pool):
    return run_pool.modules[(__name__, "pipeline_runs")]


def _metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _assert_equal_runs(one: str, staged: str, weights: float) -> None:
    """final/ weights, every step's loss and grad norm, and the final eval loss of the pipeline run equal one
    process's (the losses to 1e-6 relative: fp32 token sums in another order)."""
    assert _weights_diff(one, staged) <= weights
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


def test_two_stages_replicated_by_ddp_on_four_ranks_equal_one_process(pipeline_runs):
    """ddp.yaml on 4 ranks, 2 stages x 2 replicas (each stage's replicas sum their gradients, the tied embedding's two
    copies too): SGD to 1e-6 against one process. A 2-rank pipeline's AdamW checkpoint resumed on these 4 ranks
    (each replica reads its stage's tensors) ends with that run's weights (1e-5)."""
    runs = pipeline_runs["gpt2"]
    staged = runs.get("ddp4", None, 4, 2, 2, {**SGD, **pp()})
    _assert_equal_runs(runs.get("one", None, 1, 8, 1, SGD), staged, 1e-6)
    summary = json.load(open(os.path.join(staged, "summary.json")))
    assert (summary["data_parallel_size"], summary["world_size"]) == (2, 4)
    adamw = runs.get("pp_adamw", None, 2, 2, 4, {**ADAMW_CKPT, **pp()})
    resumed = runs.get("pp_adamw_to_ddp4", None, 4, 2, 2, {**ADAMW_CKPT, **pp(), **RESUME},
                       prepare=copy_checkpoint(adamw, 1))
    assert _weights_diff(adamw, resumed) <= 1e-5


def test_chat_sft_padded_chats_under_a_pipeline_equal_one_process(pipeline_runs):
    """recipes/sft.py: padded chats with assistant-only labels; each micro-batch's attention mask reaches every
    stage."""
    runs = pipeline_runs["sft"]
    one = runs.get("one", None, 1, 8, 1, {})
    staged = runs.get("pp", None, 2, 2, 4, pp("gpipe"))
    _assert_equal_runs(one, staged, 1e-6)


@pytest.mark.parametrize("rows", EVAL_ROWS)
def test_validation_rows_split_unevenly_over_the_replicas_evaluate_like_one_process(pipeline_runs,
                                                                                    few_validation_rows, rows):
    """2 stages x 2 replicas on 4 ranks, each replica evaluating its own share of the validation rows. Under FSDP2
    every forward gathers the stage's weights from both replicas: with 13 rows (3 forwards on one replica, 4 on the
    other) the replicas agree on the number of forwards before the first, and the one out of batches runs forwards
    that evaluate nothing (it used to hang at the first mismatched gather: trained every step, then no final
    evaluation, no summary). With 1 row one replica's share is empty (it used to be an IndexError in
    ``eval_dataset.select``), under FSDP2 and DDP. Every run ends, and its evaluation is one process's on the same
    rows. The record says what ran: ``pp 2 x dp 2``; tokens/s per device over all 4 devices, as MFU counts them."""
    runs = pipeline_runs["gpt2"]
    one = _metrics(runs.get(f"one_eval{rows}", None, 1, 8, 1, uneven_eval(few_validation_rows, rows)))[-1]
    staged = [runs.get(f"fsdp_eval{rows}", "fsdp.yaml", 4, 2, 2, uneven_eval(few_validation_rows, rows, 2))]
    if rows == 1:
        staged.append(runs.get("ddp4_eval1", None, 4, 2, 2, uneven_eval(few_validation_rows, 1, 2)))
    for out in staged:
        summary = json.load(open(os.path.join(out, "summary.json")))
        assert (summary["ended"], summary["steps"], summary["parallelism"]) == ("completed", 1, "pp 2 x dp 2")
        assert summary["tokens_per_s_per_device"] == pytest.approx(summary["tokens_per_s"] / 4)
        last = _metrics(out)[-1]
        print(f"{rows} rows, {summary['distributed_type']}: eval_loss {last['eval_loss']!r}, one process "
              f"{one['eval_loss']!r}")
        assert (last["step"], last["eval_tokens"], last["tokens_seen"]) == (1, one["eval_tokens"], one["tokens_seen"])
        assert abs(last["eval_loss"] - one["eval_loss"]) <= 1e-6 * one["eval_loss"]


def _weights_diff(a: str, b: str) -> float:
    return max_abs_diff(load_weights(os.path.join(a, "final")), load_weights(os.path.join(b, "final")))


def test_a_pipeline_checkpoint_resumes_under_a_pipeline_ddp_and_one_process(pipeline_runs):
    """A checkpoint written by 2 stages on 2 ranks is one process's layout, keyed by the whole model's names (strategy
    'pipeline'): resumed as the same pipeline it ends with the uninterrupted run's weights (SGD and AdamW, 1e-6), and
    under DDP on 2 ranks and on one process with them too (AdamW, 1e-5: each moment moved with its parameter, the
    schedule went on), on the same sample order (the same steps' losses). Under FSDP2 (4 ranks) the sharded moments
    are gathered into the same files and sharded again on resume."""
    runs = pipeline_runs["gpt2"]
    straight = runs.get("1f1b", None, 2, 2, 4, {**SGD, **pp("1f1b")})
    resumed = runs.get("sgd_resumed", None, 2, 2, 4, {**SGD, **pp(), **RESUME}, prepare=copy_checkpoint(straight, 1))
    assert _weights_diff(straight, resumed) <= 1e-6
    checkpoint = os.path.join(straight, "checkpoints", "step-1")
    assert json.load(open(os.path.join(checkpoint, "toolkit_state.json")))["strategy"] == "pipeline"
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin"} <= set(os.listdir(checkpoint))
    assert [r["step"] for r in _metrics(resumed)] == [2, 3]
    adamw = runs.get("pp_adamw", None, 2, 2, 4, {**ADAMW_CKPT, **pp()})
    seeded = copy_checkpoint(adamw, 1)
    for name, world, micro, accum, extra, tolerance in (
            ("pp_adamw_resumed", 2, 2, 4, {**ADAMW_CKPT, **pp(), **RESUME}, 1e-6),
            ("pp_adamw_to_ddp", 2, 2, 2, {**ADAMW_CKPT, **RESUME}, 1e-5),
            ("pp_adamw_to_one", 1, 8, 1, {**ADAMW_CKPT, **RESUME}, 1e-5)):
        out = runs.get(name, None, world, micro, accum, extra, prepare=seeded)
        diff = _weights_diff(adamw, out)
        print(f"{name}: max|dw| = {diff:.1e} against the uninterrupted pipeline run")
        assert diff <= tolerance, (name, diff)
        a, b = _metrics(adamw)[1:], _metrics(out)
        assert [r["step"] for r in b] == [2, 3]
        assert all(abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"] for x, y in zip(a, b))
    sharded = runs.get("fsdp_adamw", "fsdp.yaml", 4, 2, 2, {**ADAMW, **pp()})
    resharded = runs.get("fsdp_adamw_resumed", "fsdp.yaml", 4, 2, 2, {**ADAMW, **pp(), **RESUME},
                         prepare=copy_checkpoint(sharded, 1))
    assert _weights_diff(sharded, resharded) <= 1e-6


def test_a_ddp_checkpoint_resumes_under_a_pipeline(pipeline_runs):
    """DDP's checkpoint (2 ranks x 2 x 2, AdamW, step 2) resumed by 2 stages on 2 ranks: each stage reads its
    parameters and their moments by name (the tied embedding on both end stages) and ends with the DDP run's weights
    (1e-5)."""
    runs = pipeline_runs["gpt2"]
    ddp = runs.get("ddp_adamw", None, 2, 2, 2, ADAMW_CKPT)
    staged = runs.get("ddp_adamw_to_pp", None, 2, 2, 4, {**ADAMW_CKPT, **pp(), **RESUME},
                      prepare=copy_checkpoint(ddp, 2))
    diff = _weights_diff(ddp, staged)
    print(f"DDP step-2 resumed by a pipeline: max|dw| = {diff:.1e}")
    assert diff <= 1e-5
    assert [r["step"] for r in _metrics(staged)] == [3]


def _start(cfg: dict, out: str, resume: bool = False) -> subprocess.Popen:
    """The recipe under ``accelerate launch`` on 2 ranks, as a user starts it (the launcher forwards SIGTERM)."""
    cmd = launch_command(args_from({**cfg, "output_dir": out, **(RESUME if resume else {})}))
    return popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(proc: subprocess.Popen, out: str, step: int) -> None:
    deadline = time.time() + 180
    while max(steps_logged(out), default=0) < step and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be signalled"


def test_sigkill_then_sigterm_under_a_pipeline_resume_exactly(pipeline_runs, tmp_path, tiny_model, padded_data):
    """2 stages on 2 ranks, a checkpoint every step. SIGKILL to the whole job (launcher and ranks, frozen first) once 3
    steps are logged; the relaunch from `latest` resumes and takes SIGTERM (to the launcher) 3 steps later: every rank
    finishes the step, the stages' checkpoint is written, the summary says preempted and how to continue. That
    checkpoint holds exactly the uninterrupted run's weights at its step, and every step up to it was logged once
    with the uninterrupted run's loss (a resume from a SIGTERM's checkpoint is the same load:
    test_a_pipeline_checkpoint_resumes_under_a_pipeline_ddp_and_one_process). Two launches: the relaunch after the
    SIGTERM would only repeat what the pool's resumed runs show."""
    cfg = {**COMMON, **padded_data, "model_name_or_path": tiny_model, "plot": False,
           "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, **KILLED, **pp()}
    straight = pipeline_runs["gpt2"].get("killed_straight", None, 2, 2, 4, {**KILLED, **pp()})
    out = str(tmp_path / "interrupted")
    with LAUNCHING:
        proc = _start(cfg, out)
        try:
            _wait_for_step(proc, out, 3)
            kill_job(proc.pid)  # the launcher and its ranks, frozen first: none runs a line more
            proc.wait(timeout=30)
        finally:
            proc.kill()
        killed = max(steps_logged(out))
        assert 3 <= killed < KILLED["max_steps"] - 6 and not os.path.exists(os.path.join(out, "final"))

        proc = _start(cfg, out, resume=True)
        try:
            _wait_for_step(proc, out, killed + 3)
            proc.send_signal(signal.SIGTERM)  # as a scheduler does
            output, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert "world size 2 (MULTI_CPU; pp 2) | micro batch 2" in output  # the stages named where the run starts
    stopped = max(steps_logged(out))
    assert killed + 3 <= stopped < KILLED["max_steps"]
    assert f"SIGTERM: saved checkpoint step-{stopped}" in output
    assert "model: not exported (preempted: relaunch with resume_from_checkpoint: latest)" in output
    assert open(os.path.join(out, "checkpoints", "latest")).read() == f"step-{stopped}"
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert (summary["ended"], summary["final_model"]) == ("preempted", None)
    step = os.path.join("checkpoints", f"step-{stopped}")
    diff = max_abs_diff(load_weights(os.path.join(out, step)), load_weights(os.path.join(straight, step)))
    print(f"SIGKILL after step {killed}, resumed, SIGTERM after step {stopped}: max|dw| = {diff:.1e}")
    assert diff == 0.0
    logged = [(r["step"], r["loss"]) for r in _metrics(out) if "loss" in r]
    assert logged == [(r["step"], r["loss"]) for r in _metrics(straight) if "loss" in r][:stopped]

"""The training core, proven with real runs: 2 gloo ranks through `accelerate launch` vs one process.

All runs use padded rows of very different lengths (so per-micro-batch averaging would be wrong), shuffling on,
fp32, dropout off. Runs are shared between assertions (a launch costs ~10 s of process start alone).
"""

import json
import math
import os
import shutil

import pytest
import torch
from helpers import SCRIPTS, Runs, args_from, copy_checkpoint, launch, load_weights, max_abs_diff

COMMON = dict(packing=False, block_size=48, shuffle=True, max_steps=6, save_steps=3, logging_steps=1, seed=7,
              report_to="none", per_device_eval_batch_size=3)
SGD = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant", weight_decay=0)
# eps 1e-6, not 1e-8: Adam's step is about lr * g / (|g| + eps), so with 1e-8 a parameter whose gradient is near 1e-8
# turns fp32 rounding noise (another summation order) into a visible change of its step, and 2 ranks vs 1 process
# differ by 1.2e-4 on one CPU and 1.4e-5 on another. With 1e-6 the comparison holds to 1e-5 on both, and still catches
# a missing clip and a norm off by sqrt(2) (test_adamw_tolerance_still_catches_clipping_errors).
# max_grad_norm 0.5: below the global norms of this data's steps (0.8 to 1.25 for tiny_model), so clipping acts, and
# a threshold sqrt(2) too high (0.71) clips by other factors.
ADAMW = dict(optim="adamw_torch", learning_rate=3e-3, max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=2,
             weight_decay=0.01, adam_epsilon=1e-6)
ADAMW_TOLERANCE = 1e-5
# The fp32 grad norm of the same gradients summed in another order (2 ranks vs 1 process) differs by ~3e-6 relative
# on this data; a norm over one rank's shard would be off by ~30%.
GRAD_NORM_REL = 1e-5
# ranks x micro-batch x accumulation
LAYOUTS = {"2x2x2": (2, 2, 2), "1x8x1": (1, 8, 1), "1x2x4": (1, 2, 4), "1x4x2": (1, 4, 2)}


class CoreRuns(Runs):
    def get(self, name, layout, extra, prepare=None):
        world, micro, accum = LAYOUTS[layout] if isinstance(layout, str) else layout
        return super().get(name, "ddp.yaml", world, micro, accum, extra, prepare=prepare)

    def plan_layout(self, name, layout, extra, copy_from=None):
        world, micro, accum = LAYOUTS[layout] if isinstance(layout, str) else layout
        self.plan(name, "ddp.yaml", world, micro, accum, extra, copy_from=copy_from)


# 48 rows / global batch 8 = 6 steps per epoch: 9 steps cross into epoch 1 (a new permutation), and step 6 is an
# epoch's last step.
SGD_ACROSS_EPOCHS = {**SGD, "max_steps": 9, "save_steps": 3}
BROKEN_CLIPPING = [({"max_grad_norm": 0}, "no clipping"),
                   ({"max_grad_norm": math.sqrt(2) * ADAMW["max_grad_norm"]}, "a norm off by sqrt(2)")]
OTHER_SPLITS = [("1x8x1", "1x4x2"), ("2x2x2", "1x8x1")]  # (writer, reader) of a resume
RESUME = {**ADAMW, "resume_from_checkpoint": "latest"}
COMM = {**ADAMW, "max_steps": 3, "save_steps": 1, "save_total_limit": 2, "packing": True, "block_size": 16,
        "report_to": "tensorboard"}


def plan_runs(pool, tmp_path_factory, tiny_model, padded_data):
    """Every run below, planned (conftest's run_pool): the 2-rank runs join the session's 2-rank DDP launch, the
    1-process ones its 1-process launch."""
    r = CoreRuns(tmp_path_factory.mktemp("core"), tiny_model, padded_data, COMMON, pool=pool)
    for layout in ("2x2x2", "1x8x1", "1x2x4"):
        r.plan_layout(f"sgd_{layout}", layout, SGD)
    r.plan_layout("sgd_2x2x2_buggy", "2x2x2", {**SGD, "loss_normalization": "per_micro_batch", "max_steps": 3})
    for layout in ("2x2x2", "1x8x1"):
        r.plan_layout(f"adamw_{layout}", layout, ADAMW)
    for broken, why in BROKEN_CLIPPING:
        r.plan_layout(f"adamw_2x2x2_{why.replace(' ', '_')}", "2x2x2", {**ADAMW, **broken})
    r.plan_layout("adamw_2x2x2_resumed", "2x2x2", RESUME, copy_from=("adamw_2x2x2", 3))
    for writer, reader in OTHER_SPLITS:
        r.plan_layout(f"adamw_{writer}_resumed_as_{reader}", reader, RESUME, copy_from=(f"adamw_{writer}", 3))
    for layout in ("2x2x2", "1x8x1"):
        r.plan_layout(f"sgd9_{layout}", layout, SGD_ACROSS_EPOCHS)
    r.plan_layout("sgd9_2x2x2_resumed_at_6", "2x2x2", {**SGD_ACROSS_EPOCHS, "resume_from_checkpoint": "latest"},
                  copy_from=("sgd9_2x2x2", 6))
    r.plan_layout("comm_2x1x4", (2, 1, 4), COMM)
    return {"runs": r}


@pytest.fixture(scope="module")
def runs(run_pool):
    return run_pool.modules[(__name__, "runs")]


def ckpt(out, step):
    return os.path.join(out, "checkpoints", f"step-{step}")


def final(out):
    return os.path.join(out, "final")


@pytest.mark.slow
def test_sgd_equivalence_across_layouts(runs, tiny_model):
    """Plain SGD is linear in the gradient: any normalisation error shows. <= 1e-6 after 3 and after 6 steps."""
    dist = runs.get("sgd_2x2x2", "2x2x2", SGD)
    ref = runs.get("sgd_1x8x1", "1x8x1", SGD)
    acc = runs.get("sgd_1x2x4", "1x2x4", SGD)
    init = load_weights(tiny_model)
    assert max_abs_diff(load_weights(final(ref)), init) > 1e-2, "the runs must actually train"
    for step_dir in (lambda o: ckpt(o, 3), final):
        assert max_abs_diff(load_weights(step_dir(dist)), load_weights(step_dir(ref))) <= 1e-6
        assert max_abs_diff(load_weights(step_dir(acc)), load_weights(step_dir(ref))) <= 1e-6
    probe = json.load(open(os.path.join(dist, "probe", "comm_rank0.json")))
    assert probe["num_processes"] == 2 and probe["distributed_type"] == "MULTI_CPU"
    assert probe["model_type"] == "DistributedDataParallel"
    assert not os.path.exists(os.path.join(dist, "loss.png"))  # plot: false (helpers.Runs); the default draws it


@pytest.mark.slow
def test_per_micro_batch_mean_shows_the_bug(runs):
    """The pre-2024 normalisation (mean per micro-batch) must fail the same check the correct one passes."""
    ref = runs.get("sgd_1x8x1", "1x8x1", SGD)
    buggy = runs.get("sgd_2x2x2_buggy", "2x2x2", {**SGD, "loss_normalization": "per_micro_batch", "max_steps": 3})
    diff = max_abs_diff(load_weights(final(buggy)), load_weights(ckpt(ref, 3)))
    assert diff > 1e-4, f"per-micro-batch averaging should differ on padded data, got {diff:.2e}"


@pytest.mark.slow
def test_adamw_with_clipping_equivalence(runs):
    dist = runs.get("adamw_2x2x2", "2x2x2", ADAMW)
    ref = runs.get("adamw_1x8x1", "1x8x1", ADAMW)
    for step_dir in (lambda o: ckpt(o, 3), final):
        assert max_abs_diff(load_weights(step_dir(dist)), load_weights(step_dir(ref))) <= ADAMW_TOLERANCE
    # the logged loss and grad norm are global quantities: the same on both layouts
    a = [r for r in map(json.loads, open(os.path.join(dist, "metrics.jsonl"))) if "loss" in r]
    b = [r for r in map(json.loads, open(os.path.join(ref, "metrics.jsonl"))) if "loss" in r]
    assert [r["step"] for r in a] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-5)
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=GRAD_NORM_REL)
        assert x["lr"] == pytest.approx(y["lr"]) and x["tokens_seen"] == y["tokens_seen"]
    assert a[1]["lr"] == pytest.approx(3e-3)  # warmup 2 steps: the schedule is per optimizer step, not per rank
    # evaluation covers each validation row once on any world size (gather_for_metrics drops the padding repeats:
    # 16 rows over 2 ranks x 3 per batch does not divide evenly)
    ea = [r for r in map(json.loads, open(os.path.join(dist, "metrics.jsonl"))) if "eval_loss" in r]
    eb = [r for r in map(json.loads, open(os.path.join(ref, "metrics.jsonl"))) if "eval_loss" in r]
    assert len(ea) == len(eb) == 1 and ea[0]["eval_tokens"] == eb[0]["eval_tokens"]
    assert ea[0]["eval_loss"] == pytest.approx(eb[0]["eval_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("broken, why", BROKEN_CLIPPING)
def test_adamw_tolerance_still_catches_clipping_errors(runs, broken, why):
    """The AdamW check is not loosened into blindness: a 2-rank run that skips clipping, or clips against a norm
    sqrt(2) too small (the norm of one rank's shard instead of the global one; the same as a threshold sqrt(2) too
    high) ends further than ADAMW_TOLERANCE from the correct 1-process run."""
    ref = runs.get("adamw_1x8x1", "1x8x1", ADAMW)
    bad = runs.get(f"adamw_2x2x2_{why.replace(' ', '_')}", "2x2x2", {**ADAMW, **broken})
    grad_norms = [r["grad_norm"] for r in map(json.loads, open(os.path.join(ref, "metrics.jsonl"))) if "loss" in r]
    clip = ADAMW["max_grad_norm"]
    assert max(grad_norms) > math.sqrt(2) * clip, "the gradients must be large enough for clipping to act"
    diff = max_abs_diff(load_weights(final(bad)), load_weights(final(ref)))
    print(f"AdamW with {why}: max|dw| = {diff:.2e}")
    assert diff > 10 * ADAMW_TOLERANCE, f"{why} should be caught by the AdamW tolerance, got {diff:.2e}"


@pytest.mark.slow
def test_resume_mid_run_equals_straight_run(runs):
    """6 steps straight == 3 steps, stop, resume from the checkpoint, 3 more (AdamW + linear schedule + clipping)."""
    straight = runs.get("adamw_2x2x2", "2x2x2", ADAMW)


    resumed = runs.get("adamw_2x2x2_resumed", "2x2x2", {**ADAMW, "resume_from_checkpoint": "latest"},
                       prepare=copy_checkpoint(straight, 3))
    assert max_abs_diff(load_weights(final(resumed)), load_weights(final(straight))) <= 1e-6
    rows = [json.loads(line) for line in open(os.path.join(resumed, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "loss" in r] == [4, 5, 6]


@pytest.mark.slow
@pytest.mark.parametrize("writer, reader", OTHER_SPLITS)
def test_resume_with_another_split_of_the_same_global_batch(runs, writer, reader):
    """The global batch is what a checkpoint fixes, not its split: 8 x 1 resumed as 4 x 2 (accelerate restores its
    own micro-step counter, which once put the boundary mid-step), and 2 ranks resumed as 1 process."""
    straight = runs.get(f"adamw_{writer}", writer, ADAMW)


    resumed = runs.get(f"adamw_{writer}_resumed_as_{reader}", reader, {**ADAMW, "resume_from_checkpoint": "latest"},
                       prepare=copy_checkpoint(straight, 3))
    assert max_abs_diff(load_weights(final(resumed)), load_weights(final(straight))) <= ADAMW_TOLERANCE
    rows = [json.loads(line) for line in open(os.path.join(resumed, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "loss" in r] == [4, 5, 6]


@pytest.mark.slow
def test_resume_with_another_global_batch_is_refused(runs, tmp_path, padded_data, tiny_model):
    """Step s means rows [s*B, (s+1)*B) of the epoch's order, so a checkpoint only continues with the same B."""
    straight = runs.get("adamw_2x2x2", "2x2x2", ADAMW)
    out = tmp_path / "other_batch"
    shutil.copytree(ckpt(straight, 3), ckpt(str(out), 3))
    cfg = {**COMMON, **padded_data, **ADAMW, "model_name_or_path": tiny_model, "output_dir": str(out),
           "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "resume_from_checkpoint": "latest"}
    proc = launch(args_from(cfg), num_processes=1, check=False)
    assert proc.returncode == 2
    assert "global batch of 8 rows, this run has 4" in proc.stderr
    assert not os.path.exists(final(str(out)))
    assert "weights train in" not in proc.stdout  # refused before the weights load


@pytest.mark.slow
def test_run_across_an_epoch_boundary_matches_one_process(runs):
    """9 steps over 1.5 epochs: 2 ranks x 2 x 2 still equal 1 process x 8 (SGD, 1e-6), epochs counted right."""
    dist = runs.get("sgd9_2x2x2", "2x2x2", SGD_ACROSS_EPOCHS)
    ref = runs.get("sgd9_1x8x1", "1x8x1", SGD_ACROSS_EPOCHS)
    for step_dir in (lambda o: ckpt(o, 6), final):
        assert max_abs_diff(load_weights(step_dir(dist)), load_weights(step_dir(ref))) <= 1e-6
    rows = [r for r in map(json.loads, open(os.path.join(dist, "metrics.jsonl"))) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["epoch"] for r in rows] == pytest.approx([s / 6 for s in range(1, 10)])


@pytest.mark.slow
def test_resume_at_an_epochs_last_step(runs):
    """A checkpoint taken at the last step of epoch 0 continues with epoch 1's order: == the straight run (1e-6).
    (Replaying epoch 0's order, or skipping into epoch 1, would move SGD's weights by far more.)"""
    straight = runs.get("sgd9_2x2x2", "2x2x2", SGD_ACROSS_EPOCHS)


    resumed = runs.get("sgd9_2x2x2_resumed_at_6", "2x2x2", {**SGD_ACROSS_EPOCHS, "resume_from_checkpoint": "latest"},
                       prepare=copy_checkpoint(straight, 6))
    assert max_abs_diff(load_weights(final(resumed)), load_weights(final(straight))) <= 1e-6
    assert max_abs_diff(load_weights(final(resumed)), load_weights(ckpt(straight, 6))) > 1e-2, "it must train on"
    rows = [r for r in map(json.loads, open(os.path.join(resumed, "metrics.jsonl"))) if "loss" in r]
    assert [r["step"] for r in rows] == [7, 8, 9]


@pytest.mark.slow
def test_train_leaves_its_process_group_held_when_it_returns(runs):
    """When ``train`` returns, every rank still holds the gloo group it trained in (``keep_process_groups``): freed
    with the model instead, its destructor could deadlock (docs/pitfalls.md#gloo-teardown-deadlock; the quickstart's
    notebook_launcher cell hung in 2 of 5 executions). The notebook test runs its launch cell twice; this shows the
    cause gone in every run, deterministically (tests/scripts/probe_run.py's ``after_train``)."""
    out = runs.get("sgd_2x2x2", "2x2x2", SGD)
    for rank in (0, 1):
        assert json.load(open(os.path.join(out, "probe", f"kept_rank{rank}.json"))) == {"kept": True}


@pytest.mark.slow
def test_a_ddp_run_never_imports_deepspeed(runs):
    """A DDP rank trains, checkpoints and exports without importing DeepSpeed (installed here): accelerate's
    unwrap_model and transformers' save_pretrained would import it at the export only to test the model against its
    engine class (docs/pitfalls.md#deepspeed-import). Checked in ranks that run the session's whole batch of DDP
    runs."""
    out = runs.get("sgd_2x2x2", "2x2x2", SGD)
    assert os.path.isfile(os.path.join(out, "final", "model.safetensors"))
    for rank in (0, 1):
        assert json.load(open(os.path.join(out, "probe", f"imports_rank{rank}.json"))) == {"deepspeed": False}


@pytest.mark.slow
def test_no_sync_skips_all_reduce_and_export_round_trips(runs):
    """Accumulation 4: gradient all-reduces happen on the 4th micro-step only; final/ reloads with the same logits."""
    out = runs.get("comm_2x1x4", (2, 1, 4), COMM)
    for rank in (0, 1):
        probe = json.load(open(os.path.join(out, "probe", f"comm_rank{rank}.json")))
        calls = {(s, m): c for s, m, c in probe["per_micro_step"]}
        assert sorted(calls) == [(s, m) for s in range(3) for m in range(4)]
        buckets = calls[(0, 3)]
        assert buckets >= 1
        for s in range(3):
            assert [calls[(s, m)] for m in range(4)] == [0, 0, 0, buckets], calls

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final(out)).eval()
    from probe_run import PROBE_IDS

    with torch.no_grad():
        logits = model(input_ids=PROBE_IDS).logits
    expected = torch.load(os.path.join(out, "probe", "logits.pt"), weights_only=True)
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
    # the run's other outputs
    import yaml

    cfg = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["packing"] is True
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    last = rows[-1]
    for key in ("step", "epoch", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "eval_loss", "perplexity"):
        assert key in last, key
    assert last["perplexity"] == pytest.approx(math.exp(last["eval_loss"]))
    # checkpoints every step, only the 2 newest kept, `latest` names the last
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step-2", "step-3"]
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step-3"
    assert any(f.startswith("events.out.tfevents") for _, _, fs in os.walk(os.path.join(out, "runs")) for f in fs)


def test_data_order_two_ranks(tmp_path):
    """Ranks' shards in a step are disjoint and together equal the 1-process batch; epoch 2 differs; a resume-style
    skip_first_batches continues with the same rows."""
    from toolkit.data.order import GlobalBatchSampler

    n, micro, accum, seed = 40, 2, 2, 5
    out, out2 = str(tmp_path / "order.json"), str(tmp_path / "order_skip.json")
    # one launch, two passes in the same ranks: from the start, and from step 2 (as a resume)
    launch([out, str(n), str(micro), str(accum), str(seed), "0", out2, "2"],
           script=os.path.join(SCRIPTS, "order_probe.py"))
    ranks = json.load(open(out))["ranks"]
    assert len(ranks) == 2
    ref = GlobalBatchSampler(n, micro * 2 * accum, 1, 1, seed=seed, shuffle=True)  # 1 process, batch 8
    epochs = []
    for epoch in range(2):
        steps = []
        for step in range(ref.steps_per_epoch):
            r0 = [i for mb in ranks[0][epoch][step] for i in mb]
            r1 = [i for mb in ranks[1][epoch][step] for i in mb]
            assert not set(r0) & set(r1)
            assert sorted(r0 + r1) == sorted(ref.global_batch(epoch, step))
            steps.append(sorted(r0 + r1))
        epochs.append(steps)
    assert epochs[0] != epochs[1]

    skipped = json.load(open(out2))["ranks"]
    for rank in range(2):
        assert skipped[rank][0] == ranks[rank][0][2:]
        assert skipped[rank][1] == ranks[rank][1]

"""Every strategy trains exactly like one process: DDP, ZeRO-2, ZeRO-3, FSDP2 and FSDP1, 2 real gloo ranks each.

Each strategy runs the real recipe (through tests/scripts/probe_run.py) twice, 2 ranks x micro batch 2 x accumulation 2,
on padded rows of very different lengths with shuffling on: once with plain SGD (no clipping: linear in the gradient,
so any normalisation or accumulation error shows, <= 1e-6) and once with AdamW, clipping at 1.0 and a linear schedule
(<= 1e-5, with eps 1e-6: see test_core.ADAMW). Both are compared with one process x micro batch 8 after 3 steps, through the exported final/ weights.
Launches are shared between assertions (each costs ~10 s of process start).
"""

import json
import math
import os
import shutil

import pytest
import torch
import yaml
from helpers import (
    CONFIG_VARIANTS,
    CONFIGS,
    SCRIPTS,
    Runs,
    args_from,
    assert_plan_matches_held_bytes,
    copy_checkpoint,
    launch,
    launch_command,
    load_weights,
    max_abs_diff,
    read_probes,
    run_all,
    tree_hash,
)

from toolkit.cli import train as toolkit_launch
from toolkit.errors import ConfigError

PROBE = os.path.join(SCRIPTS, "probe_run.py")
SILENT_FALLBACK = ["zero2.yaml", "fsdp.yaml"]  # configs of test_silent_fallback_is_refused

COMMON = dict(packing=False, block_size=48, shuffle=True, max_steps=3, logging_steps=1, seed=7, report_to="none",
              per_device_eval_batch_size=3)
SGD = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant", weight_decay=0)
# warmup 0: the linear schedule gives lr x 1, 2/3, 1/3, so every step moves the weights and the schedule matters.
# eps 1e-6: with 1e-8 the comparison depends on the CPU's fp32 rounding (tests/launch/test_core.py, ADAMW).
ADAMW = dict(optim="adamw_torch", learning_rate=3e-3, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=0,
             weight_decay=0.01, save_steps=2, adam_epsilon=1e-6)
ADAMW_TOLERANCE = 1e-5
# padding-free packing (toolkit/data/packing.py): whole documents best-fit decreasing into the 48-token rows
BFD = {**SGD, "packing": True, "packing_strategy": "bfd"}
BFD_STRATEGIES = ["ddp", "zero3", "fsdp"]
# The logged grad norm is the global one, not a shard's (which would be ~1/sqrt(2) of it, 29% off). Measured here:
# at step 1 (identical weights) the fp32 norms differ by <= 3.3e-6 relative (another summation order); later steps add
# the AdamW runs' own drift (<= 1.4e-4 by step 3 under ZeRO, 7e-5 under FSDP, 1e-7 under DDP).
GRAD_NORM_REL_FIRST_STEP = 1e-5
GRAD_NORM_REL = 5e-4

# strategy -> (config file, accelerate's distributed_type, the prepared model's type, ZeRO stage)
STRATEGIES = {
    "ddp": ("ddp.yaml", "MULTI_CPU", "DistributedDataParallel", None),
    "zero2": ("zero2.yaml", "DEEPSPEED", "DeepSpeedEngine", 2),
    "zero3": ("zero3.yaml", "DEEPSPEED", "DeepSpeedEngine", 3),
    "fsdp": ("fsdp.yaml", "FSDP", "FSDPGPT2LMHeadModel", None),  # FSDP2: fully_shard swaps the class in place
    "fsdp1": ("fsdp1.yaml", "FSDP", "FullyShardedDataParallel", None),
    # SGD only: offloaded AdamW runs DeepSpeedCPUAdam, a C++ op that takes minutes to JIT-build on first use.
    "zero3_offload": ("zero3_offload.yaml", "DEEPSPEED", "DeepSpeedEngine", 3),
}
CORE = ["ddp", "zero2", "zero3", "fsdp", "fsdp1"]


class StrategyRuns(Runs):
    def reference(self, name, extra):
        return self.get(f"{name}_1x8x1", None, 1, 8, 1, extra)

    def strategy(self, strategy, name, extra, **kw):
        return self.get(f"{name}_{strategy}", STRATEGIES[strategy][0], 2, 2, 2, extra, **kw)


# (strategy, writer ranks, reader ranks) of test_resume_on_another_world_size; ranks -> (micro batch, accumulation)
RESUME_WORLDS = [("ddp", 1, 2), ("fsdp", 2, 1), ("fsdp", 1, 2), ("zero3", 2, 1), ("zero3", 1, 2), ("zero2", 2, 1)]
SPLIT = {1: (4, 2), 2: (2, 2)}
# (strategy, switch) of test_memory_switches_train_like_the_plain_run
SWITCHES = [("ddp", "gradient_checkpointing"), ("fsdp", "gradient_checkpointing"), ("fsdp", "fsdp_activation_checkpointing"),
            ("ddp", "loss_chunk_size"), ("fsdp", "loss_chunk_size"), ("zero2", "loss_chunk_size"),
            ("zero3", "loss_chunk_size")]
SWITCH_VALUES = {"gradient_checkpointing": True, "loss_chunk_size": 24}
# torch_compile's decoder blocks traced by aot_eager (no generated code): bitwise the eager run (toolkit.models.loading)
AOT_EAGER = {**SGD, "torch_compile": True, "torch_compile_backend": "aot_eager"}
AOT_EAGER_ADAMW = {**ADAMW, "torch_compile": True, "torch_compile_backend": "aot_eager"}
# inductor (the default backend) generates kernels: the suite's one cold compile (minutes on 2 shared cores)
INDUCTOR_TIMEOUT_S = 900
RESUME = {**ADAMW, "resume_from_checkpoint": "latest"}
# streaming: true (toolkit/data/stream.py) under every layout: 4 files read in shuffled windows of 12 rows, bfd-packed per
# micro-batch; each rank reads and tokenizes only its rows (g % data-parallel degree). layout -> (config, ranks,
# micro batch, accumulation): a global batch of 8 rows; HSDP's data-parallel degree is 4, TP's 1 (both TP ranks take
# all 8 rows), on the tiny Llama (a family with a TP plan). Each run joins its layout's batch: no launch of its own.
STREAM = {**SGD, "streaming": True, "shuffle_buffer_size": 12, "packing": True}
STREAM_LAYOUTS = {"zero2": ("zero2.yaml", 2, 2, 2), "zero3": ("zero3.yaml", 2, 2, 2), "fsdp": ("fsdp.yaml", 2, 2, 2),
                  "fsdp1": ("fsdp1.yaml", 2, 2, 2), "hsdp": ("hsdp.yaml", 4, 2, 1), "tp": ("tp.yaml", 2, 8, 1)}


# Validation rows that split unevenly over the 2 ranks (conftest's few_validation_rows), where each forward of ZeRO-3
# and FSDP2 gathers parameters from both: 13 rows in eval batches of 2 (7 batches) under FSDP2, 1 row (rank 1 has none
# of its own) under ZeRO-3; one step, evaluated at its end. A hang fails its launch after EVAL_TIMEOUT_S.
EVEN_BATCHES = [("fsdp", 13), ("zero3", 1)]
EVAL_TIMEOUT_S = 120


def uneven_eval(files: dict, rows: int) -> dict:
    """test_pipeline.py's one-process evaluation runs: the same fields, so one run serves both modules."""
    return {**SGD, "max_steps": 1, "per_device_eval_batch_size": 2, "validation_file": files[rows]}


def scratch(tiny_model) -> dict:
    return {**SGD, "model_name_or_path": None, "config_name": tiny_model, "tokenizer_name": tiny_model}


def inductor(extra: dict, cache: str) -> dict:
    return {**extra, "torch_compile": True, "torch_compile_cache_dir": cache}


def plan_runs(pool, tmp_path_factory, tiny_model, tiny_llama, padded_data, text_shards, few_validation_rows):
    """Every run below, planned (conftest's run_pool): the runs of one launch config and world size share a launch
    with those of the other modules."""
    r = StrategyRuns(tmp_path_factory.mktemp("strategies"), tiny_model, padded_data, COMMON, pool=pool)
    for name, extra in (("sgd", SGD), ("adamw", ADAMW), ("scratch_sgd", scratch(tiny_model)), ("bfd_sgd", BFD)):
        r.plan(f"{name}_1x8x1", None, 1, 8, 1, extra)
    for strategy in CORE + ["zero3_offload"]:
        r.plan(f"sgd_{strategy}", STRATEGIES[strategy][0], 2, 2, 2, SGD)
    for strategy in CORE:
        r.plan(f"adamw_{strategy}", STRATEGIES[strategy][0], 2, 2, 2, ADAMW)
    r.plan("scratch_sgd_zero3", STRATEGIES["zero3"][0], 2, 2, 2, scratch(tiny_model))
    for strategy in BFD_STRATEGIES:  # in the batches above: no launch of their own
        r.plan(f"bfd_sgd_{strategy}", STRATEGIES[strategy][0], 2, 2, 2, BFD)
    for strategy in ("zero3", "fsdp1"):
        r.plan(f"adamw_resumed_{strategy}", STRATEGIES[strategy][0], 2, 2, 2, RESUME, copy_from=(f"adamw_{strategy}", 2))
    for strategy in sorted({s for s, writer, _ in RESUME_WORLDS if writer == 1}):
        r.plan(f"adamw_{strategy}_1x4x2", STRATEGIES[strategy][0], 1, *SPLIT[1], ADAMW)
    for strategy, writer, reader in RESUME_WORLDS:
        source = f"adamw_{strategy}" if writer == 2 else f"adamw_{strategy}_1x4x2"
        r.plan(f"adamw_{strategy}_{writer}to{reader}", STRATEGIES[strategy][0], reader, *SPLIT[reader], RESUME,
               copy_from=(source, 2))
    for strategy, switch in SWITCHES:
        if switch in SWITCH_VALUES:
            r.plan(f"sgd_{switch}_{strategy}", STRATEGIES[strategy][0], 2, 2, 2, {**SGD, switch: SWITCH_VALUES[switch]})
    for strategy, rows in EVEN_BATCHES:
        r.plan(f"eval{rows}_1x8x1", None, 1, 8, 1, uneven_eval(few_validation_rows, rows))
        r.plan(f"eval{rows}_{strategy}", STRATEGIES[strategy][0], 2, 2, 2, uneven_eval(few_validation_rows, rows),
               probe=False, timeout=EVAL_TIMEOUT_S)
    # launch configs of the same distributed type with one switch changed: their runs join fsdp.yaml's and
    # zero3.yaml's launches, the switch's variables set for the run (helpers.CONFIG_VARIANTS)
    variants = tmp_path_factory.mktemp("launch-configs")
    r.variant_configs = {"fsdp_activation_checkpointing": _launch_config_with(
        variants, "fsdp.yaml", fsdp_activation_checkpointing=True), "zero3_no_16bit": _zero3_without_16bit(variants)}
    for name, base in (("fsdp_activation_checkpointing", "fsdp.yaml"), ("zero3_no_16bit", "zero3.yaml")):
        CONFIG_VARIANTS[r.variant_configs[name]] = base
        r.plan(f"sgd_{name}", r.variant_configs[name], 2, 2, 2, SGD)
    r.plan("sgd_aot_eager_ddp", "ddp.yaml", 2, 2, 2, AOT_EAGER)
    # inductor on one process (the suite's one cold compile), its compile cache in a folder of its own: a one-process
    # run, so it is made in the one-process launch that runs beside tests/unit (conftest's prefetch), off the
    # suite's critical path; and its eager twin
    r.inductor_cache = str(tmp_path_factory.mktemp("inductor-cache"))
    r.plan("sgd_inductor_1x2x4", None, 1, 2, 4, inductor(SGD, r.inductor_cache), timeout=INDUCTOR_TIMEOUT_S)
    r.plan("sgd_1x2x4", None, 1, 2, 4, SGD)
    # the restart on 2 DDP ranks reading that cache: in the DDP launch, once the one process has filled it
    r.plan("adamw_inductor_ddp", "ddp.yaml", 2, 2, 2, inductor(ADAMW, r.inductor_cache), after="sgd_inductor_1x2x4",
           timeout=INDUCTOR_TIMEOUT_S)
    # FSDP2 with compiled blocks, and the resume of its checkpoint beside the eager run's resume (the fsdp launch)
    r.plan("adamw_aot_eager_fsdp", "fsdp.yaml", 2, 2, 2, AOT_EAGER_ADAMW)
    r.plan("adamw_resumed_fsdp", "fsdp.yaml", 2, 2, 2, RESUME, copy_from=("adamw_fsdp", 2))
    r.plan("adamw_aot_eager_resumed_fsdp", "fsdp.yaml", 2, 2, 2, {**AOT_EAGER_ADAMW, **RESUME},
           copy_from=("adamw_aot_eager_fsdp", 2))
    for ranks in (1, 2):
        r.plan(f"adamw_fsdp_to_ddp{ranks}", "ddp.yaml", ranks, *SPLIT[ranks], RESUME, copy_from=("adamw_fsdp", 2))
    streams = {}
    for family, model in (("gpt2", tiny_model), ("llama", tiny_llama)):
        streams[family] = Runs(tmp_path_factory.mktemp(f"stream-{family}"), model, text_shards, COMMON, pool=pool)
        streams[family].plan("one", None, 1, 8, 1, STREAM, probe=False)
    for layout, (config, world, micro, accum) in STREAM_LAYOUTS.items():
        streams["llama" if layout == "tp" else "gpt2"].plan(layout, config, world, micro, accum, STREAM, probe=False)
    return {"runs": r, "stream_runs": streams}


@pytest.fixture(scope="module")
def runs(run_pool):
    return run_pool.modules[(__name__, "runs")]


@pytest.fixture(scope="module")
def stream_runs(run_pool):
    return run_pool.modules[(__name__, "stream_runs")]


def final(out):
    return os.path.join(out, "final")


def probes(out):
    return read_probes(out)


def metrics(out):
    return [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]


def assert_really_distributed(out, strategy, clipping):
    _, dist_type, model_type, stage = STRATEGIES[strategy]
    ranks = probes(out)
    assert [p["process_index"] for p in ranks] == [0, 1]
    for p in ranks:
        assert (p["distributed_type"], p["num_processes"], p["model_type"]) == (dist_type, 2, model_type), p
        if strategy.startswith("fsdp"):
            assert p["is_fsdp2"] == (strategy == "fsdp")
        if dist_type == "DEEPSPEED":
            assert p["zero_stage"] == stage
            assert p["gradient_clipping"] == clipping  # the recipe's max_grad_norm, not DeepSpeed's default 1.0
            assert p["global_steps"] == 3
    # the full (gathered) weights every rank ends with are bit-identical
    assert ranks[0]["weights_sha"] == ranks[1]["weights_sha"]
    if strategy in ("ddp", "fsdp"):  # toolkit.parallel.clipping (CPU): each weight counted once, in one collective a mesh
        for p in ranks:  # gradients of ones: the norm is sqrt(the full model's weight count), not a shard's
            assert p["clip_norm"] == pytest.approx(math.sqrt(p["clip_weights"]), rel=1e-7), p
            # FSDP2: one all-reduce for the model's one mesh (one per parameter took 200 ms a step on 242 of them)
            assert p["clip_collectives"] == (1 if strategy == "fsdp" else 0) < p["clip_params"], p


def assert_final_is_full_and_reloads(out, tiny_model):
    from probe_run import PROBE_IDS
    from transformers import AutoModelForCausalLM

    exported, initial = load_weights(final(out)), load_weights(tiny_model)
    assert sorted(exported) == sorted(initial), "final/ must hold every tensor (no shard, no placeholder)"
    assert all(exported[k].shape == initial[k].shape for k in initial)
    model = AutoModelForCausalLM.from_pretrained(final(out)).eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE_IDS).logits
    expected = torch.load(os.path.join(out, "probe", "logits.pt"), weights_only=True)
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0)


def _sgd_equals_one_process(runs, strategy: str, name: str, extra: dict, tiny_model: str) -> tuple[str, str]:
    """The run of ``strategy`` and its one-process reference (SGD): both trained, weights equal to 1e-6, really
    distributed, the same losses step by step. Returns (run, reference)."""
    out = runs.strategy(strategy, name, extra)
    ref = runs.reference(name, extra)
    assert max_abs_diff(load_weights(final(ref)), load_weights(tiny_model)) > 1e-2, "the runs must actually train"
    diff = max_abs_diff(load_weights(final(out)), load_weights(final(ref)))
    print(f"{strategy} {name} max|dw| = {diff:.2e}")
    assert diff <= 1e-6
    assert_really_distributed(out, strategy, clipping=0.0)
    assert [r["loss"] for r in metrics(out)] == pytest.approx([r["loss"] for r in metrics(ref)], rel=1e-6)
    return out, ref


@pytest.mark.slow
@pytest.mark.parametrize("strategy", CORE + ["zero3_offload"])
def test_sgd_matches_one_process(runs, strategy, tiny_model):
    out, _ = _sgd_equals_one_process(runs, strategy, "sgd", SGD, tiny_model)
    if strategy == "zero3_offload":  # the recipe's SGD, not accelerate's silent swap to DeepSpeedCPUAdam
        assert probes(out)[0]["basic_optimizer_type"] == "SGD"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", CORE)
def test_adamw_with_clipping_matches_one_process(runs, strategy, tiny_model):
    out = runs.strategy(strategy, "adamw", ADAMW)
    ref = runs.reference("adamw", ADAMW)
    diff = max_abs_diff(load_weights(final(out)), load_weights(final(ref)))
    print(f"{strategy} AdamW max|dw| = {diff:.2e}")
    assert diff <= ADAMW_TOLERANCE
    assert_really_distributed(out, strategy, clipping=1.0)
    # decay on matrices, none on biases / norms, under every strategy (ZeRO-3 partitions parameters before the
    # optimizer is built; reading their shape naively put everything in one group). 3 steps of decay at lr 3e-3 move
    # weights by ~1e-5, under the AdamW tolerance, so this is checked directly.
    assert all(p["weight_decays"] == [0.0, 0.01] for p in probes(out))
    a, b = metrics(out), metrics(ref)
    assert [r["step"] for r in a] == [1, 2, 3]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
        assert x["lr"] == pytest.approx(y["lr"])  # one scheduler step per optimizer step on every strategy
        # The global norm over the full model, not a shard (a shard's would be ~1/sqrt(2) of it).
        print(f"{strategy} step {x['step']} grad norm rel diff {abs(x['grad_norm'] / y['grad_norm'] - 1):.1e}")
        rel = GRAD_NORM_REL_FIRST_STEP if x["step"] == 1 else GRAD_NORM_REL
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=rel)
    assert_final_is_full_and_reloads(out, tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", BFD_STRATEGIES)
def test_bfd_packing_matches_one_process(runs, strategy, tiny_model):
    """packing_strategy: bfd on 2 ranks x 2 x 2 trains like 1 process x 8 on the same global batches of packed rows
    (SGD, <= 1e-6), under DDP, ZeRO-3 and FSDP2: the bins come before the order, so every world size sees the same
    rows; position_ids reach the sharded model, and the guard passes on the prepared (sharded) model."""
    out, ref = _sgd_equals_one_process(runs, strategy, "bfd_sgd", BFD, tiny_model)
    summary, unpacked = (json.load(open(os.path.join(d, "summary.json"))) for d in (out, runs.reference("sgd", SGD)))
    # whole documents, several per row: fewer rows than the unpacked run's, fuller (measured: 29 rows against 48)
    print(f"{strategy} bfd: {summary['train_rows']} rows, fill rate {summary['fill_rate']:.3f}; unpacked "
          f"{unpacked['train_rows']} rows, {unpacked['fill_rate']:.3f}")
    assert summary["train_rows"] < unpacked["train_rows"] and summary["fill_rate"] > max(0.8, unpacked["fill_rate"])
    assert [r["tokens_seen"] for r in metrics(out)] == [r["tokens_seen"] for r in metrics(ref)]


@pytest.mark.slow
def test_zero3_from_scratch_initialises_like_one_process(runs, tiny_model):
    """A model built from a config (no weights): transformers would build it inside deepspeed.zero.Init under ZeRO-3,
    a different random init from the same seed (0.36 off after 3 steps) unless zero3_init_flag: false is honoured."""
    out = runs.strategy("zero3", "scratch_sgd", scratch(tiny_model))
    ref = runs.reference("scratch_sgd", scratch(tiny_model))
    assert max_abs_diff(load_weights(final(out)), load_weights(final(ref))) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp1"])
def test_resume_equals_straight_run(runs, strategy):
    """3 steps straight == 2 steps, stop, resume from the sharded checkpoint (same strategy, same world), 1 more.

    FSDP1 is the one that needed a fix (toolkit.checkpointing.checkpoint.load_checkpoint: the AdamW moments were silently not
    loaded, 2.7e-3 off); ZeRO-3 stands for DeepSpeed (per-rank partition files)."""
    straight = runs.strategy(strategy, "adamw", ADAMW)
    step2 = os.path.join(straight, "checkpoints", "step-2")
    assert os.path.isdir(os.path.join(step2, "pytorch_model" if strategy == "zero3" else "pytorch_model_fsdp_0"))

    resumed = runs.strategy(strategy, "adamw_resumed", {**ADAMW, "resume_from_checkpoint": "latest"},
                            prepare=copy_checkpoint(straight, 2))
    assert max_abs_diff(load_weights(final(resumed)), load_weights(final(straight))) <= 1e-6
    assert [r["step"] for r in metrics(resumed)] == [3]


# The world size a checkpoint was written with does not bind its resume (the global batch does): 2 ranks x 2 x 2
# resumed by 1 process x 4 x 2, and 1 x 4 x 2 resumed by 2 ranks, both continue the writer's run. DDP's files load
# anywhere; FSDP2's DCP checkpoint reshards; ZeRO-3's is converted to DeepSpeed's universal format beside it.
# Measured here: ZeRO-3 8e-9 both ways (before the fixes in toolkit.checkpointing.checkpoint.load_checkpoint: 9.3e-5), ZeRO-2
# 1.1e-8, FSDP2 1.2e-7, DDP 3e-8 (DDP 2 -> 1 is test_core.py::test_resume_with_another_split_of_the_same_global_batch).
@pytest.mark.slow
@pytest.mark.parametrize("strategy, writer, reader", RESUME_WORLDS)
def test_resume_on_another_world_size(runs, strategy, writer, reader):
    config = STRATEGIES[strategy][0]
    split = SPLIT  # ranks -> (micro batch, accumulation): a global batch of 8 either way
    if writer == 2:
        straight = runs.strategy(strategy, "adamw", ADAMW)
    else:
        straight = runs.get(f"adamw_{strategy}_1x4x2", config, 1, *split[1], ADAMW)
    original = tree_hash(os.path.join(straight, "checkpoints", "step-2"))
    resumed = runs.get(f"adamw_{strategy}_{writer}to{reader}", config, reader, *split[reader],
                       {**ADAMW, "resume_from_checkpoint": "latest"}, prepare=copy_checkpoint(straight, 2))
    assert max_abs_diff(load_weights(final(resumed)), load_weights(final(straight))) <= 1e-6
    assert [r["step"] for r in metrics(resumed)] == [3]
    assert tree_hash(os.path.join(resumed, "checkpoints", "step-2")) == original, "the checkpoint was modified"
    converted = os.path.join(resumed, "checkpoints", "step-2.universal")
    assert os.path.isdir(converted) == strategy.startswith("zero"), "only ZeRO needs a converted copy, beside it"
    if strategy.startswith("zero"):
        assert os.path.isdir(os.path.join(converted, "pytorch_model", "zero"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", STREAM_LAYOUTS)
def test_a_stream_under_each_layout_trains_like_one_process(stream_runs, layout):
    """streaming: true under ZeRO-2, ZeRO-3, FSDP2, FSDP1 (2 ranks x 2 x 2), HSDP (4 ranks x 2) and TP (2 ranks, one
    data-parallel rank, x 8): the same tokens and losses at every step as 1 process x 8 on the same stream, and its
    weights (SGD, 1e-6). DDP: tests/launch/test_recipes.py (chat SFT) and test_reliability.py (a SIGKILLed stream)."""
    config, world, micro, accum = STREAM_LAYOUTS[layout]
    runs = stream_runs["llama" if layout == "tp" else "gpt2"]
    one, out = runs.get("one", None, 1, 8, 1, STREAM), runs.get(layout, config, world, micro, accum, STREAM)
    rows = {run: [r for r in metrics(run) if "loss" in r] for run in (one, out)}
    assert [(r["step"], r["tokens_seen"]) for r in rows[out]] == [(r["step"], r["tokens_seen"]) for r in rows[one]]
    assert len(rows[one]) == 3 and max_abs_diff(load_weights(final(one)), load_weights(runs.model)) > 1e-3  # it trains
    assert [r["loss"] for r in rows[out]] == pytest.approx([r["loss"] for r in rows[one]], rel=1e-5)
    assert max_abs_diff(load_weights(final(out)), load_weights(final(one))) <= 1e-6
    if layout in ("fsdp", "hsdp", "tp"):  # toolkit.parallel.clipping's norm: each weight once (HSDP: not once a replica)
        assert rows[out][0]["grad_norm"] == pytest.approx(rows[one][0]["grad_norm"], rel=GRAD_NORM_REL_FIRST_STEP)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, rows", EVEN_BATCHES)
def test_validation_rows_split_unevenly_over_the_ranks_evaluate_like_one_process(runs, few_validation_rows, strategy,
                                                                                 rows):
    """Every evaluation path makes as many collective calls on every rank before it makes them. Here accelerate's
    eval loader gives each rank the same number of batches (``even_batches``: the last ones filled with rows from the
    start, which ``gather_for_metrics`` drops), so the gathers of every forward pair up across the ranks: the run ends
    and its evaluation is one process's on the same rows. (A pipeline's replicas agree on their forwards themselves:
    test_pipeline.py.)"""
    extra = uneven_eval(few_validation_rows, rows)
    one = metrics(runs.get(f"eval{rows}_1x8x1", None, 1, 8, 1, extra))[-1]
    out = runs.strategy(strategy, f"eval{rows}", extra)
    assert json.load(open(os.path.join(out, "summary.json")))["ended"] == "completed"
    last = metrics(out)[-1]
    print(f"{strategy}, {rows} rows: eval_loss {last['eval_loss']!r}, one process {one['eval_loss']!r}")
    assert (last["step"], last["eval_tokens"]) == (1, one["eval_tokens"])
    assert last["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-6)


def _zero3_without_16bit(folder) -> str:
    config = yaml.safe_load(open(os.path.join(CONFIGS, "zero3.yaml")))
    config["deepspeed_config"]["zero3_save_16bit_model"] = False
    path = folder / "zero3_no_16bit.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _launch_config_with(tmp_path, base: str, **fsdp_config) -> str:
    config = yaml.safe_load(open(os.path.join(CONFIGS, base)))
    config["fsdp_config"].update(fsdp_config)
    path = tmp_path / f"{base[:-5]}_{'_'.join(fsdp_config)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


# Memory switches train like the plain run. Activation checkpointing recomputes each layer in the backward pass
# (with the forward's RNG state: dropout is on in these runs); the chunked loss computes the same token losses 24
# positions at a time (rows are ~48 long: chunks split rows; every rank runs the same number of chunks, which ZeRO-3's
# gathers of lm_head need: without it ranks of other lengths hung). FSDP's own fsdp_activation_checkpointing is
# handed to transformers (distributed.resolve_activation_checkpointing). The memory each saves is measured in
# bench/memory.py.
@pytest.mark.slow
@pytest.mark.parametrize("strategy, switch", SWITCHES)
def test_memory_switches_train_like_the_plain_run(runs, strategy, switch):
    plain = runs.strategy(strategy, "sgd", SGD)
    if switch == "fsdp_activation_checkpointing":  # FSDP's own, honoured from the launch config (applied in prepare)
        out = runs.get(f"sgd_{switch}", runs.variant_configs[switch], 2, 2, 2, SGD)
    else:
        value = SWITCH_VALUES[switch]
        out = runs.strategy(strategy, f"sgd_{switch}", {**SGD, switch: value})
    assert max_abs_diff(load_weights(final(out)), load_weights(final(plain))) <= 1e-6
    assert [r["loss"] for r in metrics(out)] == pytest.approx([r["loss"] for r in metrics(plain)], rel=1e-6)
    # the evaluation too (with loss_chunk_size it computes its loss in chunks, every rank the eval batch's count)
    evals = [[(r["eval_loss"], r["eval_tokens"]) for r in map(json.loads, open(os.path.join(o, "metrics.jsonl")))
              if "eval_loss" in r] for o in (out, plain)]
    assert evals[1] and [t for _, t in evals[0]] == [t for _, t in evals[1]]
    assert [v for v, _ in evals[0]] == pytest.approx([v for v, _ in evals[1]], rel=1e-6)


@pytest.mark.slow
def test_aot_eager_compiled_blocks_train_bitwise_like_eager_under_ddp(runs):
    """torch_compile: true with the aot_eager backend on 2 DDP ranks (each decoder block compiled in place, padded
    micro-batches of varied lengths): the same losses and final weights as the eager run, bit for bit."""
    out, plain = runs.strategy("ddp", "sgd_aot_eager", AOT_EAGER), runs.strategy("ddp", "sgd", SGD)
    assert max_abs_diff(load_weights(final(out)), load_weights(final(plain))) == 0.0
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(plain)]


@pytest.mark.slow
def test_aot_eager_compiled_blocks_train_and_resume_bitwise_like_eager_under_fsdp2(runs):
    """torch_compile: true (aot_eager) on 2 FSDP2 ranks, each decoder block compiled before fully_shard wraps it
    (torchtitan's order; FSDP2's all-gather hooks run eagerly between the compiled blocks), 3 AdamW steps: the same
    losses and final weights as the eager run, bit for bit; and the compiled run resumed from its own step-2
    checkpoint ends bit for bit where the eager run resumed from its step-2 checkpoint ends."""
    out, plain = runs.strategy("fsdp", "adamw_aot_eager", AOT_EAGER_ADAMW), runs.strategy("fsdp", "adamw", ADAMW)
    assert max_abs_diff(load_weights(final(out)), load_weights(final(plain))) == 0.0
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(plain)]
    resumed = runs.strategy("fsdp", "adamw_aot_eager_resumed", {**AOT_EAGER_ADAMW, **RESUME},
                            prepare=copy_checkpoint(out, 2))
    plain_resumed = runs.strategy("fsdp", "adamw_resumed", RESUME, prepare=copy_checkpoint(plain, 2))
    assert [r["step"] for r in metrics(resumed)] == [r["step"] for r in metrics(plain_resumed)] == [3]
    assert max_abs_diff(load_weights(final(resumed)), load_weights(final(plain_resumed))) == 0.0


@pytest.mark.slow
def test_inductor_trains_like_eager_and_its_cache_spares_another_run_the_compile(runs):
    """torch_compile: true with inductor (generated kernels, which round differently): one process, 3 SGD steps over
    padded micro-batches of 2 rows of varied lengths, ends within 1e-6 of its eager run (the suite's one cold
    compile, in the one-process launch beside tests/unit); then 2 DDP ranks, 3 AdamW steps, with the same
    torch_compile_cache_dir (a restart on another world size and optimizer: the blocks' graphs depend on neither,
    their shapes being dynamic) take every graph from the cache: each rank counts inductor's cache hits and no miss
    (what its log's ``torch_compile:`` line says: tests/unit/test_compile.py); and they end within 1e-5 of their eager
    run. The restart runs in the shared DDP launch once the one process has ended (``plan(after=...)``);
    probe_runs.py starts an inductor run without the graphs earlier runs of its launch compiled."""
    out = runs.get("sgd_inductor_1x2x4", None, 1, 2, 4, inductor(SGD, runs.inductor_cache))
    assert max_abs_diff(load_weights(final(out)), load_weights(final(runs.get("sgd_1x2x4", None, 1, 2, 4, SGD)))) <= 1e-6
    assert os.listdir(os.path.join(runs.inductor_cache, "fxgraph"))  # the one process compiled into the folder
    # The same micro-batches of 2 rows as the one process; its evaluation (batches of 3 over 16 rows, one of 1 row)
    # compiled every evaluation shape the ranks' batches of 3 over 8 rows each take. The evaluation leaves the
    # weights alone.
    restart = runs.get("adamw_inductor_ddp", "ddp.yaml", 2, 2, 2, inductor(ADAMW, runs.inductor_cache))
    caches = [p["inductor_cache"] for p in probes(restart)]
    print(f"inductor's cache, [hits, misses] by rank: {caches}")
    assert len(caches) == 2 and all(hits >= 1 and misses == 0 for hits, misses in caches), caches
    eager = runs.strategy("ddp", "adamw", ADAMW)
    assert max_abs_diff(load_weights(final(restart)), load_weights(final(eager))) <= ADAMW_TOLERANCE


@pytest.fixture(scope="module")
def refusals(request, tmp_path_factory, tiny_model, padded_data):
    """The 2-rank launches of the quick refusal tests below (each stops before the weights load), as many at once as
    the CPUs take (helpers.run_all), those of the tests selected in this session only: test id -> (the finished launch, its output_dir)."""
    selected = {item.name for item in request.session.items if item.path == request.path}
    root = tmp_path_factory.mktemp("refusals")
    cases = {}  # test id -> (launch arguments, extra environment)

    def case(name, config, script=PROBE, env=None, **extra):
        out = root / name.replace("[", "-").replace("]", "")
        cfg = {**COMMON, **padded_data, **SGD, "model_name_or_path": tiny_model, "output_dir": str(out),
               "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, **extra}
        if name in selected:
            cases[name] = (launch_command(args_from(cfg), config=config, script=script), env, str(out))

    for config in SILENT_FALLBACK:
        case(f"test_silent_fallback_is_refused[{config}]", config=config, env={"TOOLKIT_CPU_SHIM": "0"})
    names = list(cases)
    procs = run_all([cases[n][0] for n in names], envs=[cases[n][1] for n in names], processes_each=2)
    return {n: (proc, cases[n][2]) for n, proc in zip(names, procs)}


def test_checkpointing_asked_twice_is_refused(tmp_path, tiny_model, padded_data):
    """gradient_checkpointing with a launch config that sets fsdp_activation_checkpointing: one line before any
    launch (toolkit train's check, in the environment the launch gives a rank: the check each rank makes before its
    process group and weights, ``check_launch``; test_silent_fallback_is_refused shows such a refusal through the
    launcher)."""
    config = _launch_config_with(tmp_path, "fsdp.yaml", fsdp_activation_checkpointing=True)
    cfg = {**COMMON, **padded_data, **SGD, "model_name_or_path": tiny_model, "output_dir": str(tmp_path / "out"),
           "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "gradient_checkpointing": True}
    words = "gradient_checkpointing: the launch config already sets fsdp_activation_checkpointing"
    with pytest.raises(ConfigError, match=words):
        toolkit_launch.check("causal-lm", config, 2, args_from(cfg))
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, name", [("ddp", "DDP"), ("zero2", "ZeRO-2"), ("zero3", "ZeRO-3"), ("fsdp", "FSDP2")])
def test_plan_predicts_the_model_states_each_rank_holds(runs, tiny_model, strategy, name):
    """``toolkit plan``'s per-device weights and optimizer state (fp32 AdamW: ZeRO-2 keeps a master copy, ZeRO-3's is
    the weights' partition, torch keeps none) against the bytes each of the 2 ranks holds after the run's last step,
    storage by storage (tests/scripts/probe_run.py): each within 3%. The LoRA case reads the LoRA runs of
    tests/launch/test_recipes.py."""
    assert_plan_matches_held_bytes(probes(runs.strategy(strategy, "adamw", ADAMW)), tiny_model, name, lora_r=None)


@pytest.mark.slow
def test_zero3_without_16bit_save_still_exports(runs):
    """A ZeRO-3 launch config without zero3_save_16bit_model once crashed at the final export, after all the compute;
    the toolkit turns it on (save_final_model asks for the full weights) and the export equals one process."""
    out = runs.get("sgd_zero3_no_16bit", runs.variant_configs["zero3_no_16bit"], 2, 2, 2, SGD)
    assert max_abs_diff(load_weights(final(out)), load_weights(final(runs.reference("sgd", SGD)))) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_fsdp2_checkpoint_resumes_in_a_plain_process_and_under_ddp(runs, ranks):
    """Another strategy: FSDP2's DCP checkpoint, converted to plain files beside it (``step-2.plain``), continues the
    FSDP2 run under plain ``python`` and under DDP (measured 1.2e-7; once a FileNotFoundError after the weights)."""
    straight = runs.strategy("fsdp", "adamw", ADAMW)
    micro, accum = {1: (4, 2), 2: (2, 2)}[ranks]
    resumed = runs.get(f"adamw_fsdp_to_ddp{ranks}", "ddp.yaml", ranks, micro, accum,
                       {**ADAMW, "resume_from_checkpoint": "latest"}, prepare=copy_checkpoint(straight, 2))
    assert max_abs_diff(load_weights(final(resumed)), load_weights(final(straight))) <= 1e-6
    assert [r["step"] for r in metrics(resumed)] == [3]
    assert os.path.isfile(os.path.join(resumed, "checkpoints", "step-2.plain", "model.safetensors"))
    assert os.path.isdir(os.path.join(resumed, "checkpoints", "step-2", "pytorch_model_fsdp_0"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, config, launch_config, ranks, now", [
    ("zero3", "zero3.yaml", "ddp.yaml", 1, "single with 1 rank(s)"),  # plain `python recipes/gpt2.py`
    ("ddp", "ddp.yaml", "fsdp.yaml", 2, "fsdp2 with 2 rank(s)"),
])
def test_resume_that_cannot_load_the_format_is_refused_before_the_weights(runs, tmp_path, strategy, config,
                                                                          launch_config, ranks, now, tiny_model,
                                                                          padded_data):
    """A checkpoint resumed by a launch that can neither read its format nor convert it (once: a FileNotFoundError
    traceback after the weights loaded) stops first, naming how it was written and the command that resumes it."""
    straight = runs.strategy(strategy, "adamw", ADAMW)
    out = tmp_path / "resumed"
    shutil.copytree(os.path.join(straight, "checkpoints", "step-2"), out / "checkpoints" / "step-2")
    cfg = {**COMMON, **padded_data, **ADAMW, "model_name_or_path": tiny_model, "output_dir": str(out),
           "per_device_train_batch_size": 8 // ranks, "resume_from_checkpoint": "latest"}
    proc = launch(args_from(cfg), num_processes=ranks, config=launch_config, check=False)
    written = {"ddp": "ddp", "zero3": "deepspeed-zero3"}[strategy]
    if ranks == 1:
        assert proc.returncode == 2, proc.stderr[-3000:]
    else:  # each rank exits 2; accelerate's launcher reports a failed child as 1
        assert proc.returncode == 1 and "(exitcode: 2)" in proc.stderr, proc.stderr[-3000:]
    assert f"was written by 2 rank(s) under {written}; this launch is {now}" in proc.stderr
    assert f"accelerate launch --config_file accelerate_configs/{config}" in proc.stderr
    assert "weights train in" not in proc.stdout and not (out / "final").exists()


def test_mismatched_accumulation_in_deepspeed_section_fails(tmp_path, tiny_model, padded_data):
    """zero2.yaml with gradient_accumulation_steps 4 in its DeepSpeed section, the recipe's 2: refused. Checked in this
    process, in the environment accelerate's launcher gives 2 ranks of it (``toolkit.cli.train.check``: the
    ``distributed.check_launch`` a rank runs before its Accelerator)."""
    zero2 = yaml.safe_load(open(os.path.join(CONFIGS, "zero2.yaml")))
    zero2["deepspeed_config"]["gradient_accumulation_steps"] = 4
    (tmp_path / "zero2_gas4.yaml").write_text(yaml.safe_dump(zero2))
    cfg = {**COMMON, **padded_data, **SGD, "model_name_or_path": tiny_model, "output_dir": str(tmp_path / "out"),
           "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as refused:
        toolkit_launch.check("causal-lm", str(tmp_path / "zero2_gas4.yaml"), 2, args_from(cfg))
    message = f"config error: {refused.value}"
    assert message.startswith("config error: gradient_accumulation_steps: the accelerate config sets 4")
    assert "recipe says 2" in message


@pytest.mark.slow  # 2-rank launches: the full suite's layer (the quick layer runs in one process)
@pytest.mark.parametrize("config", SILENT_FALLBACK)
def test_silent_fallback_is_refused(request, refusals, config):
    """Without the CPU shim accelerate quietly runs 2 independent 1-process jobs; check_world must stop that."""
    proc, out = refusals[request.node.name]  # launched with TOOLKIT_CPU_SHIM=0
    assert proc.returncode != 0
    assert "launched 2 processes but the Accelerator sees 1" in proc.stderr
    assert not os.path.exists(os.path.join(out, "final"))

"""Beyond plain data parallel, through accelerate's ``ParallelismConfig``:

- HSDP (accelerate_configs/hsdp.yaml) on 4 real gloo ranks, 2 replicas x 2 shards, trains like one process on the
  same global batch, exports full weights that ``from_pretrained`` loads, and resumes from its checkpoint;
- tensor parallelism (accelerate_configs/tp.yaml) on 2 ranks, a tiny Llama split by its TP plan, trains like one
  process (both ranks take the same rows), exports a plain model, and resumes from its checkpoint exactly; what these
  versions cannot do is refused;
- Ulysses sequence parallelism (``sequence_parallel_size``, ddp.yaml) on 2 ranks (one group of 2) and on 4 (2
  data-parallel x 2 sequence; and one group of 4, which replicates the tiny Llama's 2 key/value heads) trains like one
  process on padded rows of varied length with accumulation 2; what it does not run is refused before work.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml
from helpers import CONFIGS, Runs, args_from, copy_checkpoint, load_weights, max_abs_diff

from toolkit.cli import train as toolkit_launch
from toolkit.errors import ConfigError

pytestmark = pytest.mark.slow

COMMON = dict(packing=False, block_size=48, shuffle=True, max_steps=3, logging_steps=1, seed=7, report_to="none",
              per_device_eval_batch_size=3, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              lr_scheduler_type="constant", weight_decay=0, save_steps=2)


def plan_runs(pool, tmp_path_factory, tiny_model, tiny_llama, padded_data, gpt2_256, chats):
    """The runs below, planned (conftest's run_pool): HSDP and its resumed run in one launch, the TP runs in another."""
    r = Runs(tmp_path_factory.mktemp("parallel"), tiny_model, padded_data, COMMON, pool=pool)
    r.plan("hsdp", "hsdp.yaml", 4, 2, 1, {})  # and its resumed run after it, in the same launch
    r.plan("hsdp_resumed", "hsdp.yaml", 4, 2, 1, {"resume_from_checkpoint": "latest"}, copy_from=("hsdp", 2))
    r.plan("one", None, 1, 8, 1, {"save_steps": None})
    tp = Runs(tmp_path_factory.mktemp("tp"), tiny_llama, padded_data, COMMON, pool=pool)  # save_steps 2: checkpoints
    tp.plan("one", None, 1, 8, 1, {})
    tp.plan("tp", "tp.yaml", 2, 8, 1, {})
    tp.plan("tp_adamw", "tp.yaml", 2, 8, 1, TP_ADAMW)
    tp.plan("tp_adamw_resumed", "tp.yaml", 2, 8, 1, {**TP_ADAMW, "resume_from_checkpoint": "latest"},
            copy_from=("tp_adamw", 2))
    for args in SEQUENCE_RUNS.values():  # the one-process run is tp's "one" (equal runs are one run)
        tp.plan(*args)
    for args in (*PACKED_RUNS.values(), *SWITCH_RUNS.values()):
        tp.plan(*args)
    r.plan("sp2_gpt2", None, 2, 4, 2, {"save_steps": None, "sequence_parallel_size": 2})  # GPT-2: 2 heads
    r.plan("adamw_one", None, 1, 8, 1, SP_ADAMW)  # test_strategies.py's adamw_1x8x1: one run
    for name, (config, world, micro, accum, extra) in SP_ADAMW_RUNS.items():
        r.plan(name, config, world, micro, accum, extra)
    for name, (config, world, micro, accum, extra, source) in SP_RESUMES.items():
        r.plan(name, config, world, micro, accum, extra, copy_from=(source, 2))
    sft = Runs(tmp_path_factory.mktemp("sp-sft"), gpt2_256, chats, SFT, pool=pool)
    sft.plan("one", None, 1, 8, 1, {}, recipe="sft", probe=False)
    sft.plan("sp2", None, 2, 4, 2, {"sequence_parallel_size": 2}, recipe="sft", probe=False)
    sft.plan("cp2", None, 2, 4, 2, CP2, recipe="sft", probe=False)
    return {"runs": r, "tp_runs": tp, "sft_runs": sft}


@pytest.fixture(scope="module")
def runs(run_pool):
    return run_pool.modules[(__name__, "runs")]


def _probe(out: str, rank: int) -> dict:
    with open(os.path.join(out, "probe", f"comm_rank{rank}.json")) as f:
        return json.load(f)


def test_hsdp_on_four_ranks_equals_one_process(runs):
    # Without checkpoints (save_steps at its default): the one-process SGD reference of test_precision.py and
    # test_strategies.py, launched once per session (run_pool).
    reference = runs.get("one", None, 1, 8, 1, {"save_steps": None})
    hsdp = runs.get("hsdp", "hsdp.yaml", 4, 2, 1, {})
    assert max_abs_diff(load_weights(os.path.join(reference, "final")), load_weights(os.path.join(hsdp, "final"))) <= 1e-6
    for rank in range(4):
        probe = _probe(hsdp, rank)
        assert probe["num_processes"] == 4 and probe["is_fsdp2"]
        assert probe["placements"] == ["R", "S(0)"]  # Replicate() across the 2 groups, Shard(0) within each


def test_hsdp_exports_full_weights_and_resumes(runs):
    from transformers import AutoModelForCausalLM

    hsdp = runs.get("hsdp", "hsdp.yaml", 4, 2, 1, {})
    model = AutoModelForCausalLM.from_pretrained(os.path.join(hsdp, "final"))
    assert sum(p.numel() for p in model.parameters()) > 0
    resumed = runs.get("hsdp_resumed", "hsdp.yaml", 4, 2, 1, {"resume_from_checkpoint": "latest"},
                       prepare=copy_checkpoint(hsdp, 2))
    assert max_abs_diff(load_weights(os.path.join(hsdp, "final")), load_weights(os.path.join(resumed, "final"))) == 0.0


# ------------------------------------------------------------------------------------------- tensor parallel
@pytest.fixture(scope="module")
def tp_runs(run_pool):
    return run_pool.modules[(__name__, "tp_runs")]


# chat SFT (assistant tokens only) on padded chats, as tests/launch/test_pipeline.py trains it
SFT = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant", weight_decay=0,
           max_steps=3, logging_steps=1, seed=7, report_to="none", shuffle=True, per_device_eval_batch_size=3,
           packing=False, block_size=128)
SP2 = {"sequence_parallel_size": 2}
CP2 = {"context_parallel_size": 2}  # ring attention
# name: (name, launch config, world, micro-batch, accumulation, fields); the global batch is 8 rows in each
SEQUENCE_RUNS = {name: (name, config, world, micro, 2, {field: n})
                 for name, config, world, micro, field, n in (
                     ("sp2", "ddp.yaml", 2, 4, "sequence_parallel_size", 2),
                     ("dp2_sp2", "ddp.yaml", 4, 2, "sequence_parallel_size", 2),
                     ("sp4", "ddp.yaml", 4, 4, "sequence_parallel_size", 4),
                     ("fsdp2_sp2", "fsdp.yaml", 2, 4, "sequence_parallel_size", 2),
                     ("cp2", "ddp.yaml", 2, 4, "context_parallel_size", 2),
                     ("dp2_cp2", "ddp.yaml", 4, 2, "context_parallel_size", 2),
                     ("fsdp2_dp2_cp2", "fsdp.yaml", 4, 2, "context_parallel_size", 2))}
# padding-free packing: whole documents best-fit decreasing into 48-token rows, each micro-batch one flattened row
SP_BFD = {"packing": True, "packing_strategy": "bfd"}
PACKED_RUNS = {name: (name, "ddp.yaml", world, micro, accum, {**SP_BFD, **extra}) for name, world, micro, accum, extra in
               (("bfd_one", 1, 8, 1, {}), ("bfd_sp2", 2, 4, 2, SP2), ("bfd_dp2_sp2", 4, 2, 2, SP2))}
# activation checkpointing (its recompute in the backward splits too) and LoRA (dropout off: its dropout draws other
# numbers on each rank, as under plain DDP)
SP_LORA = {"use_peft": True, "disable_dropout": True}
SWITCH_RUNS = {"sp2_checkpointing": ("sp2_checkpointing", "ddp.yaml", 2, 4, 2, {**SP2, "gradient_checkpointing": True}),
               "lora_one": ("lora_one", "ddp.yaml", 1, 8, 1, SP_LORA),
               "lora_sp2": ("lora_sp2", "ddp.yaml", 2, 4, 2, {**SP_LORA, **SP2})}
# test_strategies.py's AdamW with clipping (a checkpoint at step 2), on the tiny GPT-2
SP_ADAMW = dict(optim="adamw_torch", learning_rate=3e-3, max_grad_norm=1.0, lr_scheduler_type="linear",
                warmup_steps=0, weight_decay=0.01, save_steps=2, adam_epsilon=1e-6)
SP_ADAMW_RUNS = {"adamw_sp2": ("ddp.yaml", 2, 4, 2, {**SP_ADAMW, **SP2}),
                 "adamw_fsdp2_sp2": ("fsdp.yaml", 2, 4, 2, {**SP_ADAMW, **SP2}),
                 "adamw_cp2": ("ddp.yaml", 2, 4, 2, {**SP_ADAMW, **CP2})}
RESUMED = {**SP_ADAMW, "resume_from_checkpoint": "latest"}
# a step-2 checkpoint resumed on another sequence-parallel size: 2 -> 1 (one process) and 1 -> 2; the ring's 2 -> 1
SP_RESUMES = {"adamw_sp2_to_one": ("ddp.yaml", 1, 8, 1, RESUMED, "adamw_sp2"),
              "adamw_one_to_sp2": ("ddp.yaml", 2, 4, 2, {**RESUMED, **SP2}, "adamw_one"),
              "adamw_cp2_to_one": ("ddp.yaml", 1, 8, 1, RESUMED, "adamw_cp2")}
TP_ADAMW = {"optim": "adamw_torch", "learning_rate": 3e-3, "max_grad_norm": 1.0, "weight_decay": 0.1,
            "lr_scheduler_type": "linear", "adam_epsilon": 1e-6, "max_steps": 4}


def test_tensor_parallel_on_two_ranks_equals_one_process(tp_runs):
    """Both ranks of the TP group take the same rows (data-parallel degree 1): the global batch is 1 x 8, the loss
    is normalised once, not per replica, and each validation row is evaluated once (eval loss, tokens, perplexity)."""
    from transformers import AutoModelForCausalLM

    reference = tp_runs.get("one", None, 1, 8, 1, {})
    tp = tp_runs.get("tp", "tp.yaml", 2, 8, 1, {})
    assert max_abs_diff(load_weights(os.path.join(reference, "final")), load_weights(os.path.join(tp, "final"))) <= 1e-6
    rows = [json.loads(line) for line in open(os.path.join(tp, "metrics.jsonl"))]
    want = [json.loads(line) for line in open(os.path.join(reference, "metrics.jsonl"))]
    assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in want]  # each row counted once
    assert [round(r["loss"], 5) for r in rows if "loss" in r] == [round(r["loss"], 5) for r in want if "loss" in r]
    # evaluation too: accelerate gives both ranks the same eval batches and its gather_for_metrics gathers over both
    # (31 rows for 16, eval_tokens 975 for 490); distributed.gather_for_metrics gathers over the data-parallel ranks
    evals, want_evals = ([r for r in metrics if "eval_loss" in r] for metrics in (rows, want))
    assert [r["eval_tokens"] for r in evals] == [r["eval_tokens"] for r in want_evals] and want_evals
    for r, w in zip(evals, want_evals):
        assert r["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-6, abs=0)
        assert r["perplexity"] == pytest.approx(w["perplexity"], rel=1e-5, abs=0)
    # the logged norm is the full model's: the same as one process's at step 1 (the same weights)
    assert rows[0]["step"] == 1 and rows[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-6)
    for rank in range(2):
        probe = _probe(tp, rank)
        assert probe["placements"] == ["S(0)"]  # a weight of the TP plan, split over the 2 ranks
        # toolkit.parallel.clipping on gradients of ones: sqrt(the weight count), a replicated weight (the norms) counted once,
        # a split one over both shards; one all-reduce for the split ones, none for the others
        assert probe["clip_norm"] == pytest.approx(probe["clip_weights"] ** 0.5, rel=1e-7), probe
        assert probe["clip_collectives"] == 1, probe
    model = AutoModelForCausalLM.from_pretrained(os.path.join(tp, "final"))  # a plain model: no distributed_config
    assert getattr(model.config, "distributed_config", None) is None


def test_tensor_parallel_checkpoint_resumes_exactly(tp_runs):
    """A TP run's step-2 checkpoint (weights and optimizer state as torch.distributed.checkpoint folders of the
    shards, the rest from accelerate's save_state), resumed on the same layout, ends bit-identical to the run that
    went on. AdamW with clipping and decay: the moments of both ranks' shards must come back (without them: 1.5e-2)."""
    adamw = TP_ADAMW
    tp = tp_runs.get("tp_adamw", "tp.yaml", 2, 8, 1, adamw)
    step2 = os.path.join(tp, "checkpoints", "step-2")
    assert {"pytorch_model_tp", "optimizer_tp", "scheduler.bin", "random_states_1.pkl"} <= set(os.listdir(step2))
    assert json.load(open(os.path.join(step2, "toolkit_state.json")))["strategy"] == "tp"
    resumed = tp_runs.get("tp_adamw_resumed", "tp.yaml", 2, 8, 1, {**adamw, "resume_from_checkpoint": "latest"},
                          prepare=copy_checkpoint(tp, 2))
    assert max_abs_diff(load_weights(os.path.join(tp, "final")), load_weights(os.path.join(resumed, "final"))) == 0.0
    rows = [json.loads(line) for line in open(os.path.join(resumed, "metrics.jsonl"))]
    want = {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(tp, "metrics.jsonl"))) if "loss" in r}
    assert [(r["step"], r["loss"]) for r in rows if "loss" in r] == [(3, want[3]), (4, want[4])]


@pytest.mark.parametrize("case", ["no_plan", "dp_shard_x_tp", "uneven_heads"])
def test_tensor_parallel_refusals(tmp_path, tiny_model, tiny_llama, padded_data, case):
    """Refused before the weights load, naming the field: a model without a TP plan (GPT-2), FSDP sharding with TP
    (fails with accelerate 1.16 + transformers 5.24: ImportError ReplicateParallel), a tp_size that splits heads.
    All three are refused by the checks a rank runs before its weights (``distributed.check_launch``,
    ``build.check_inputs``), checked here in this process, in the environment accelerate's launcher gives the ranks
    (``toolkit.cli.train.check``, as ``toolkit train`` does before it launches)."""
    config, world, model = os.path.join(CONFIGS, "tp.yaml"), 2, tiny_llama
    if case == "no_plan":
        model, words = tiny_model, "parallelism_config_tp_size: a gpt2 model has no tensor-parallel plan"
    elif case == "uneven_heads":  # the tiny Llama has 4 heads and 2 KV heads
        spec = yaml.safe_load(open(config))
        spec["parallelism_config"]["parallelism_config_tp_size"] = world = 3  # what --parallelism_config_tp_size 3 sets
        config = str(tmp_path / "tp3.yaml")
        yaml.safe_dump(spec, open(config, "w"))
        words = ("parallelism_config_tp_size: tp_size 3 does not divide this llama model's heads "
                 "(num_attention_heads 4, num_key_value_heads 2)")
    else:
        spec = yaml.safe_load(open(config))
        spec["parallelism_config"]["parallelism_config_dp_shard_size"] = 2
        spec["num_processes"] = world = 4
        config = str(tmp_path / "dp_shard_tp.yaml")
        yaml.safe_dump(spec, open(config, "w"))
        words = "parallelism_config_tp_size: tensor parallelism (tp_size 2) with data parallelism"
    cfg = {**COMMON, **padded_data, "save_steps": None, "model_name_or_path": model,
           "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2}
    argv = args_from({k: v for k, v in cfg.items() if v is not None})
    with pytest.raises(ConfigError) as refused:
        toolkit_launch.check("causal-lm", config, world, argv)
    assert f"config error: {refused.value}".startswith(f"config error: {words}")
    assert not os.path.exists(tmp_path / "out" / "final")


# ------------------------------------------------------------------------------------------ sequence parallel
@pytest.mark.parametrize("name", list(SEQUENCE_RUNS))
def test_sequence_parallel_equals_one_process(tp_runs, name):
    """Ulysses: each rank of a group holds 1/n of every row's positions (padded to a multiple of n), the labels shifted
    on the whole row; the group's ranks take the same rows, so 2 ranks x (1 data-parallel x micro 4 x accumulation 2),
    4 ranks x (2 x 2 x 2) and 4 ranks x (1 x 4 x 2) all train on the global batches of one process x 8. DDP averages
    over every rank, a group's ranks hold parts of one gradient: the loss is scaled by the world, not the
    data-parallel size (with the data-parallel size: 0.055 off). sp4 splits the 4 query heads over 4 ranks and
    replicates the 2 key/value heads. The ring (cp2, dp2_cp2, fsdp2_dp2_cp2: context_parallel_size 2, under DDP and
    FSDP2) passes keys/values around instead, each rank a head and a tail chunk of the row padded to a multiple of 4.
    Evaluation runs whole rows on every rank: the same eval loss."""
    reference = tp_runs.get("one", None, 1, 8, 1, {})
    run = tp_runs.get(*SEQUENCE_RUNS[name])
    assert max_abs_diff(load_weights(os.path.join(reference, "final")), load_weights(os.path.join(run, "final"))) <= 1e-6
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    want = [json.loads(line) for line in open(os.path.join(reference, "metrics.jsonl"))]
    assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in want]  # each row counted once
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in want], rel=1e-6, abs=0)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in want], rel=1e-6, abs=0)
    evals, want_evals = ([(r["eval_tokens"], r["eval_loss"]) for r in m if "eval_loss" in r] for m in (rows, want))
    assert [t for t, _ in evals] == [t for t, _ in want_evals] and want_evals
    assert [v for _, v in evals] == pytest.approx([v for _, v in want_evals], rel=1e-6, abs=0)
    config = json.load(open(os.path.join(run, "final", "config.json")))  # the export loads anywhere: plain attention
    assert "toolkit_ulysses" not in json.dumps(config) and "toolkit_ring" not in json.dumps(config)


@pytest.fixture(scope="module")
def sft_runs(run_pool):
    return run_pool.modules[(__name__, "sft_runs")]


def _same_training(run: str, reference: str) -> None:
    """Final weights within 1e-6, the same tokens, losses and eval losses within 1e-6 relative."""
    assert max_abs_diff(load_weights(os.path.join(reference, "final")), load_weights(os.path.join(run, "final"))) <= 1e-6
    rows, want = ([json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))] for d in (run, reference))
    assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in want]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in want], rel=1e-6, abs=0)
    evals, want_evals = ([r["eval_loss"] for r in m if "eval_loss" in r] for m in (rows, want))
    assert want_evals and evals == pytest.approx(want_evals, rel=1e-6, abs=0)


@pytest.mark.parametrize("name", ["bfd_sp2", "bfd_dp2_sp2"])
def test_sequence_parallel_with_padding_free_packing_equals_one_process(tp_runs, name):
    """Padding-free packing (bfd: whole documents per row, each micro-batch one flattened row with positions
    restarting per document): each rank of a group finds the documents from the whole row's positions and attends
    block-causally after the all-to-all, so a document sees only itself, as in one process (which
    test_strategies.py proves equal to the same documents unpacked). Without the document mask: 0.014 off."""
    _same_training(tp_runs.get(*PACKED_RUNS[name]), tp_runs.get(*PACKED_RUNS["bfd_one"]))


def test_sequence_parallel_with_activation_checkpointing_and_lora_equals_one_process(tp_runs):
    """Activation checkpointing recomputes each layer in the backward, in training mode, so its attention splits
    again (and a packed row's documents are kept for it); LoRA's adapters (on the base's attention projections)
    train on the same gradients: both within 1e-6 of one process."""
    _same_training(tp_runs.get(*SWITCH_RUNS["sp2_checkpointing"]), tp_runs.get("one", None, 1, 8, 1, {}))

    def adapter(run) -> dict:
        from safetensors.torch import load_file

        return {k: v.double() for k, v in load_file(os.path.join(run, "final", "adapter_model.safetensors")).items()}

    lora, reference = (tp_runs.get(*SWITCH_RUNS[name]) for name in ("lora_sp2", "lora_one"))
    assert max_abs_diff(adapter(reference), adapter(lora)) <= 1e-6


def test_sequence_parallel_gpt2_and_chat_sft_equal_one_process(runs, sft_runs):
    """GPT-2 (2 heads, learned absolute positions: each rank's part gets its global position ids) on padded text, and
    chat SFT (the loss on the assistant's tokens only, padded chats; under Ulysses and under the ring), each on 2
    ranks as one group of 2 with accumulation 2, against one process x 8."""
    _same_training(runs.get("sp2_gpt2", None, 2, 4, 2, {"save_steps": None, "sequence_parallel_size": 2}),
                   runs.get("one", None, 1, 8, 1, {"save_steps": None}))
    for split in ({"sequence_parallel_size": 2}, CP2):  # chat SFT under Ulysses and under the ring
        _same_training(sft_runs.get("sp2" if split != CP2 else "cp2", None, 2, 4, 2, split),
                       sft_runs.get("one", None, 1, 8, 1, {}))


def test_sequence_parallel_adamw_with_clipping_and_resume_across_sizes(runs):
    """AdamW with clipping at 1.0 (the global norm: under FSDP2 over both ranks' shards), under DDP and FSDP2 on 2
    ranks as one group of 2 (and the ring on 2 under DDP), within 1e-5 of one process; a step-2 checkpoint resumes on
    another sequence-parallel size (2 -> one process, one process -> 2; the ring's 2 -> one process) in the same
    sample order and ends where the uninterrupted run does."""
    reference = runs.get("adamw_one", None, 1, 8, 1, SP_ADAMW)
    want = load_weights(os.path.join(reference, "final"))
    for name, (config, world, micro, accum, extra) in SP_ADAMW_RUNS.items():
        run = runs.get(name, config, world, micro, accum, extra)
        assert max_abs_diff(want, load_weights(os.path.join(run, "final"))) <= 1e-5, name
        norms = [r["grad_norm"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if "loss" in r]
        assert norms == pytest.approx([r["grad_norm"] for r in map(json.loads, open(
            os.path.join(reference, "metrics.jsonl"))) if "loss" in r], rel=1e-5), name
    for name, (config, world, micro, accum, extra, source) in SP_RESUMES.items():
        writer = runs.get(source, *((None, 1, 8, 1, SP_ADAMW) if source == "adamw_one" else SP_ADAMW_RUNS[source]))
        run = runs.get(name, config, world, micro, accum, extra, prepare=copy_checkpoint(writer, 2))
        assert max_abs_diff(want, load_weights(os.path.join(run, "final"))) <= 1e-5, name
        steps = [r["step"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if "loss" in r]
        assert steps == [3], name  # it went on from step 2


SP_REFUSALS = {  # case: (launch config, world, fields, task, the message's start)
    "zero2": ("zero2.yaml", 2, {}, "causal-lm", "sequence_parallel_size: sequence parallelism runs on ddp.yaml"),
    "zero3": ("zero3.yaml", 2, {}, "causal-lm", "sequence_parallel_size: sequence parallelism runs on ddp.yaml"),
    "fsdp1": ("fsdp1.yaml", 2, {}, "causal-lm", "sequence_parallel_size: sequence parallelism runs on ddp.yaml"),
    "tp": ("tp.yaml", 2, {}, "causal-lm", "sequence_parallel_size: sequence parallelism runs on ddp.yaml"),
    "hsdp": ("hsdp.yaml", 4, {}, "causal-lm", "sequence_parallel_size: sequence parallelism runs on ddp.yaml"),
    "pipeline": ("ddp.yaml", 4, {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}, "causal-lm",
                 "sequence_parallel_size: sequence parallelism (2) with pipeline parallelism (2)"),
    "world": ("ddp.yaml", 3, {}, "causal-lm", "sequence_parallel_size: 2 does not divide the 3 launched processes"),
    "heads": ("ddp.yaml", 3, {"sequence_parallel_size": 3}, "causal-lm",
              "sequence_parallel_size: Ulysses splits the attention heads over the group: the model's 4 query heads"),
    "dpo": ("ddp.yaml", 2, {}, "dpo", "sequence_parallel_size: the dpo task is not supported"),
    "classify": ("ddp.yaml", 2, {}, "sequence-classification",
                 "sequence_parallel_size: the sequence-classification task is not supported"),
    "grpo": ("ddp.yaml", 2, {"reward_funcs": "arithmetic_correct", "validation_file": None, "num_generations": 4,
                             "block_size": None, "per_device_eval_batch_size": None}, "grpo",
             "sequence_parallel_size: the grpo task"),
    "streaming": ("ddp.yaml", 2, {"streaming": True, "packing": True, "validation_file": None}, "causal-lm",
                  "streaming: is not supported under sequence parallelism yet"),
    "ulysses_and_ring": ("ddp.yaml", 2, CP2, "causal-lm", "context_parallel_size: ring attention (2) with Ulysses "
                                                          "(sequence_parallel_size 2) is not proven together"),
    "chunked_loss": ("ddp.yaml", 2, {"loss_chunk_size": 64}, "causal-lm", "loss_chunk_size: is not supported with "
                                                                          "sequence_parallel_size 2"),
    "eager": ("ddp.yaml", 2, {"attn_implementation": "eager"}, "causal-lm", "attn_implementation: sequence "
                                                                            "parallelism attends with torch's SDPA"),
    "muon": ("ddp.yaml", 2, {"optim": "muon"}, "causal-lm", "optim: optim muon with sequence_parallel_size 2 is not "
                                                            "proven yet"),
    "compile": ("ddp.yaml", 2, {"torch_compile": True}, "causal-lm", "torch_compile: torch_compile true with "
                                                                     "sequence_parallel_size 2 is not proven yet"),
    "async_save": ("ddp.yaml", 2, {"async_save": True}, "causal-lm", "async_save: async_save true with "
                                                                     "sequence_parallel_size 2 is not proven yet"),
}
RING = {"sequence_parallel_size": 1, "context_parallel_size": 2}
# the ring refuses what Ulysses refuses, naming its own field; and padding-free packing (its document mask would have
# to travel with the chunks: not built)
SP_REFUSALS.update({f"ring_{case}": (config, world, {**RING, **fields}, task, f"context_parallel_size: {words}")
                    for case, (config, world, fields, task, words) in {
                        "zero3": ("zero3.yaml", 2, {}, "causal-lm", "sequence parallelism runs on ddp.yaml"),
                        "tp": ("tp.yaml", 2, {}, "causal-lm", "sequence parallelism runs on ddp.yaml"),
                        "hsdp": ("hsdp.yaml", 4, {}, "causal-lm", "sequence parallelism runs on ddp.yaml"),
                        "pipeline": ("ddp.yaml", 4, {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
                                     "causal-lm", "sequence parallelism (2) with pipeline parallelism (2)"),
                        "dpo": ("ddp.yaml", 2, {}, "dpo", "the dpo task is not supported"),
                        "grpo": (*SP_REFUSALS["grpo"][:2], {**SP_REFUSALS["grpo"][2]}, "grpo", "the grpo task"),
                    }.items()})
SP_REFUSALS["ring_streaming"] = ("ddp.yaml", 2, {**RING, **SP_REFUSALS["streaming"][2]}, "causal-lm",
                                 "streaming: is not supported under sequence parallelism yet")
SP_REFUSALS["ring_bfd"] = ("ddp.yaml", 2, {**RING, **SP_BFD}, "causal-lm", "packing_strategy: bfd (padding-free "
                                                                          "packing) is not supported with "
                                                                          "context_parallel_size")


@pytest.mark.parametrize("case", list(SP_REFUSALS))
def test_sequence_parallel_refusals(tmp_path, tiny_llama, padded_data, case):
    """What sequence parallelism is not proven with is refused before the weights load, one line naming the field:
    ZeRO, FSDP1, TP, HSDP, pipelines, a world or a head count n does not divide, DPO, classification, GRPO, streaming,
    Ulysses and the ring together, the chunked loss, another attention than SDPA; the ring (context_parallel_size)
    refuses the same, naming its field, and padding-free packing. Checked in this
    process, in the environment accelerate's launcher gives the ranks (``toolkit.cli.train.check``)."""
    config, world, fields, task, words = SP_REFUSALS[case]
    cfg = {**COMMON, **padded_data, "save_steps": None, "model_name_or_path": tiny_llama,
           "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "sequence_parallel_size": 2,
           **fields}
    argv = args_from({k: v for k, v in cfg.items() if v is not None})
    with pytest.raises(ConfigError) as refused:
        toolkit_launch.check(task, os.path.join(CONFIGS, config), world, argv)
    assert f"config error: {refused.value}".startswith(f"config error: {words}")
    assert not os.path.exists(tmp_path / "out" / "final")

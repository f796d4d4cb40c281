"""The chat SFT and classification recipes, and LoRA, through real multi-process launches (tiny models).

- recipes/sft.py: 2 ranks x micro 2 x accumulation 2 end with the weights of 1 process x 8 (SGD, 1e-6): the loss is
  normalised by the assistant tokens of the whole global batch, whose count varies a lot from chat to chat; the same
  with whole chats packed (packing: true, bfd).
- recipes/dpo.py: the same equality for DPO pairs (the loss is the mean over every pair of the global batch) under DDP,
  ZeRO-2, ZeRO-3 and FSDP2, the held-out metrics with TRL's names; the live reference sharded like the policy and
  unchanged, the precomputed reference giving the same run (fp32, and bf16 under DDP and ZeRO-3) and kept in the run
  folder, LoRA DPO adapters equal, a resume bit-identical.
- recipes/sft.py with streaming: true on chats in 3 files: the same equality step by step, and the stream's step-2
  checkpoint of the 2-rank run resumed on 1 process ends as the uninterrupted runs do (the order's window and
  source position carried across world sizes).
- recipes/classify.py: the same equality for a classifier, and the validation metrics count each row once.
- LoRA (recipes/gpt2.py, use_peft): the adapters trained under ZeRO-2, ZeRO-3 and FSDP2 equal the DDP ones; the base weights
  come out bit-identical; the merged export's logits equal base + adapter; a LoRA run resumes bit-identically.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import (
    CONFIGS,
    ROOT,
    Runs,
    args_from,
    assert_plan_matches_held_bytes,
    copy_checkpoint,
    launch,
    load_weights,
    max_abs_diff,
    mixed_precision_env,
    read_probes,
)

from toolkit.cli import train as toolkit_launch
from toolkit.errors import ConfigError

pytestmark = pytest.mark.slow

SFT = os.path.join(ROOT, "recipes", "sft.py")
SGD = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant", weight_decay=0,
           max_steps=3, logging_steps=1, seed=7, report_to="none", shuffle=True, per_device_eval_batch_size=3)
ADAMW = dict(optim="adamw_torch", learning_rate=3e-3, max_grad_norm=1.0, lr_scheduler_type="linear", weight_decay=0.01,
             adam_epsilon=1e-6, max_steps=4, save_steps=2, logging_steps=1, seed=7, report_to="none", shuffle=True,
             per_device_eval_batch_size=3, packing=False, block_size=48)
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear",
            merge_lora=True)


def _run(script, out, cfg, world=1, config="ddp.yaml", micro=8, accum=1):
    args = args_from({**cfg, "output_dir": out, "per_device_train_batch_size": micro,
                      "gradient_accumulation_steps": accum})
    return launch(args, num_processes=world, config=config, script=script)


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------------ chat SFT
def test_sft_on_two_ranks_equals_one_process(tmp_path, tiny_model, chats):
    cfg = {**SGD, **chats, "model_name_or_path": tiny_model, "packing": False, "block_size": 64}
    one = _run(SFT, str(tmp_path / "one"), cfg)
    two = _run(SFT, str(tmp_path / "two"), cfg, world=2, micro=2, accum=2)
    diff = max_abs_diff(load_weights(str(tmp_path / "one" / "final")), load_weights(str(tmp_path / "two" / "final")))
    assert diff <= 1e-6, diff
    assert "--- before fine-tuning" in one.stdout and "--- after fine-tuning" in two.stdout
    assert os.path.isfile(str(tmp_path / "two" / "loss.png"))  # plot: true by default, drawn by rank 0
    evals = [r for r in _rows(str(tmp_path / "two")) if "eval_loss" in r]
    assert evals and all("perplexity" in r and r["loss_unit"] == "nats/token" for r in evals)
    assert "| global batch 8 sequences (padded, variable length) |" in two.stdout  # a chat is one sequence
    # What a user reads of a 2-rank DDP run: no DeepSpeed "Setting accelerator to CPU" on each rank, no raw escape
    # sequences (an export bar drawn under the open training bar moved the cursor up).
    console = two.stdout + two.stderr
    assert "Setting accelerator to CPU" not in console and "\x1b[" not in console


def test_sft_refuses_wrapped_packing_before_any_weights_load(tmp_path, tiny_model, chats):
    """packing: true packs whole chats (bfd, below); wrapped would let a chat attend to the one before it. Checked in
    this process: what recipes/sft.py checks before its weights load (``toolkit.cli.train.check``, as ``toolkit train``
    does; a recipe's config error as one line and exit 2: tests/launch/test_launcher_errors.py, test_battery.py)."""
    with pytest.raises(ConfigError) as refused:
        toolkit_launch.check("chat-sft", os.path.join(CONFIGS, "ddp.yaml"), 1, args_from(
            {**SGD, **chats, "model_name_or_path": tiny_model, "output_dir": str(tmp_path / "p"), "packing": True,
             "packing_strategy": "wrapped"}))
    assert str(refused.value).startswith("packing_strategy: chat SFT packs whole chats only")
    assert not os.path.exists(tmp_path / "p")


def _sft_bfd(model, chats) -> dict:
    return {**SGD, **chats, "model_name_or_path": model, "packing": True, "block_size": 256}


def test_sft_bfd_packing_on_two_ranks_equals_one_process(runs, gpt2_256, chats):
    """recipes/sft.py --packing true: whole chats packed best-fit decreasing, each with its assistant-only mask and
    its own positions; 2 ranks x 2 x 2 end with the weights of 1 process x 8 (SGD, 1e-6)."""
    one, two = _two_ranks_equal_one_process(runs, "sft_bfd", _sft_bfd(gpt2_256, chats), gpt2_256, moved=1e-2)
    summary = json.load(open(os.path.join(two, "summary.json")))
    assert summary["train_rows"] < 32 / 2 and summary["fill_rate"] > 0.8, summary  # 32 chats, several per row


def _sft_mixture(model, chat_mixture) -> dict:
    return {**SGD, **chat_mixture, "model_name_or_path": model, "packing": False, "block_size": 128}


def test_sft_on_a_mixture_of_an_alpaca_and_a_messages_file_on_two_ranks_equals_one_process(runs, gpt2_256,
                                                                                            chat_mixture):
    """recipes/sft.py with dataset_mixture (conftest's chat_mixture: 18 of 24 Alpaca rows, 16 of 32 chats, a tenth
    held out): 2 ranks x 2 x 2 end with the weights of 1 process x 8 (SGD, 1e-6), and summary.json records the rows
    each set gave."""
    one, two = _two_ranks_equal_one_process(runs, "sft_mixture", _sft_mixture(gpt2_256, chat_mixture), gpt2_256,
                                            moved=1e-2)
    for run in (one, two):
        mixture = json.load(open(os.path.join(run, "summary.json")))["dataset_mixture"]
        assert [(d["format"], d["rows"], d["of"]) for d in mixture["datasets"]] == [("alpaca", 18, 24),
                                                                                    ("messages", 16, 32)]
        assert (mixture["train_rows"], mixture["validation_rows"]) == (30, 4)
    assert any("eval_loss" in r for r in _rows(two))


def _sft_stream(model, chat_shards) -> dict:
    """3 steps of 8 chats from windows of 10 (windows straddle steps and files); a checkpoint every step; the first
    4 held-out chats (max_eval_samples: the stream's first rows)."""
    return {**SGD, **chat_shards, "model_name_or_path": model, "streaming": True, "shuffle_buffer_size": 10,
            "packing": True, "block_size": 256, "save_steps": 1, "max_eval_samples": 4}


def test_sft_on_a_stream_of_files_on_two_ranks_equals_one_process_and_resumes_on_one(runs, gpt2_256, chat_shards):
    """recipes/sft.py --streaming true on 3 files: 2 ranks x 2 x 2 (each rank tokenizing its own chats, packed bfd
    per micro-batch) end with the weights of 1 process x 8 (SGD, 1e-6), the same loss and tokens at every step; the
    2-rank run's step-2 checkpoint (mid-window: g = 16 of a window 10..19) resumed on 1 process takes the same rows
    (the same tokens at step 3) and ends there too."""
    cfg = _sft_stream(gpt2_256, chat_shards)
    one, two = _two_ranks_equal_one_process(runs, "sft_stream", cfg, gpt2_256, moved=1e-2)
    tokens = {run: [(r["step"], r["tokens_seen"]) for r in _rows(run) if "loss" in r] for run in (one, two)}
    assert tokens[one] == tokens[two] and len(tokens[one]) == 3
    resumed = runs.get("sft_stream_resumed", "ddp.yaml", 1, 8, 1, {**cfg, "resume_from_checkpoint": "latest"},
                       prepare=copy_checkpoint(two, 2))
    state = json.load(open(os.path.join(two, "checkpoints", "step-2", "toolkit_state.json")))
    assert state["loop"]["stream"]["window"] == 1 and state["order"]["shuffle_buffer_size"] == 10
    assert [(r["step"], r["tokens_seen"]) for r in _rows(resumed) if "loss" in r] == tokens[one][2:]
    diff = max_abs_diff(load_weights(os.path.join(resumed, "final")), load_weights(os.path.join(one, "final")))
    assert diff <= 1e-6, diff
    assert [r["eval_tokens"] for r in _rows(two) if "eval_loss" in r] == [r["eval_tokens"] for r in _rows(one)
                                                                          if "eval_loss" in r]


def _two_ranks_equal_one_process(runs, name: str, cfg: dict, start: str, moved: float,
                                 loss_rel: float = 1e-6) -> tuple[str, str]:
    """The planned runs ``<name>_one`` (1 process x 8) and ``<name>_two`` (2 ranks x 2 x accumulation 2): the first
    trained (its weights moved more than ``moved`` from ``start``'s), both end within 1e-6 of each other, with the
    same step losses (within ``loss_rel``). Their output folders."""
    one = runs.get(f"{name}_one", "ddp.yaml", 1, 8, 1, cfg)
    two = runs.get(f"{name}_two", "ddp.yaml", 2, 2, 2, cfg)
    assert max_abs_diff(load_weights(os.path.join(one, "final")), load_weights(start)) > moved, "it must train"
    diff = max_abs_diff(load_weights(os.path.join(one, "final")), load_weights(os.path.join(two, "final")))
    assert diff <= 1e-6, diff
    assert [r["loss"] for r in _rows(two) if "loss" in r] == pytest.approx([r["loss"] for r in _rows(one) if "loss" in r],
                                                                           rel=loss_rel)
    return one, two


# ----------------------------------------------------------------------------------------------------- DPO
def _dpo(model, pairs) -> dict:
    return {**SGD, **pairs, "model_name_or_path": model, "packing": False, "block_size": 256, "learning_rate": 0.1,
            "eval_on_start": True, "save_steps": 2}


def _dpo_precomputed(model, pairs) -> dict:
    return {**_dpo(model, pairs), "precompute_ref_log_probs": True}


def _dpo_lora(model, pairs) -> dict:
    """DPO's LoRA runs, without evaluation (the adapters are what they compare)."""
    return {**_dpo(model, pairs), **LORA, "merge_lora": False, "learning_rate": 0.5, "validation_file": None,
            "eval_on_start": False, "save_steps": None}


DPO_STRATEGIES = ("zero2", "zero3", "fsdp")  # beside DDP
DPO_LORA_STRATEGIES = ("ddp", "zero3", "fsdp")


def _reference(run) -> dict:
    return json.load(open(os.path.join(run, "summary.json")))["reference"]


def _assert_reference_unchanged(run, kind: str, sharded: bool, whole: int | None = None) -> int:
    """The run's reference (summary.json) is of ``kind`` and each rank's frozen weights hash the same at the end as
    at the start; ``sharded``: the ranks hold different halves (fewer than ``whole`` elements each), else the same
    whole copy. Returns the elements rank 0 holds."""
    reference = _reference(run)
    ranks = reference["ranks"]
    assert reference["kind"] == kind and len(ranks) == 2, reference
    assert all(r["start"] == r["end"] for r in ranks), ranks
    if sharded:
        assert ranks[0]["start"] != ranks[1]["start"] and max(r["numel"] for r in ranks) < 0.51 * whole, ranks
    else:
        assert ranks[0] == ranks[1], ranks
    return ranks[0]["numel"]


def test_dpo_on_two_ranks_equals_one_process(runs, gpt2_256, pairs):
    """recipes/dpo.py: 2 ranks x 2 pairs x accumulation 2 end with the weights of 1 process x 8 pairs (SGD, 1e-6):
    each micro-step's summed pair losses are divided by the global batch's pairs; the held-out metrics (TRL's names)
    start at the reference (loss log 2, rewards 0) and count each of the 7 pairs once."""
    # The live reference's log-probs come from each micro-batch's own forward (other shapes on 1 and 2 ranks): a
    # summed log-prob of about -500 has an fp32 spacing of 3e-5, so the step losses agree to 1.6e-6 relative.
    one, two = _two_ranks_equal_one_process(runs, "dpo", _dpo(gpt2_256, pairs), gpt2_256, moved=1e-3, loss_rel=5e-6)
    evals = {run: [r for r in _rows(run) if "eval_loss" in r] for run in (one, two)}
    start, end = evals[two][0], evals[two][-1]
    assert start["eval_loss"] == pytest.approx(0.6931472, abs=1e-6) and start["eval_rewards/margins"] == 0.0
    assert [r["eval_pairs"] for r in evals[two]] == [7, 7] and end["eval_rewards/margins"] != 0.0
    # A reward is beta x (a summed log-prob of about -500, whose fp32 spacing is 3e-5, minus the reference's): the
    # two runs' forwards differ in batch shape, so rewards agree to a few 1e-6, log-probs to 1e-5 relative.
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies",
                "eval_rewards/margins"):
        assert [r[key] for r in evals[two]] == pytest.approx([r[key] for r in evals[one]], abs=1e-5), key
    for key in ("eval_logps/chosen", "eval_logps/rejected"):
        assert [r[key] for r in evals[two]] == pytest.approx([r[key] for r in evals[one]], rel=1e-5), key
    for key in ("eval_logits/chosen", "eval_logits/rejected"):  # token-weighted over all 7 pairs, whichever rank held them
        assert [r[key] for r in evals[two]] == pytest.approx([r[key] for r in evals[one]], rel=1e-4), key


def test_dpo_metrics_reach_the_summary_and_the_report(runs, gpt2_256, pairs):
    """On the finished 2-rank DPO run: metrics.jsonl's evaluations carry TRL's metric names; summary.json has the
    last one's eval_rewards/accuracies and eval_rewards/margins; ``toolkit report`` shows both first -> last."""
    from toolkit.reporting.report import load_run, summarize, table

    two = runs.get("dpo_two", "ddp.yaml", 2, 2, 2, _dpo(gpt2_256, pairs))
    evals = [r for r in _rows(two) if "eval_loss" in r]
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected")
    # TRL's evaluation names (eval_ before each), never the bare names of its training rows
    assert len(evals) == 2 and all(f"eval_{name}" in r and name not in r for r in evals for name in names)
    summary = json.load(open(os.path.join(two, "summary.json")))
    assert summary["eval_rewards/accuracies"] == evals[-1]["eval_rewards/accuracies"]
    assert summary["eval_rewards/margins"] == evals[-1]["eval_rewards/margins"] != 0.0
    # the best eval loss once prefixed, and the loss rows name DPO's unit (loss.png's axis: per pair, not per token)
    assert summary["best_eval_loss"] == min(r["eval_loss"] for r in evals) and "best_eval_eval_loss" not in summary
    assert {r["loss_unit"] for r in _rows(two) if "loss" in r or "eval_loss" in r} == {"per pair"}
    s = summarize(load_run(two))
    assert (s["first_reward_margin"], s["final_reward_margin"]) == (0.0, evals[-1]["eval_rewards/margins"])
    assert (s["first_reward_accuracy"], s["final_reward_accuracy"]) == (0.0, evals[-1]["eval_rewards/accuracies"])
    line = next(" ".join(x.split()) for x in table([s]).splitlines() if x.startswith("eval reward margin"))
    assert line == f"eval reward margin first -> last (DPO) 0.0000 -> {evals[-1]['eval_rewards/margins']:.4f}", line


@pytest.mark.parametrize("strategy", DPO_STRATEGIES)
def test_dpo_under_zero2_zero3_and_fsdp2_equals_one_process(runs, gpt2_256, pairs, strategy):
    """The same 2 x 2 x 2 DPO run under ZeRO-2, and with the policy sharded (ZeRO-3, FSDP2): its live reference
    is sharded as the policy is (each rank holds half of it: summary.json), never changes (each rank's shard hashes
    the same at the end), and the run ends with the weights of 1 process x 8 (SGD, 1e-6)."""
    cfg = _dpo(gpt2_256, pairs)
    one = runs.get("dpo_one", "ddp.yaml", 1, 8, 1, cfg)
    run = runs.get(f"dpo_{strategy}", f"{strategy}.yaml", 2, 2, 2, cfg)
    diff = max_abs_diff(load_weights(os.path.join(one, "final")), load_weights(os.path.join(run, "final")))
    assert diff <= 1e-6, diff
    start = [r for r in _rows(run) if "eval_loss" in r][0]
    assert start["eval_loss"] == pytest.approx(0.6931472, abs=1e-6) and start["eval_pairs"] == 7
    whole = _assert_reference_unchanged(runs.get("dpo_two", "ddp.yaml", 2, 2, 2, cfg), "live", sharded=False)
    _assert_reference_unchanged(run, "live", sharded=strategy != "zero2", whole=whole)


# The live run, its precomputed twin, how close their final weights must be, and (bf16) the fp32 live run it must
# differ from: fp32 exact to 1e-6 (DDP, and ZeRO-3 with the policy and the live reference sharded); under bf16 mixed
# precision 1e-5. DDP autocasts (CPU autocast gives a row the same logits whatever batch it is in): so does the
# precomputed pass, without which these two runs ended 1.2e-4 apart (measured 2026-12-06). DeepSpeed does not
# autocast but runs the weights in bf16: so does the precomputed copy.
PRECOMPUTED = {"ddp": ("dpo_two", 1e-6, None), "zero3": ("dpo_zero3", 1e-6, None),
               "ddp_bf16": ("dpo_bf16", 1e-5, "dpo_two"), "zero3_bf16": ("dpo_bf16_zero3", 1e-5, "dpo_zero3")}


@pytest.mark.parametrize("strategy", list(PRECOMPUTED))
def test_dpo_precomputed_reference_equals_the_live_one(runs, gpt2_256, pairs, strategy):
    """precompute_ref_log_probs: true (one pass of a whole copy on the device before training, each rank its share
    of the pairs, under the run's precision) ends with the weights of the live reference's run (PRECOMPUTED's
    tolerances); the values are kept in the run folder, one file of every pair's two log-probs."""
    from safetensors.torch import load_file

    from toolkit import layout

    name, tolerance, fp32_twin = PRECOMPUTED[strategy]
    config = runs.planned[name]["config"]
    live = runs.get(name, config, 2, 2, 2, _dpo(gpt2_256, pairs))
    pre = runs.get(f"{name}_precomputed", config, 2, 2, 2, _dpo_precomputed(gpt2_256, pairs))
    assert _reference(pre) == {"kind": "precomputed"} and _reference(live)["kind"] == "live"
    diff = max_abs_diff(load_weights(os.path.join(live, "final")), load_weights(os.path.join(pre, "final")))
    print(f"precomputed vs live reference ({strategy}): final weights {diff:.2e} apart")
    assert diff <= tolerance, diff
    evals = {run: [r for r in _rows(run) if "eval_loss" in r] for run in (live, pre)}
    assert [r["eval_rewards/margins"] for r in evals[pre]] == pytest.approx(
        [r["eval_rewards/margins"] for r in evals[live]], abs=1e-5)
    folder = os.path.join(pre, layout.REFERENCE_LOGPS)
    (kept,) = os.listdir(folder)
    values = load_file(os.path.join(folder, kept))
    counts = {split: sum(1 for _ in open(pairs[f"{split}_file"])) for split in ("train", "validation")}
    assert {k: len(v) for k, v in values.items()} == {f"{split}/{column}": counts[split] for split in counts
                                                      for column in ("ref_chosen_logps", "ref_rejected_logps")}
    if fp32_twin:  # bf16 ran: the run ends away from the fp32 one
        fp32 = runs.get(fp32_twin, runs.planned[fp32_twin]["config"], 2, 2, 2, _dpo(gpt2_256, pairs))
        assert max_abs_diff(load_weights(os.path.join(fp32, "final")), load_weights(os.path.join(live, "final"))) > 1e-4


def test_dpo_resumes_bit_identically(runs, gpt2_256, pairs):
    """A DPO run resumed from its step-2 checkpoint (2 ranks, DDP, live reference loaded again from the starting
    weights) ends bit-identical to the uninterrupted run."""
    cfg = _dpo(gpt2_256, pairs)
    straight = runs.get("dpo_two", "ddp.yaml", 2, 2, 2, cfg)
    resumed = runs.get("dpo_resumed", "ddp.yaml", 2, 2, 2, {**cfg, "resume_from_checkpoint": "latest"},
                       prepare=copy_checkpoint(straight, 2))
    assert [r["step"] for r in _rows(resumed) if "loss" in r] == [3]  # it went on from step 2
    assert max_abs_diff(load_weights(os.path.join(straight, "final")), load_weights(os.path.join(resumed, "final"))) == 0.0


def test_dpo_lora_adapters_on_two_ranks_equal_one_process(runs, gpt2_256, pairs):
    """LoRA DPO: the reference is the base with the adapter disabled (no copy; its frozen weights unchanged on every
    rank, sharded under ZeRO-3 and FSDP2); 2 ranks x 2 x 2 under DDP, ZeRO-3 and FSDP2 train the adapters of 1 process
    x 8 (SGD, 1e-6)."""
    cfg = _dpo_lora(gpt2_256, pairs)
    one = _adapter(runs.get("dpo_lora_one", "ddp.yaml", 1, 8, 1, cfg))
    assert max(float(v.abs().max()) for k, v in one.items() if "lora_B" in k) > 1e-3  # B starts at 0: it trained
    whole = None
    for strategy in DPO_LORA_STRATEGIES:
        run = runs.get(f"dpo_lora_{strategy}", f"{strategy}.yaml", 2, 2, 2, cfg)
        assert max_abs_diff(one, _adapter(run)) <= 1e-6, strategy
        numel = _assert_reference_unchanged(run, "adapter", sharded=strategy != "ddp", whole=whole)
        whole = whole or numel


# ------------------------------------------------------------------------------------------ classification
CLASSIFY_DATA = dict(dataset_name="stdlib-docstrings", max_train_samples=48, max_eval_samples=17, packing=False,
                     block_size=64)


def _classify(tiny_bert, classify_files) -> dict:
    return {**SGD, **classify_files, "packing": False, "block_size": 64, "model_name_or_path": tiny_bert,
            "learning_rate": 0.2, "eval_on_start": True}


def _classify_lora(tiny_bert) -> dict:
    return {**SGD, **CLASSIFY_DATA, **LORA, "model_name_or_path": tiny_bert, "learning_rate": 0.2, "merge_lora": False}


def _lora(tiny_model, padded_data) -> dict:
    return {**ADAMW, **LORA, **padded_data, "model_name_or_path": tiny_model}


def plan_runs(pool, tmp_path_factory, tiny_model, tiny_bert, padded_data, classify_files, gpt2_256, chats, pairs,
              chat_shards, chat_mixture):
    """The classifier, chat SFT with bfd packing, DPO and LoRA runs below, planned: those of one launch config and world
    size share a launch (helpers.Runs.plan; each run its own recipe: recipes/classify.py, recipes/sft.py, recipes/dpo.py, or
    recipes/gpt2.py with or without the probes)."""
    r = Runs(tmp_path_factory.mktemp("recipes"), None, {}, {}, pool=pool)
    cfg = _classify(tiny_bert, classify_files)
    r.plan("classify_one", "ddp.yaml", 1, 8, 1, cfg, recipe="classify", probe=False)
    r.plan("sft_bfd_one", "ddp.yaml", 1, 8, 1, _sft_bfd(gpt2_256, chats), recipe="sft", probe=False)
    r.plan("sft_bfd_two", "ddp.yaml", 2, 2, 2, _sft_bfd(gpt2_256, chats), recipe="sft", probe=False)
    r.plan("sft_mixture_one", "ddp.yaml", 1, 8, 1, _sft_mixture(gpt2_256, chat_mixture), recipe="sft", probe=False)
    r.plan("sft_mixture_two", "ddp.yaml", 2, 2, 2, _sft_mixture(gpt2_256, chat_mixture), recipe="sft", probe=False)
    stream = _sft_stream(gpt2_256, chat_shards)
    r.plan("sft_stream_one", "ddp.yaml", 1, 8, 1, stream, recipe="sft", probe=False)
    r.plan("sft_stream_two", "ddp.yaml", 2, 2, 2, stream, recipe="sft", probe=False)
    r.plan("sft_stream_resumed", "ddp.yaml", 1, 8, 1, {**stream, "resume_from_checkpoint": "latest"},
           copy_from=("sft_stream_two", 2), recipe="sft", probe=False)  # another world size, no launch of its own
    dpo, dpo_lora = _dpo(gpt2_256, pairs), _dpo_lora(gpt2_256, pairs)
    r.plan("dpo_one", "ddp.yaml", 1, 8, 1, dpo, recipe="dpo", probe=False)
    r.plan("dpo_lora_one", "ddp.yaml", 1, 8, 1, dpo_lora, recipe="dpo", probe=False)
    r.plan("dpo_two", "ddp.yaml", 2, 2, 2, dpo, recipe="dpo", probe=False)
    r.plan("dpo_resumed", "ddp.yaml", 2, 2, 2, {**dpo, "resume_from_checkpoint": "latest"}, copy_from=("dpo_two", 2),
           recipe="dpo", probe=False)
    for strategy in DPO_STRATEGIES:  # joining the LoRA and classifier launches of those configs
        r.plan(f"dpo_{strategy}", f"{strategy}.yaml", 2, 2, 2, dpo, recipe="dpo", probe=False)
    # bf16: what `accelerate launch --mixed_precision bf16` adds to the launch config's environment, set for these
    # runs inside the shared DDP and ZeRO-3 launches (as the matrix's bf16 cells are), not a launch of their own each
    bf16 = {config: {"env": mixed_precision_env(config, 2)} for config in ("ddp.yaml", "zero3.yaml")}
    r.plan("dpo_bf16", "ddp.yaml", 2, 2, 2, dpo, recipe="dpo", probe=False, options=bf16["ddp.yaml"])
    r.plan("dpo_bf16_zero3", "zero3.yaml", 2, 2, 2, dpo, recipe="dpo", probe=False, options=bf16["zero3.yaml"])
    for name in ("dpo_two", "dpo_zero3", "dpo_bf16", "dpo_bf16_zero3"):
        r.plan(f"{name}_precomputed", r.planned[name]["config"], 2, 2, 2, _dpo_precomputed(gpt2_256, pairs),
               recipe="dpo", probe=False, options=bf16.get(r.planned[name]["config"]) if "bf16" in name else None)
    for strategy in DPO_LORA_STRATEGIES:
        r.plan(f"dpo_lora_{strategy}", f"{strategy}.yaml", 2, 2, 2, dpo_lora, recipe="dpo", probe=False)
    r.plan("classify_two", "fsdp.yaml", 2, 2, 2, cfg, recipe="classify", probe=False)
    for config in ("ddp.yaml", "fsdp.yaml"):
        r.plan(f"classify_lora_{config}", config, 2, 2, 2, _classify_lora(tiny_bert), recipe="classify", probe=False)
    for name in LORA_STRATEGIES:
        r.plan(f"lora_{name}", f"{name}.yaml", 2, 2, 2, _lora(tiny_model, padded_data))
    r.plan("lora_resumed", "ddp.yaml", 2, 2, 2, {**_lora(tiny_model, padded_data), "resume_from_checkpoint": "latest"},
           copy_from=("lora_ddp", 2), probe=False)  # recipes/gpt2.py itself
    return {"runs": r}


@pytest.fixture(scope="module")
def runs(run_pool):
    return run_pool.modules[(__name__, "runs")]


def test_classifier_on_two_ranks_equals_one_process_and_counts_each_row_once(runs, tiny_bert, classify_files):
    # The two ranks run under FSDP2: BERT's _no_split_modules names BertEmbeddings, which made accelerate's
    # fully_shard of the word embeddings fail (distributed.keep_embeddings_out_of_fsdp_units).
    cfg = _classify(tiny_bert, classify_files)
    dirs = {"one": runs.get("classify_one", "ddp.yaml", 1, 8, 1, cfg),
            "two": runs.get("classify_two", "fsdp.yaml", 2, 2, 2, cfg)}
    diff = max_abs_diff(load_weights(os.path.join(dirs["one"], "final")), load_weights(os.path.join(dirs["two"], "final")))
    assert diff <= 1e-6, diff
    labels = [json.loads(line)["label"] for line in open(classify_files["validation_file"])]
    assert len(labels) == 17 and len(set(labels)) == 6
    one, two = ([r for r in _rows(dirs[run]) if "eval_loss" in r] for run in ("one", "two"))
    # 17 rows over 2 ranks in batches of 3: accelerate pads the last batch; gather_for_metrics drops the repeats
    assert [r["eval_samples"] for r in one] == [r["eval_samples"] for r in two] == [17, 17]
    # each row once, with its own label: the same predictions score the same (weights within 1e-6)
    assert [(r["accuracy"], r["macro_f1"]) for r in two] == [(r["accuracy"], r["macro_f1"]) for r in one]
    assert [r["eval_loss"] for r in two] == pytest.approx([r["eval_loss"] for r in one], rel=1e-6, abs=0)
    # a classifier's loss is per example (loss.png's axis), and its summary's best is the accuracy, prefixed once
    assert {r["loss_unit"] for r in _rows(dirs["two"]) if "loss" in r or "eval_loss" in r} == {"nats/example"}
    summary = json.load(open(os.path.join(dirs["two"], "summary.json")))
    assert summary["best_eval_accuracy"] == max(r["accuracy"] for r in two)
    with open(os.path.join(dirs["two"], "final", "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["BertForSequenceClassification"] and len(config["id2label"]) == 6


def test_classifier_lora_under_fsdp_equals_ddp(runs, tiny_bert):
    cfg = _classify_lora(tiny_bert)
    dirs = {config: runs.get(f"classify_lora_{config}", config, 2, 2, 2, cfg) for config in ("ddp.yaml", "fsdp.yaml")}
    ddp, fsdp = _adapter(dirs["ddp.yaml"]), _adapter(dirs["fsdp.yaml"])
    assert any("lora_B" in k for k in ddp) and any("classifier" in k for k in ddp)  # the new head trains in full
    assert max_abs_diff(ddp, fsdp) <= 1e-6


# ---------------------------------------------------------------------------------------------------- LoRA
LORA_STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")


@pytest.fixture(scope="module")
def lora_runs(runs, tiny_model, padded_data):
    """The same LoRA job under DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 ranks x 2 x 2; through probe_run.py, which records
    the bytes each rank holds), and DDP resumed from its step-2 checkpoint (recipes/gpt2.py)."""
    cfg = _lora(tiny_model, padded_data)
    out = {name: runs.get(f"lora_{name}", f"{name}.yaml", 2, 2, 2, cfg) for name in LORA_STRATEGIES}
    out["resumed"] = runs.get("lora_resumed", "ddp.yaml", 2, 2, 2, {**cfg, "resume_from_checkpoint": "latest"},
                              prepare=copy_checkpoint(out["ddp"], 2))
    return out


def _adapter(run):
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(os.path.join(run, "final", "adapter_model.safetensors")).items()}


def test_lora_adapters_are_the_same_under_every_strategy(lora_runs):
    ddp = _adapter(lora_runs["ddp"])
    assert ddp and all("lora_" in k for k in ddp)
    assert max(float(v.abs().max()) for k, v in ddp.items() if "lora_B" in k) > 0  # B starts at 0: it trained
    for name in ("zero2", "zero3", "fsdp"):
        assert max_abs_diff(ddp, _adapter(lora_runs[name])) <= 1e-5, name


@pytest.mark.parametrize("strategy, name", [("ddp", "DDP"), ("zero2", "ZeRO-2"), ("zero3", "ZeRO-3"), ("fsdp", "FSDP2")])
def test_plan_predicts_the_lora_states_each_rank_holds(lora_runs, tiny_model, strategy, name):
    # With LoRA (r=4 on every linear layer) the optimizer state is the adapters' alone: a few KB against MBs of
    # weights, so each part is compared on its own (test_strategies.py has the full fine-tuning case).
    assert_plan_matches_held_bytes(read_probes(lora_runs[strategy]), tiny_model, name, lora_r=4,
                                   lora_target_modules=[LORA["lora_target_modules"]])


def test_lora_leaves_the_base_weights_bit_identical(lora_runs, tiny_model):
    base = load_weights(tiny_model)
    trained = load_weights(os.path.join(lora_runs["ddp"], "checkpoints", "step-4"))
    kept = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in trained.items()
            if "lora_" not in k}
    assert set(base) <= set(kept)
    assert all(torch.equal(base[k], kept[k]) for k in base)


def test_lora_merged_export_equals_base_plus_adapter(lora_runs, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.arange(100, 124).view(2, 12)
    final = os.path.join(lora_runs["ddp"], "final")
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), final).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(final, "merged")).eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model).eval()(ids).logits
    assert float((adapted - merged).abs().max()) <= 1e-5
    assert float((adapted - plain).abs().max()) > 1e-4  # the adapter changed the model


def test_lora_run_resumes_bit_identically(lora_runs):
    assert max_abs_diff(_adapter(lora_runs["ddp"]), _adapter(lora_runs["resumed"])) == 0.0

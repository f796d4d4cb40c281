"""The DPO task (toolkit/tasks/dpo.py) in process: which tokens are a completion's, a pair kept in one micro-batch,
and TRL 1.16's ``DPOTrainer`` as the oracle of the first step's loss and gradients.

- Equal-sized micro-batches (2 x 2 pairs): our step's loss and gradients equal TRL's within 1e-6 (fp32, one process).
- Unequal micro-batches (1 + 3 pairs): ours equal the mean over the global batch's 4 pairs (what one micro-batch of
  4 gives); TRL's are a mean of the two micro-batch means, which differs (both numbers in the assertion messages).
"""

from __future__ import annotations

import math

import pytest
import torch

# Text pairs of different completion lengths; each completion starts with a space and no prompt ends with one, so
# the prompt's tokens are the same alone and followed by the completion (TRL tokenizes the prompt alone).
PAIRS = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " a large city somewhere in Europe."},
    {"prompt": "Two plus two equals", "chosen": " four, as everyone learns at school.", "rejected": " five."},
    {"prompt": "Water boils at", "chosen": " one hundred degrees Celsius at sea level.", "rejected": " noon."},
    {"prompt": "The sky is", "chosen": " blue", "rejected": " made of green cheese and old socks, they say."},
]
BETA = 0.1


@pytest.fixture()
def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _model(tiny_model):
    from transformers import AutoModelForCausalLM

    from toolkit.models.loading import disable_dropout

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    disable_dropout(model)  # TRL's disable_dropout too: both sides deterministic
    return model


def _reference(tiny_model):
    """A reference other than the starting weights (each weight moved by seeded noise), so that the first step's
    losses are not all log 2 and a mean of micro-batch means shows in the loss, not only in the gradients."""
    model = _model(tiny_model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p += 0.2 * torch.randn(p.shape, generator=generator)
    return model


def _our_rows(tokenizer, ref, loss_type: str = "sigmoid"):
    """The pairs tokenized by the task, with ``ref``'s log-probs (what precompute_reference gives the recipe)."""
    from datasets import Dataset, DatasetDict

    from toolkit.config import DataArguments
    from toolkit.tasks.dpo import DPO, tokenize_pairs

    task = DPO()
    task.beta, task.loss_type = BETA, loss_type
    raw = DatasetDict({"train": Dataset.from_list(PAIRS)})
    rows = tokenize_pairs(raw, tokenizer, DataArguments(dataset_name="x"), block_size=64)["train"]
    rows = task.precompute_reference(ref, {"train": rows}, 4, tokenizer.pad_token_id)["train"]
    return task, rows


def _our_step(task, rows, model, splits, tokenizer):
    """One step of toolkit.training.loop.train_step over micro-batches of ``splits`` pairs each; returns (step loss: mean over the pairs, {name: grad})."""
    from accelerate import Accelerator
    from transformers import get_scheduler

    from toolkit.training.loop import train_step

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(splits))
    collate, at, micro = task.collator(tokenizer), 0, []
    for n in splits:
        micro.append(collate([rows[i] for i in range(at, at + n)]))
        at += n
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = get_scheduler("constant", optimizer)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    grads = {}

    def keep_grads(index):  # after the last backward, before the optimizer step clears them
        if index == len(splits) - 1:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    result = train_step(accelerator, model, optimizer, scheduler, micro, step=0, data_parallel_size=1,
                        max_grad_norm=0.0, task=task, after_backward=keep_grads)
    return float(result.loss_sum) / result.targets, grads


def _trl_step(tiny_model, tokenizer, splits, tmp_path, loss_type: str = "sigmoid", logged: dict | None = None):
    """TRL's DPOTrainer: its own tokenization and collator, ``training_step`` per micro-batch in the pairs' order
    (what its train loop calls); returns (step loss as TRL logs it: the sum of the scaled micro-batch losses,
    {name: grad}); ``logged`` gets the metrics it logged, a list per name (one value a micro-batch)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=max(splits), gradient_accumulation_steps=len(splits), beta=BETA,
                     loss_type=loss_type, max_length=None, report_to="none", learning_rate=0.0, seed=0,
                     disable_dropout=True)
    model, ref = _model(tiny_model), _reference(tiny_model)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(PAIRS),
                         processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = len(splits)  # set by its train loop from the step's micro-batches
    model.train()
    rows, at, loss = trainer.train_dataset, 0, 0.0
    for n in splits:
        inputs = trainer._prepare_inputs(trainer.data_collator([rows[i] for i in range(at, at + n)]))
        loss += float(trainer.training_step(model, inputs))
        at += n
    if logged is not None:
        logged.update(trainer._metrics["train"])
    return loss, {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_text_completion_targets_are_its_tokens_and_eos(tiny_model):
    from toolkit.data.chat import tokenize_completion
    from toolkit.loss import IGNORE_INDEX

    tokenizer = _tokenizer(tiny_model)
    ids, labels = tokenize_completion(tokenizer, "The sky is", " blue", "row 0")
    assert ids == tokenizer("The sky is blue")["input_ids"] + [tokenizer.eos_token_id]
    targets = [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert targets == tokenizer(" blue")["input_ids"] + [tokenizer.eos_token_id]


def test_conversational_completion_targets_only_the_completions_turn(tiny_model):
    """An assistant turn inside a multi-turn prompt is context, not a target: only the completion's turn is."""
    from toolkit.data.chat import set_chat_template, tokenize_completion
    from toolkit.loss import IGNORE_INDEX

    tokenizer = _tokenizer(tiny_model)
    set_chat_template(tokenizer, "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
              {"role": "user", "content": "Name a colour"}]
    ids, labels = tokenize_completion(tokenizer, prompt, [{"role": "assistant", "content": "Red"}], "row 0")
    assert tokenizer.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX]) == "Red<|endoftext|>"


def test_an_empty_completion_is_refused(tiny_model):
    from toolkit.data.chat import tokenize_completion
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="row 3, rejected: the completion is empty"):
        tokenize_completion(_tokenizer(tiny_model), "The sky is", " ", "row 3, rejected")


def test_a_pair_is_one_row_of_a_micro_batch(tiny_model):
    """The collator puts a pair's chosen and rejected sequences in the same micro-batch (chosen rows first) and
    counts pairs as the targets the loss is normalised by."""
    tokenizer = _tokenizer(tiny_model)
    task, rows = _our_rows(tokenizer, _reference(tiny_model))
    batch = task.collator(tokenizer)([rows[0], rows[1], rows[2]])
    assert batch["num_targets"] == 3 and batch["input_ids"].shape[0] == 6
    assert batch["input_ids"][3, :len(rows[0]["rejected_input_ids"])].tolist() == rows[0]["rejected_input_ids"]
    assert batch["ref_chosen_logps"].shape == (3,)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_first_step_equals_trl_on_equal_micro_batches(tiny_model, tmp_path, reset_accelerate, loss_type):
    """loss_type sigmoid, and ipo (log-ratios averaged over each completion's tokens, whose counts differ from pair
    to pair here): loss and gradients equal TRL's (ipo's loss is about 25 with beta 0.1: within 1e-6 relative)."""
    tokenizer = _tokenizer(tiny_model)
    trl_loss, trl_grads = _trl_step(tiny_model, tokenizer, [2, 2], tmp_path, loss_type)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model = _model(tiny_model)
    task, rows = _our_rows(tokenizer, _reference(tiny_model), loss_type)
    assert float(torch.tensor(rows["ref_chosen_logps"]).abs().min()) > 1.0  # real log-probs, not zeros
    loss, grads = _our_step(task, rows, model, [2, 2], tokenizer)
    assert abs(loss - math.log(2)) > 1e-2, loss  # the policy is not its reference: a loss that says something
    assert loss == pytest.approx(trl_loss, abs=1e-6, rel=1e-6), (loss, trl_loss)
    scale = max(float(g.abs().max()) for g in grads.values())
    assert scale > 1e-3  # gradients that say something
    assert _max_diff(grads, trl_grads) <= 1e-6 * max(scale, 1.0), (_max_diff(grads, trl_grads), scale)


def test_unequal_micro_batches_give_the_global_mean_where_trl_does_not(tiny_model, tmp_path, reset_accelerate):
    """1 + 3 pairs: ours equals the one-micro-batch step over all 4 pairs (the global mean); TRL's step loss is the
    mean of the micro-batch means (pair 0 counts three times as much as each of the others)."""
    from accelerate.state import AcceleratorState, GradientState

    tokenizer = _tokenizer(tiny_model)
    trl_loss, trl_grads = _trl_step(tiny_model, tokenizer, [1, 3], tmp_path)

    def ours(splits):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        model = _model(tiny_model)
        task, rows = _our_rows(tokenizer, _reference(tiny_model))
        return _our_step(task, rows, model, splits, tokenizer)

    global_loss, global_grads = ours([4])
    loss, grads = ours([1, 3])
    assert loss == pytest.approx(global_loss, abs=1e-6) and _max_diff(grads, global_grads) <= 1e-6
    gap = _max_diff(trl_grads, global_grads)
    assert abs(trl_loss - global_loss) > 1e-4 and gap > 1e-4, (
        f"TRL's 1+3 step loss {trl_loss:.6f} vs the global mean {global_loss:.6f}; its gradients differ by {gap:.2e}")


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected")


def test_eval_metrics_equal_the_ones_trl_logs(tiny_model, tmp_path, reset_accelerate):
    """TRL's eight metric names: its values for one micro-batch of the 4 pairs (logged from the forward before the
    step, bare as TRL's training rows name them) against our evaluation of the same pairs at the same weights (named
    as TRL's evaluation names them: eval_ before each), from the logits and from the chunked loss
    (which never holds a whole micro-batch's logits: the logit means are summed chunk by chunk)."""
    from toolkit.models.loading import enable_chunked_loss

    tokenizer = _tokenizer(tiny_model)
    logged: dict = {}
    _trl_step(tiny_model, tokenizer, [4], tmp_path, logged=logged)
    task, rows = _our_rows(tokenizer, _reference(tiny_model))
    model = _model(tiny_model).eval()
    batch = task.collator(tokenizer)([rows[i] for i in range(4)])
    with torch.no_grad():
        ours = task.eval_metrics([task.eval_rows(model, batch)])
        enable_chunked_loss(model, 16, max_eval_positions=batch["input_ids"].numel())
        chunked = task.eval_metrics([task.eval_rows(model, batch, chunked=True)])
    # the tiny model's logits are about 1e-5: compared relative to their size, and the two sides are two numbers
    assert ours["eval_logits/chosen"] != pytest.approx(ours["eval_logits/rejected"], rel=0.1)
    assert not set(METRICS) & set(ours), sorted(ours)  # TRL's evaluation rows never carry the bare training names
    for name in METRICS:
        assert len(logged[name]) == 1, (name, logged[name])
        ours_value, chunked_value = ours[f"eval_{name}"], chunked[f"eval_{name}"]
        assert ours_value == pytest.approx(logged[name][0], abs=1e-12, rel=1e-4), (name, ours_value, logged[name])
        assert chunked_value == pytest.approx(ours_value, abs=1e-12, rel=1e-4), (name, chunked_value, ours_value)


def test_the_chunked_loss_makes_room_for_both_sequences_of_a_pair(tiny_model, tmp_path):
    """loss_chunk_size: a micro-batch of b pairs holds 2b sequences, so the chunk count every rank runs is sized for
    2b x block_size positions (``Task.sequences_per_row``); sized for b rows, 4 long pairs raised "needs N chunks"."""
    import json

    from toolkit.config import parse_args
    from toolkit.tasks.dpo import DPO
    from toolkit.training.build import build

    long = " and".join(" a sentence that goes on" for _ in range(6))  # about 40 tokens a completion
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": p["prompt"], "chosen": long, "rejected": p["rejected"]}) + "\n"
                            for p in PAIRS))
    cfg = parse_args(["--model_name_or_path", tiny_model, "--train_file", str(path), "--validation_split_percentage",
                      "0", "--loss_chunk_size", "16", "--per_device_train_batch_size", "4", "--block_size", "64",
                      "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    parts = build(cfg, None, log=lambda *a: None, task=DPO())
    rows = parts.task.precompute_reference(_model(tiny_model), {"train": parts.train_dataset}, 4,
                                           parts.tokenizer.pad_token_id)["train"]
    batch = parts.collator([rows[i] for i in range(4)])
    assert batch["input_ids"].numel() > 4 * 64  # more positions than 4 rows of block_size
    parts.model.train()  # the training micro-batch's chunk count (the tiny GPT-2 has no dropout)
    chunked = parts.task.row_losses(parts.model, batch, chunked=True)
    plain = parts.task.row_losses(_model(tiny_model), batch)
    assert torch.allclose(chunked, plain, atol=1e-5), (chunked, plain)


def test_a_prompt_that_fills_block_size_drops_its_pair_or_is_refused_naming_the_row(tiny_model):
    """A prompt of block_size tokens or more leaves its completions no token (TRL would train the pair as a tie): by
    default the pair is dropped (TRL drops it too) and the task counts it; with drop_long_prompts: false it is refused
    with the row, the prompt's length and the fixes; one token shorter and the pair trains."""
    from datasets import Dataset, DatasetDict

    from toolkit.config import DataArguments
    from toolkit.errors import ConfigError
    from toolkit.tasks.dpo import DPO

    tokenizer = _tokenizer(tiny_model)
    long = {"prompt": "one two three four five six seven eight", "chosen": " nine", "rejected": " ten eleven"}
    prompt = len(tokenizer(long["prompt"])["input_ids"])
    raw = DatasetDict({"train": Dataset.from_list([PAIRS[0], long, PAIRS[1]]),
                       "validation": Dataset.from_list([long, PAIRS[2]])})
    task = DPO()
    task.conversational = False  # what load_raw says of text pairs
    rows = task.tokenize(raw, tokenizer, DataArguments(dataset_name="x"), block_size=prompt)
    assert [len(rows[n]) for n in ("train", "validation")] == [2, 1] and task.dropped == {"train": 1, "validation": 1}
    assert rows["train"][1]["input_ids"] == task.tokenize(DatasetDict({"train": raw["train"].select([2])}), tokenizer,
                                                          DataArguments(dataset_name="x"), prompt)["train"][0]["input_ids"]
    with pytest.raises(ConfigError, match=f"block_size: row 1: the prompt is {prompt} tokens, so block_size {prompt} "
                                          "leaves its chosen completion no token; raise block_size, remove the pairs "
                                          "with longer prompts, or set drop_long_prompts: true"):
        task.tokenize(raw, tokenizer, DataArguments(dataset_name="x", drop_long_prompts=False), block_size=prompt)
    rows = task.tokenize(raw, tokenizer, DataArguments(dataset_name="x", drop_long_prompts=False), block_size=prompt + 1)
    assert len(rows["train"]) == 3 and task.dropped == {"train": 0, "validation": 0}


def test_a_split_whose_every_prompt_is_too_long_is_refused(tiny_model):
    """Dropping every pair of a split leaves nothing to train or evaluate on: refused before any work."""
    from datasets import Dataset, DatasetDict

    from toolkit.config import DataArguments
    from toolkit.errors import ConfigError
    from toolkit.tasks.dpo import tokenize_pairs

    raw = DatasetDict({"train": Dataset.from_list(PAIRS[:2])})
    with pytest.raises(ConfigError, match="block_size: none of the 2 train pairs has a completion token within "
                                          "block_size 3 .* raise block_size or shorten the prompts"):
        tokenize_pairs(raw, _tokenizer(tiny_model), DataArguments(dataset_name="x"), block_size=3)


def test_the_reference_of_a_lora_policy_runs_in_eval_mode(tiny_model):
    """With use_peft the reference is the policy with its adapter disabled: its forward runs in eval mode (no dropout,
    as a live copy's), whatever mode the policy trains in, and the policy's mode is given back."""
    from datasets import Dataset, DatasetDict
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.config import DataArguments
    from toolkit.tasks.dpo import DPO, PairCollator, tokenize_pairs

    tokenizer = _tokenizer(tiny_model)
    rows = tokenize_pairs(DatasetDict({"train": Dataset.from_list(PAIRS)}), tokenizer, DataArguments(dataset_name="x"),
                          block_size=64)["train"]
    batch = PairCollator(tokenizer.pad_token_id)([rows[i] for i in range(4)])
    dropout = dict(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, **dropout).eval()
    expected = DPO().sequence_logps(base, batch)
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, **dropout),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.5))
    policy.train()
    torch.manual_seed(0)
    for _ in range(2):
        got = DPO().reference_logps(policy, batch)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), (got, expected)
    assert policy.training and all(m.training for m in policy.modules())


def _precompute_parts(tiny_model, tmp_path, pairs, ref_model=None):
    """A one-process config with precompute_ref_log_probs and the parts add_reference reads."""
    from types import SimpleNamespace

    from datasets import Dataset, DatasetDict

    from toolkit.config import DataArguments, config_from_dict
    from toolkit.tasks.dpo import tokenize_pairs

    cfg = config_from_dict({"model_name_or_path": tiny_model, "dataset_name": "x", "output_dir": str(tmp_path / "run"),
                            "precompute_ref_log_probs": True, "per_device_eval_batch_size": 3, "report_to": "none",
                            "ref_model_name_or_path": ref_model})
    tokenizer = _tokenizer(tiny_model)
    rows = tokenize_pairs(DatasetDict({"train": Dataset.from_list(pairs), "validation": Dataset.from_list(PAIRS[:2])}),
                          tokenizer, DataArguments(dataset_name="x"), block_size=64)
    return cfg, SimpleNamespace(train_dataset=rows["train"], eval_dataset=rows["validation"], block_size=64,
                                tokenizer=tokenizer)


def test_precomputed_reference_is_kept_and_reused_until_the_reference_or_data_change(tiny_model, tmp_path, capsys,
                                                                                     reset_accelerate):
    """precompute_ref_log_probs: the values land in the run folder (reference_logps/<key>.safetensors, written
    once); the same reference and pairs again (a resume, a restart) read them back and say so in one line, equal to
    a pass in this process; other pairs or another reference compute them again and replace the file."""
    from accelerate import Accelerator

    from toolkit import layout
    from toolkit.tasks.dpo import DPO, REF_COLUMNS

    accelerator = Accelerator(cpu=True)
    folder = tmp_path / "run" / layout.REFERENCE_LOGPS

    def add(pairs, ref_model=None):
        cfg, parts = _precompute_parts(tiny_model, tmp_path, pairs, ref_model)
        DPO().add_reference(cfg, accelerator, parts)
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("reference log-probs")]
        assert len(lines) == 1, lines
        return parts, lines[0], sorted(folder.iterdir())

    parts, line, files = add(PAIRS)
    assert line.startswith("reference log-probs: computed for 4 train, 2 validation pairs") and len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    expected = DPO().precompute_reference(_model(tiny_model), {"train": parts.train_dataset.remove_columns(
        list(REF_COLUMNS))}, 3, parts.tokenizer.pad_token_id)["train"]
    assert parts.train_dataset[:][REF_COLUMNS[0]] == expected[:][REF_COLUMNS[0]]

    again, line, same = add(PAIRS)
    assert line == f"reference log-probs: reusing {files[0]} (the same reference weights, pairs and precision)"
    assert same == files and files[0].stat().st_mtime_ns == stamp
    for split in ("train_dataset", "eval_dataset"):
        assert getattr(again, split)[:] == getattr(parts, split)[:]

    _, line, other_data = add(PAIRS[::-1])
    assert "computed" in line and len(other_data) == 1 and other_data != files
    moved = tmp_path / "moved"
    _reference(tiny_model).save_pretrained(moved)
    _, line, other_ref = add(PAIRS[::-1], str(moved))
    assert "computed" in line and len(other_ref) == 1 and other_ref not in (files, other_data)


def test_disable_dropout_defaults_to_true_for_dpo_and_false_for_the_other_recipes(tiny_model, tmp_path):
    """disable_dropout unset: DPO's default is true (TRL's), every other task's false; a value given is kept."""
    from toolkit.config import config_from_dict
    from toolkit.tasks.classification import SequenceClassification
    from toolkit.tasks.dpo import DPO
    from toolkit.tasks.lm import CausalLM
    from toolkit.tasks.sft import ChatSFT

    def resolved(task, **values):
        cfg = config_from_dict({"model_name_or_path": tiny_model, "dataset_name": "x", "report_to": "none",
                                "output_dir": str(tmp_path), **values})
        assert cfg.train.disable_dropout == values.get("disable_dropout")  # unset until the task says
        task.apply_defaults(cfg)
        return cfg.train.disable_dropout

    assert resolved(DPO()) is True and resolved(DPO(), disable_dropout=False) is False
    for task in (CausalLM(), ChatSFT(), SequenceClassification()):
        assert resolved(task) is False and resolved(task, disable_dropout=True) is True


def test_dropped_pairs_are_counted_in_one_line_and_in_the_summary(tiny_model, tmp_path, capsys, reset_accelerate):
    """A run (in process, as recipes/dpo.py's main) on pairs of which one prompt is longer than block_size trains on
    the others, says how many it dropped in one line, and summary.json keeps the count per split."""
    import json

    from toolkit.config import config_from_dict
    from toolkit.parallel.accelerator import make_accelerator
    from toolkit.tasks.dpo import DPO
    from toolkit.training.build import build
    from toolkit.training.loop import train

    long = {**PAIRS[0], "prompt": " ".join(["The sky over the hills"] * 10)}
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(long if i == 2 else PAIRS[i % 4]) + "\n" for i in range(6)))
    out = tmp_path / "run"
    cfg = config_from_dict({"model_name_or_path": tiny_model, "train_file": str(path), "validation_split_percentage": 0,
                            "block_size": 32, "max_steps": 1, "per_device_train_batch_size": 5, "report_to": "none",
                            "plot": False, "save_final_model": False, "output_dir": str(out)})
    accelerator, task = make_accelerator(cfg.train), DPO()
    task.check(cfg)
    parts = build(cfg, accelerator, task=task)
    task.add_reference(cfg, accelerator, parts)
    summary = train(cfg, accelerator, **parts.train_kwargs())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dropped")]
    assert lines == ["dropped 1 train pair(s) whose prompt leaves no completion token within block_size 32 "
                     "(drop_long_prompts; summary.json's dropped_pairs)"], lines
    assert len(parts.train_dataset) == 5 and summary["dropped_pairs"] == {"train": 1}
    assert json.load(open(out / "summary.json"))["dropped_pairs"] == {"train": 1}


def test_a_dpo_run_speaks_of_pairs_and_names_its_metrics_as_trl(gpt2_256, pairs, tmp_path, capsys):
    """A DPO run (in process, 1 x 2 pairs x accumulation 2, one step): its start-up line counts the global batch in pairs, not
    sequences; its evaluation rows carry TRL's evaluation names (eval_rewards/*, eval_logps/*, eval_logits/*), its
    loss rows DPO's loss unit (per pair, for loss.png's axis); the summary's best eval loss is prefixed once."""
    import json
    import os

    from helpers import train_in_process

    from toolkit.reporting.metrics import read_metrics
    from toolkit.tasks.dpo import DPO

    out = str(tmp_path / "dpo")
    summary = train_in_process({**pairs, "model_name_or_path": gpt2_256, "packing": False, "block_size": 256,
                                "optim": "sgd", "learning_rate": 0.1, "max_steps": 1, "logging_steps": 1,
                                "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                "per_device_eval_batch_size": 4, "eval_on_start": True, "report_to": "none",
                                "save_final_model": False, "plot": False, "output_dir": out}, task=DPO())
    printed = capsys.readouterr().out
    assert "| global batch 4 pairs (padded, variable length) |" in printed, printed
    rows = read_metrics(out)
    evals = [r for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and all("eval_rewards/accuracies" in r and "eval_logps/chosen" in r
                                   and "eval_logits/rejected" in r and "rewards/accuracies" not in r for r in evals)
    assert {r["loss_unit"] for r in rows if "loss" in r or "eval_loss" in r} == {"per pair"}
    assert summary["best_eval_loss"] == min(r["eval_loss"] for r in evals) and "best_eval_eval_loss" not in summary
    assert f"best eval loss: {summary['best_eval_loss']:.4f}" in printed
    assert json.load(open(os.path.join(out, "summary.json")))["eval_rewards/margins"] == evals[-1]["eval_rewards/margins"]

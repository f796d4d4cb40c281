"""GRPO (toolkit.grpo_loss, toolkit.grpo, toolkit.rewards) against TRL 1.16's GRPOTrainer as the oracle.

- The loss: for each loss_type, with and without beta, with num_iterations 1 (old log-probs: the policy's own) and 2
  (old log-probs given), TRL's ``_compute_loss`` on a batch of fixed prompt/completion ids, advantages, old and
  reference log-probs, against ours on the same tensors, as one batch and as two micro-batches normalised over the
  whole batch: loss and gradients within 1e-6.
- The advantages: TRL's group normalisation (std Bessel-corrected, + 1e-4), per group, per batch or none.
"""

from __future__ import annotations

import os

import pytest
import torch

from toolkit.grpo_loss import LOSS_TYPES, group_advantages, per_token_losses, row_losses_and_targets

PROMPT_LEN, COMPLETION_LEN, ROWS, GENERATIONS = 5, 6, 8, 4
EPSILON = 0.2


def _fixed_batch(vocab: int) -> dict:
    """Prompts of one length (TRL's forward passes no positions, ours counts them from the mask: equal without left
    padding), right-padded completions of different lengths (some as long as the maximum: truncated), random
    advantages of both signs; seeded."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, vocab, (ROWS, PROMPT_LEN), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.randint(0, vocab, (ROWS, COMPLETION_LEN), generator=g)
    completion_mask = torch.zeros_like(completion_ids)
    for row, n in enumerate([6, 3, 1, 5, 6, 2, 4, 6]):
        completion_mask[row, :n] = 1
    advantages = torch.randn(ROWS, generator=g)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "noise": 0.3 * torch.randn(ROWS, COMPLETION_LEN, generator=g),
            "ref_noise": 0.5 * torch.randn(ROWS, COMPLETION_LEN, generator=g)}


def _our_logps(model, batch: dict, temperature: float = 1.0):
    """The task's forward (``toolkit.grpo.policy_logps``) on the batch's prompt + completion."""
    from toolkit.grpo import policy_logps

    ours = {"input_ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
            "attention_mask": torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
            "prompt_length": PROMPT_LEN, "completion_ids": batch["completion_ids"]}
    return policy_logps(model, ours, temperature)


def _olds(model, batch: dict, num_iterations: int, beta: float):
    """Old log-probs (num_iterations 2: the policy's moved by seeded noise, so ratios leave 1 and some are clipped)
    and reference log-probs (beta > 0), fixed tensors both sides take."""
    with torch.no_grad():
        logps, _ = _our_logps(model, batch)
    old = logps + batch["noise"] if num_iterations > 1 else None
    ref = logps + batch["ref_noise"] if beta else None
    return old, ref


def _ours(model, batch, loss_type, beta, old, ref, splits=(ROWS,)):
    """Our loss over ``splits`` micro-batches, each micro-batch's row sum divided by the whole batch's targets (the
    core's normalisation); returns (loss, grads)."""
    model.zero_grad()
    parts, start, total = [], 0, None
    for n in splits:
        rows = slice(start, start + n)
        micro = {k: v[rows] for k, v in batch.items()}
        logps, _ = _our_logps(model, micro)
        tl, _, _ = per_token_losses(logps, None if old is None else old[rows], micro["advantages"],
                                    None if ref is None else ref[rows], beta, EPSILON, EPSILON)
        row_loss, targets = row_losses_and_targets(tl, micro["completion_mask"], loss_type, COMPLETION_LEN)
        parts.append((row_loss.sum(), targets.sum()))
        start += n
    total = sum(t for _, t in parts)
    loss = 0.0
    for micro_sum, _ in parts:
        part = micro_sum / total
        part.backward()
        loss += float(part)
    return loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def trl_trainer(tiny_model, tmp_path_factory):
    """TRL's GRPOTrainer on the tiny model, built once (its ``_compute_loss`` reads ``loss_type`` and ``beta`` from
    the trainer: each test sets them; the presence of old log-probs in the inputs is what num_iterations > 1 changes
    there). Its model never steps: only gradients are read, and zeroed between tests."""
    from accelerate.state import AcceleratorState, GradientState
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False,
                      per_device_train_batch_size=ROWS, num_generations=GENERATIONS,
                      max_completion_length=COMPLETION_LEN, epsilon=EPSILON, report_to="none", learning_rate=0.0)
    trainer = GRPOTrainer(model=_model(tiny_model), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["a"] * ROWS}),
                          processing_class=_tokenizer(tiny_model))
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    yield trainer
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _trl(trainer, batch, loss_type, beta, old, ref):
    """TRL's ``GRPOTrainer._compute_loss`` on the same tensors (one process, one micro-batch); returns (loss, grads,
    its metrics)."""
    from collections import defaultdict

    trainer.loss_type, trainer.beta = loss_type, beta
    trainer._metrics["train"] = defaultdict(list)
    trainer.model.zero_grad()
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs["num_items_in_batch"] = batch["completion_mask"].sum()
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return float(loss.detach()), grads, dict(trainer._metrics["train"])


def _model(tiny_model):
    from transformers import AutoModelForCausalLM

    from toolkit.model import disable_dropout

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    disable_dropout(model)
    return model


def _tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradients_equal_trl(tiny_model, trl_trainer, loss_type, beta, num_iterations):
    model = _model(tiny_model)
    model.train()
    batch = _fixed_batch(model.config.vocab_size)
    old, ref = _olds(model, batch, num_iterations, beta)
    trl_loss, trl_grads, metrics = _trl(trl_trainer, batch, loss_type, beta, old, ref)
    loss, grads = _ours(model, batch, loss_type, beta, old, ref)
    assert loss == pytest.approx(trl_loss, abs=1e-6), (loss, trl_loss)
    assert _max_diff(grads, trl_grads) <= 1e-6, _max_diff(grads, trl_grads)
    # two micro-batches of 3 + 5 completions, normalised over the whole batch: the same step
    split_loss, split_grads = _ours(model, batch, loss_type, beta, old, ref, splits=(3, 5))
    assert split_loss == pytest.approx(trl_loss, abs=1e-6) and _max_diff(split_grads, trl_grads) <= 1e-6
    if num_iterations == 2:  # the noise moved ratios outside [0.8, 1.2]: the clipped branch was exercised
        assert metrics["clip_ratio/region_mean"][0] > 0


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(scale_rewards):
    """TRL's sum_then_normalize on one process: the same advantages and group std (a group of equal rewards too)."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    ours, std = group_advantages(rewards, GENERATIONS, scale_rewards)
    grouped = rewards.view(-1, GENERATIONS)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(GENERATIONS)
    trl_std = (nanstd(grouped, dim=1).repeat_interleave(GENERATIONS) if scale_rewards != "batch"
               else nanstd(rewards).expand_as(rewards))
    expected = rewards - mean
    if scale_rewards != "none":
        expected = expected / (trl_std + 1e-4)
    assert torch.allclose(ours, expected, atol=1e-7, rtol=0)
    assert std[4:].eq(0).all() and std[:4].gt(0).all()


# ------------------------------------------------------------------------------------------ sampling
def test_a_rows_completion_does_not_depend_on_its_batch(tiny_model):
    """Per-row seeded sampling: a prompt's completion drawn alone equals the one drawn in a batch beside longer and
    shorter prompts (left padding), at another position; another seed draws another completion."""
    from toolkit.grpo import left_pad
    from toolkit.sampling import row_seed, sample

    model, tokenizer = _model(tiny_model).eval(), _tokenizer(tiny_model)
    prompts = [tokenizer(t)["input_ids"] for t in ("The sky is", "Once upon a time there was a", "Hello")]
    seeds = [row_seed(42, 3, i, 0) for i in range(3)]
    kwargs = {"max_new_tokens": 12, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
              "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}

    def draw(rows, row_seeds):
        ids, mask = left_pad(rows, tokenizer.pad_token_id)
        return sample(model, ids, mask, row_seeds, **kwargs)

    together = draw(prompts, seeds)
    for i in range(3):
        alone = draw([prompts[i]], [seeds[i]])
        assert alone[0].tolist() == together[i, :alone.shape[1]].tolist()
    reordered = draw([prompts[2], prompts[0]], [seeds[2], seeds[0]])
    assert reordered[1, :together.shape[1]].tolist()[:5] == together[0].tolist()[:5]
    other = draw([prompts[0]], [row_seed(42, 4, 0, 0)])
    assert other[0].tolist() != together[0, :other.shape[1]].tolist()


def test_sampling_draws_from_the_warped_distribution():
    """RowSampler keeps one token per row, inside top_k."""
    from toolkit.sampling import RowSampler

    scores = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    out = RowSampler([1, 2, 3], temperature=0.7, top_k=5, top_p=1.0)(torch.zeros(3, 1, dtype=torch.long), scores)
    top5 = scores.topk(5, dim=-1).indices
    for row in range(3):
        kept = (out[row] == 0).nonzero().flatten().tolist()
        assert len(kept) == 1 and kept[0] in top5[row].tolist()


# ------------------------------------------------------------------------------------------ a run
def _values(tiny_model, tmp_path, **over) -> dict:
    values = {"model_name_or_path": tiny_model, "dataset_name": "arithmetic", "output_dir": str(tmp_path / "run"),
              "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
              "num_generations": 4, "max_completion_length": 6, "per_device_train_batch_size": 4,
              "gradient_accumulation_steps": 2, "max_steps": 2, "logging_steps": 1, "report_to": "none",
              "learning_rate": 1e-3, "plot": False, "save_final_model": False, "block_size": 64}
    values.update(over)
    return values


def test_a_grpo_run_logs_trls_metrics_and_the_reward(tiny_model, tmp_path):
    import json

    from helpers import train_in_process

    from toolkit.grpo import GRPO

    summary = train_in_process(_values(tiny_model, tmp_path), task=GRPO())
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    logged = [r for r in rows if "reward" in r]
    assert len(logged) == 2
    for name in ("reward", "reward_std", "rewards/arithmetic_correct/mean", "rewards/arithmetic_format/mean",
                 "completions/mean_length", "completions/clipped_ratio", "entropy", "frac_reward_zero_std",
                 "clip_ratio/region_mean", "time/generation_s", "time/training_s"):
        assert name in logged[0], (name, sorted(logged[0]))
    assert 0 < logged[0]["completions/mean_length"] <= 6 and logged[0]["entropy"] > 0
    assert summary["reward_start"] == logged[0]["reward"] and summary["reward_end"] == logged[1]["reward"]


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("reward, message", [
    ("grpo_rewards:raises", "reward function grpo_rewards:raises raised ValueError: no score for these"),
    ("grpo_rewards:too_few", "reward function grpo_rewards:too_few returned 1 values for 4 completions"),
])
def test_a_failing_reward_function_stops_the_run_naming_it(tiny_model, tmp_path, monkeypatch, reward, message):
    import sys

    from helpers import ROOT, train_in_process

    from toolkit.errors import TrainingStopped
    from toolkit.grpo import GRPO

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    with pytest.raises(TrainingStopped, match=message):
        train_in_process(_values(tiny_model, tmp_path, reward_funcs=[reward], max_steps=1), task=GRPO())


@pytest.mark.parametrize("values, field, message", [
    ({"loss_type": "sigmoid"}, "loss_type", "GRPO's loss_type is one of dapo, grpo, bnpo, dr_grpo"),
    ({"num_generations": 3}, "num_generations", "global batch of 8 completions"),
    ({"reward_funcs": ["no_such_module:f"]}, "reward_funcs", "cannot import 'no_such_module:f'"),
    ({"reward_funcs": ["arithmetic_correct"], "reward_weights": [1.0, 2.0]}, "reward_weights", "2 weights for 1"),
    ({"num_iterations": 2, "save_steps": 3}, "save_steps", "multiple of num_iterations"),
])
def test_grpo_refuses_before_any_work(tiny_model, tmp_path, values, field, message):
    from toolkit.config import config_from_dict
    from toolkit.errors import ConfigError
    from toolkit.grpo import GRPO

    cfg = config_from_dict(_values(tiny_model, tmp_path, **values))
    with pytest.raises(ConfigError, match=message) as err:
        GRPO().check(cfg)
    assert err.value.field_name == field


def test_beta_and_loss_type_take_each_tasks_default_and_values(tiny_model, tmp_path):
    """One field each, unset by default: GRPO's beta 0 and dapo, DPO's 0.1 and sigmoid (TRL's); DPO refuses a GRPO
    loss and beta 0."""
    from toolkit.config import config_from_dict
    from toolkit.errors import ConfigError
    from toolkit.grpo import GRPO
    from toolkit.preference import DPO

    cfg = config_from_dict(_values(tiny_model, tmp_path))
    assert (cfg.train.beta, cfg.train.loss_type) == (None, None)
    GRPO().check(cfg)
    assert (cfg.train.beta, cfg.train.loss_type) == (0.0, "dapo")
    dpo = {k: v for k, v in _values(tiny_model, tmp_path).items() if k not in ("dataset_name",)}
    cfg = config_from_dict({**dpo, "dataset_name": "pydoc-preferences"})
    DPO().check(cfg)
    assert (cfg.train.beta, cfg.train.loss_type) == (0.1, "sigmoid")
    for over, field in (({"loss_type": "dapo"}, "loss_type"), ({"beta": 0.0}, "beta")):
        with pytest.raises(ConfigError) as err:
            DPO().check(config_from_dict({**dpo, "dataset_name": "pydoc-preferences", **over}))
        assert err.value.field_name == field


def test_loss_png_draws_the_reward(tmp_path):
    """A run whose rows log a reward (GRPO): loss.png's curve is the reward, on a 'mean reward' axis."""
    import json

    from toolkit import plots

    rows = [{"step": s, "tokens_seen": 100 * s, "loss": 0.0, "reward": 0.1 * s, "loss_unit": "GRPO objective"}
            for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plots.train_key(rows) == "reward" and plots.train_key([{"loss": 1.0}]) == "loss"
    assert os.path.getsize(plots.plot_run(str(tmp_path))) > 0


def test_the_builtin_rewards():
    from toolkit.rewards import arithmetic_correct, arithmetic_dataset, arithmetic_format

    completions = ["12 + 7 = 19.", "19", " 18", "The answer is 19 apples", "none"]
    assert arithmetic_correct(None, completions, answer=[19] * 5) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert arithmetic_format(None, completions) == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert arithmetic_correct(None, [[{"role": "assistant", "content": "19"}]], answer=[19]) == [1.0]
    rows = arithmetic_dataset()["train"]
    a, b = (int(x) for x in rows[0]["prompt"][0]["content"][len("What is "):].split("?")[0].split(" + "))
    assert rows[0]["answer"] == a + b and len(rows) == 512

"""GRPO (toolkit.tasks.grpo.loss, toolkit.tasks.grpo.task, toolkit.tasks.grpo.rewards) against TRL 1.16's GRPOTrainer as the oracle.

- The loss: for each loss_type, with and without beta, with num_iterations 1 (old log-probs: the policy's own) and 2
  (old log-probs given), TRL's ``_compute_loss`` on a batch of fixed prompt/completion ids, advantages, old and
  reference log-probs, against ours on the same tensors, as one batch and as two micro-batches normalised over the
  whole batch: loss and gradients within 1e-6; the loss's logged metrics (entropy, kl, clip ratios) equal TRL's.
- The advantages and reward metrics: TRL's sum_then_normalize (nansum of the weighted rewards, a None reward as NaN,
  nanstd, + 1e-4), per group, per batch or none; what a reward function may return.
- Sampling: a completion independent of its batch; temperature, top_p and top_k at their edges; nothing of the model's
  generation_config but its EOS ids.
- Runs in process: TRL's metric names, a resume before a reused batch (num_iterations 2) and one of a text-prompt
  epoch; a chat model's end of turn (TRL's EOS ids) and TRL's reward call (trainer_state, log_metric, async); a run
  that learns nothing; the refusals (before any work: a reward function TRL could not call, the fields GRPO ignores),
  ``toolkit train grpo``'s reward module check.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from toolkit.tasks.grpo.loss import LOSS_TYPES, group_advantages, per_token_losses, row_losses_and_targets

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
    """The task's forward (``toolkit.tasks.grpo.task.policy_logps``) on the batch's prompt + completion."""
    from toolkit.tasks.grpo.task import policy_logps

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

    from toolkit.models.loading import disable_dropout

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


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The policy of the loss tests, loaded once: it never steps (each test zeroes and reads its gradients)."""
    return _model(tiny_model).train()


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradients_equal_trl(policy, trl_trainer, loss_type, beta, num_iterations):
    model = policy
    batch = _fixed_batch(model.config.vocab_size)
    old, ref = _olds(model, batch, num_iterations, beta)
    trl_loss, trl_grads, metrics = _trl(trl_trainer, batch, loss_type, beta, old, ref)
    loss, grads = _ours(model, batch, loss_type, beta, old, ref)
    assert loss == pytest.approx(trl_loss, abs=1e-6), (loss, trl_loss)
    assert _max_diff(grads, trl_grads) <= 1e-6, _max_diff(grads, trl_grads)
    # two micro-batches of 3 + 5 completions, normalised over the whole batch: the same step
    split_loss, split_grads = _ours(model, batch, loss_type, beta, old, ref, splits=(3, 5))
    assert split_loss == pytest.approx(trl_loss, abs=1e-6) and _max_diff(split_grads, trl_grads) <= 1e-6
    if num_iterations == 1:
        return
    assert metrics["clip_ratio/region_mean"][0] > 0  # the noise moved ratios outside [0.8, 1.2]: clipped somewhere
    # what the task logs of the loss (token means over the batch: entropy, kl, the clip ratios) is what TRL logs
    logged = _task_loss_metrics(model, batch, loss_type, beta, old, ref)
    assert set(logged) == {k for k in metrics if k == "kl" or k == "entropy" or k.endswith("_mean")}, sorted(metrics)
    for name, value in logged.items():
        assert value == pytest.approx(metrics[name][0], abs=1e-6), name


def _task_loss_metrics(model, batch, loss_type, beta, old, ref) -> dict:
    """``GRPO.row_losses`` on the batch, then the token means it accumulated for its log (one process)."""
    from toolkit.config import config_from_dict
    from toolkit.tasks.grpo.task import GRPO

    task = GRPO()
    task.check(config_from_dict(_values(model.name_or_path, None, loss_type=loss_type, beta=beta, epsilon=EPSILON,
                                        max_completion_length=COMPLETION_LEN)))
    ours = {"input_ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
            "attention_mask": torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
            "prompt_length": PROMPT_LEN, "completion_ids": batch["completion_ids"],
            "completion_mask": batch["completion_mask"], "advantages": batch["advantages"]}
    ours.update({k: v for k, v in (("old_logps", old), ("ref_logps", ref)) if v is not None})
    with torch.no_grad():
        task.row_losses(model, ours)
    return {k: v / task.sums["_tokens"] for k, v in task.sums.items() if k != "_tokens"}


def _trl_advantages(per_func: torch.Tensor, weights: torch.Tensor, scale_rewards: str) -> dict:
    """TRL 1.16's ``_generate_and_score_completions`` (``sum_then_normalize``, lines 2759-2830 of
    trl/trainer/grpo_trainer.py) on the gathered rewards, its own lines with its ``nanstd``."""
    from trl.trainer.utils import nanstd

    unscorable_mask = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, GENERATIONS), dim=1).repeat_interleave(GENERATIONS)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, GENERATIONS), dim=1).repeat_interleave(GENERATIONS)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return {"advantages": torch.nan_to_num(advantages, nan=0.0), "reward": torch.nanmean(rewards).item(),
            "reward_std": nanstd(rewards).item(), "frac_reward_zero_std": is_std_zero.float().mean().item(),
            "func_means": [torch.nanmean(per_func[:, i]).item() for i in range(per_func.shape[1])],
            "func_stds": [nanstd(per_func[:, i]).item() for i in range(per_func.shape[1])]}


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_equal_trl(scale_rewards):
    """TRL's sum_then_normalize on one process, with two weighted reward functions of which one returned None for
    some completions (NaN, TRL's conversion: left out by nansum), a completion neither rewarded (left out of its
    group's statistics, advantage 0), a group of equal rewards: the same advantages, reward, reward_std,
    per-function means and stds, and frac_reward_zero_std (of the std the advantages are scaled by: the batch's under
    ``batch``)."""
    from toolkit.tasks.grpo.loss import combine_rewards, nanstd
    from toolkit.tasks.grpo.rewards import score

    nan = float("nan")
    first = [1.0, 0.0, 2.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0, nan, 3.0, 0.0]
    second = [None, 1.0, 1.0, None, 0.0, 0.0, 0.0, 0.0, 2.0, None, 1.0, 0.5]
    funcs = [("first", lambda completions, **kw: first), ("second", lambda completions, **kw: second)]
    per_func, error = score(funcs, ["p"] * 12, ["c"] * 12, [[1]] * 12, {})
    assert error is None
    per_func = torch.tensor(per_func, dtype=torch.float32).T
    weights = [1.0, 0.5]
    trl = _trl_advantages(per_func, torch.tensor(weights), scale_rewards)
    rewards = combine_rewards(per_func, weights)
    ours, std = group_advantages(rewards, GENERATIONS, scale_rewards)
    assert torch.allclose(ours, trl["advantages"], atol=1e-7, rtol=0) and ours[9] == 0
    assert float(torch.nanmean(rewards)) == pytest.approx(trl["reward"], abs=1e-7)
    assert float(nanstd(rewards)) == pytest.approx(trl["reward_std"], abs=1e-7)
    zero = float(torch.isclose(std, torch.zeros_like(std)).float().mean())
    assert zero == pytest.approx(trl["frac_reward_zero_std"]) and (zero == 0) == (scale_rewards == "batch")
    for i in range(2):
        assert float(torch.nanmean(per_func[:, i])) == pytest.approx(trl["func_means"][i], abs=1e-7)
        assert float(nanstd(per_func[:, i])) == pytest.approx(trl["func_stds"][i], abs=1e-7)


def test_reward_functions_return_what_trl_takes():
    """A numpy array or a tensor of one number per completion is taken, as TRL takes it; a string, a dict, a
    non-number or the wrong length is one line naming the function."""
    import numpy as np

    from toolkit.tasks.grpo.rewards import score

    def run(values):
        return score([("mine", lambda **kw: values)], ["p"] * 2, ["a", "b"], [[1], [2]], {})

    assert run(np.array([1.0, 2.0])) == ([[1.0, 2.0]], None)
    assert run(torch.tensor([0.5, 1.0])) == ([[0.5, 1.0]], None)
    assert run((1, None))[0][0][1] != run((1, None))[0][0][1]  # NaN
    for bad, said in (("ab", "returned str"), ({"a": 1, "b": 2}, "returned dict"), ([1.0], "returned 1 values"),
                      (["x", "y"], "not a number"), (["1.5", 2.0], "not a number"),  # before: "1.5" taken as 1.5
                      ([[1.0], [2.0]], "not a number")):
        rewards, error = run(bad)
        assert rewards is None and error.startswith("reward function mine ") and said in error, error


def test_async_reward_functions_are_awaited_together_and_get_trls_keywords():
    """An ``async def`` reward function is awaited (before: its coroutine was taken as the return value and the run
    stopped at step 0), every async one of a batch together, beside a plain one; one that raises is named. What
    TRL passes besides the columns (``trainer_state``, ``log_metric``, ``log_extra``) reaches each function by name."""
    import asyncio

    from toolkit.tasks.grpo.rewards import score

    seen = []

    async def slow(completions, **kw):
        await asyncio.sleep(0.05)
        seen.append(sorted(kw))
        return [1.0] * len(completions)

    async def fails(completions, **kw):
        raise RuntimeError("judge unreachable")

    context = {"trainer_state": "state", "log_metric": print, "log_extra": print}
    funcs = [("a", slow), ("plain", lambda completions, **kw: [2.0, 3.0]), ("b", slow)]
    assert score(funcs, ["p"] * 2, ["x", "y"], [[1], [2]], {"answer": [1, 2]}, context) == (
        [[1.0, 1.0], [2.0, 3.0], [1.0, 1.0]], None)
    assert seen == [["answer", "completion_ids", "log_extra", "log_metric", "prompts", "trainer_state"]] * 2
    assert score([("judge", fails)], ["p"], ["x"], [[1]], {}, context) == (
        None, "reward function judge raised RuntimeError: judge unreachable")


# ------------------------------------------------------------------------------------------ sampling
def test_a_rows_completion_does_not_depend_on_its_batch(tiny_model):
    """Per-row seeded sampling: a prompt's completion drawn alone equals the one drawn in a batch beside longer and
    shorter prompts (left padding), at another position; another seed draws another completion."""
    from toolkit.tasks.grpo.sampling import row_seed, sample
    from toolkit.tasks.grpo.task import left_pad

    model, tokenizer = _model(tiny_model).eval(), _tokenizer(tiny_model)
    prompts = [tokenizer(t)["input_ids"] for t in ("The sky is", "Once upon a time there was a", "Hello")]
    seeds = [row_seed(42, 3, i, 0) for i in range(3)]
    kwargs = {"max_new_tokens": 8, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
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


def test_the_models_generation_config_does_not_shape_the_draws(tiny_model):
    """A model whose generation_config suppresses tokens, penalises repetition, bans repeated n-grams, bad words and an
    early EOS draws exactly what the same model without them draws (the loss scores the logits over the temperature
    alone: those processors would sample off-policy; before, generate applied each of them). The model keeps its
    generation_config."""
    from transformers import GenerationConfig

    from toolkit.tasks.grpo.sampling import row_seed, sample
    from toolkit.tasks.grpo.task import left_pad

    model, tokenizer = _model(tiny_model).eval(), _tokenizer(tiny_model)
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in ("The sky is", "Once upon a time")], tokenizer.pad_token_id)
    kwargs = {"max_new_tokens": 8, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
              "pad_token_id": tokenizer.pad_token_id, "eos_token_id": [tokenizer.eos_token_id]}
    seeds = [row_seed(0, 0, i, 0) for i in range(2)]
    plain = sample(model, ids, mask, seeds, **kwargs)
    leaky = GenerationConfig(suppress_tokens=list(range(1, 1024)), repetition_penalty=3.0, no_repeat_ngram_size=1,
                             bad_words_ids=[[t] for t in range(1024, 1100)], min_new_tokens=8)
    model.generation_config = leaky
    assert sample(model, ids, mask, seeds, **kwargs).tolist() == plain.tolist()
    assert model.generation_config is leaky


def test_sampling_draws_from_the_warped_distribution():
    """RowSampler keeps one token per row, inside top_k."""
    from toolkit.tasks.grpo.sampling import RowSampler

    scores = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    out = RowSampler([1, 2, 3], temperature=0.7, top_k=5, top_p=1.0)(torch.zeros(3, 1, dtype=torch.long), scores)
    top5 = scores.topk(5, dim=-1).indices
    for row in range(3):
        kept = (out[row] == 0).nonzero().flatten().tolist()
        assert len(kept) == 1 and kept[0] in top5[row].tolist()


def test_sampling_at_the_edges_of_temperature_top_p_and_top_k(tiny_model, tmp_path):
    """A top_k past the vocabulary is no top_k; a tiny top_p or temperature draws the likeliest token; a temperature
    of 0, a top_p of 0 or above 1, a negative top_k, epsilon or epsilon_high are one line naming the field."""
    from toolkit.config import config_from_dict
    from toolkit.errors import ConfigError
    from toolkit.tasks.grpo.sampling import RowSampler

    scores = torch.log_softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), -1)
    ids = torch.zeros(4, 1, dtype=torch.long)

    def drawn(**kw):
        out = RowSampler([5, 6, 7, 8], **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw})(ids, scores)
        return out.argmax(-1).tolist()

    assert drawn(top_k=10_000) == drawn()
    assert drawn(top_p=1e-6) == drawn(temperature=1e-4) == scores.argmax(-1).tolist()
    # a negative clip bound turns [1 - epsilon, 1 + epsilon_high] inside out (before: epsilon_high -1 was taken)
    for field, value in (("temperature", 0.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("epsilon_high", -1.0),
                         ("epsilon", -0.1)):
        with pytest.raises(ConfigError) as err:
            config_from_dict(_values(tiny_model, tmp_path, **{field: value}))
        assert err.value.field_name == field


# ------------------------------------------------------------------------------------------ a run
def _values(tiny_model, tmp_path, **over) -> dict:
    out = str(tmp_path / "run") if tmp_path is not None else "unused"
    values = {"model_name_or_path": tiny_model, "dataset_name": "arithmetic", "output_dir": out,
              "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
              "num_generations": 4, "max_completion_length": 6, "per_device_train_batch_size": 4,
              "gradient_accumulation_steps": 2, "max_steps": 2, "logging_steps": 1, "report_to": "none",
              "learning_rate": 1e-3, "plot": False, "save_final_model": False}
    values.update(over)
    return values


def test_a_run_logs_trls_metrics_and_resumes_before_a_reused_batch_exactly(tiny_model, tmp_path, monkeypatch):
    """A run logs TRL's metrics and summary.json its first and last mean reward. num_iterations 2, beta > 0: the checkpoint after step 1, whose step 2 trains again on step 1's completions,
    holds that batch (its completions, advantages, old and reference log-probs, which step 1's weights made and no
    checkpoint's weights can make again). A resume from it on another micro-batch split (2 x 4 instead of 4 x 2)
    ends where the uninterrupted run ends (1e-6), and its summary's reward_start and reward_end are the run's. Before,
    save_steps 1 was refused, and a resume there too (a SIGTERM saves the same checkpoint: the same record)."""
    import sys

    from helpers import ROOT, load_weights, max_abs_diff, train_in_process

    from toolkit.tasks.grpo.task import GRPO

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    values = _values(tiny_model, tmp_path, num_iterations=2, save_final_model=True, beta=0.04, loss_type="grpo",
                     save_steps=1, reward_funcs=["arithmetic_correct", "grpo_rewards:vowels"])  # vowels: unequal
    out = tmp_path / "run"
    straight = train_in_process(values, task=GRPO())
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    logged = [r for r in rows if "reward" in r]
    assert len(logged) == 1 and logged[0]["step"] == 1  # step 2 reuses step 1's completions: nothing generated
    for name in ("reward", "reward_std", "rewards/arithmetic_correct/mean", "rewards/vowels/std", "kl", "entropy",
                 "completions/mean_length", "completions/mean_terminated_length", "completions/clipped_ratio",
                 "frac_reward_zero_std", "clip_ratio/region_mean", "time/generation_s", "time/training_s"):
        assert name in logged[0], (name, sorted(logged[0]))
    assert 0 < logged[0]["completions/mean_length"] <= 6 and logged[0]["entropy"] > 0 and rows[-1]["kl"] > 0
    assert straight["reward_start"] == straight["reward_end"] == logged[0]["reward"]
    reference = load_weights(str(out / "final"))
    state = json.load(open(out / "checkpoints" / "step-1" / "toolkit_state.json"))["task"]
    assert state["batch"]["step"] == 0 and len(state["batch"]["rows"]) == 8
    assert {"old_logps", "ref_logps", "advantage"} <= set(state["batch"]["rows"][0])
    resumed = train_in_process({**values, "resume_from_checkpoint": str(out / "checkpoints" / "step-1"),
                                "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, task=GRPO())
    assert resumed["ended"] == "completed" and resumed["steps"] == 2
    assert resumed["reward_start"] == straight["reward_start"] and resumed["reward_end"] == straight["reward_end"]
    diff = max_abs_diff(load_weights(str(out / "final")), reference)
    assert 0 < max_abs_diff(reference, load_weights(tiny_model)) and diff <= 1e-6, diff


def test_loss_chunk_size_trains_grpo_as_the_materialised_logits_and_logs_the_same_entropy(tiny_model, tmp_path,
                                                                                          monkeypatch):
    """``loss_chunk_size`` (issue 50): the completions' log-probs from torch's fused ``F.linear_cross_entropy``, the
    entropy metric from one chunk's logits at a time (toolkit.loss.chunked_completion_logps), the policy's, the old
    policy's (num_iterations 2) and the live reference's (beta > 0) alike, temperature 0.7. 3 SGD steps in this
    process end within 1e-6 of the same run on the materialised logits, with the same completions (rewards) and the
    logged entropy equal (rel 1e-6); the head never returns a micro-batch's logits, in the loss or in generation's
    prefill. Before, GRPO refused loss_chunk_size."""
    import sys

    from helpers import ROOT, load_weights, max_abs_diff, train_in_process

    from toolkit.reporting.metrics import read_metrics
    from toolkit.tasks.grpo.task import GRPO

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    values = _values(tiny_model, tmp_path, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_steps=3,
                     num_iterations=2, beta=0.04, temperature=0.7, save_final_model=True,
                     reward_funcs=["grpo_rewards:vowels"])
    rows, shapes = {}, []

    class HeadShapes:
        def on_prepared(self, accelerator, model, optimizer):
            model.get_output_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))

    for name, chunk in (("plain", 0), ("chunked", 5)):  # 5: chunks that split rows (4 x 6 completion positions)
        train_in_process({**values, "loss_chunk_size": chunk, "output_dir": str(tmp_path / name)}, task=GRPO(),
                         callbacks=[HeadShapes()] if chunk else None)
        rows[name] = [r for r in read_metrics(str(tmp_path / name)) if "entropy" in r]
    # the head never returned a micro-batch's logits: the loss's fused calls (the log-probs and entropies of the
    # 4 x 6 completion positions), and generation's one position a row (its prefill too: logits_to_keep)
    assert set(shapes) == {(2, 24), (4, 1, 2048)}, sorted(set(shapes))
    assert len(rows["plain"]) == len(rows["chunked"]) == 3
    for plain, chunked in zip(rows["plain"], rows["chunked"]):
        assert chunked.get("reward") == plain.get("reward")  # the same completions were drawn
        assert chunked["entropy"] == pytest.approx(plain["entropy"], rel=1e-6, abs=0)
        # the KL (about 0.015) is a difference of nearly equal log-probs: their fp32 rounding (1e-7) weighs more in it
        for name in ("kl", "clip_ratio/region_mean"):
            assert chunked[name] == pytest.approx(plain[name], rel=0, abs=1e-6), name
    final = {name: load_weights(str(tmp_path / name / "final")) for name in rows}
    assert max_abs_diff(final["plain"], load_weights(tiny_model)) > 1e-3  # it trained
    assert max_abs_diff(final["chunked"], final["plain"]) <= 1e-6, max_abs_diff(final["chunked"], final["plain"])


def test_text_prompts_trls_reward_conventions_and_a_resume_of_an_epoch(tiny_model, tmp_path, monkeypatch):
    """Text prompts from a file, fewer than the global batch of completions (4 prompts x 4 = 2 steps of 8: refused
    before as 4 rows under one batch of 8), one longer than max_prompt_length (its last 16 tokens generate; the reward
    functions get it whole), a column passed by name, a reward function returning None for half the completions and
    one a numpy array (TRL's conventions), scale_rewards batch, masked truncated completions: the epoch trains to its
    end on every prompt (before, validation_split_percentage held the file's last prompt out, never trained on: 1
    step), the rewards finite, TRL's terminated-length metrics logged. A prompt that with a whole completion would
    pass the model's positions is refused before the weights load (before: an index error mid-run). Its step-1 checkpoint resumes to the same
    weights and the same summary reward_start (before: this attempt's first reward); a resume with another
    num_generations (another sample order at the same global batch) is refused naming it."""
    import sys

    import grpo_rewards
    from helpers import ROOT, load_weights, max_abs_diff, train_in_process
    from transformers import AutoTokenizer

    from toolkit.config import config_from_dict
    from toolkit.errors import ConfigError
    from toolkit.tasks.grpo.task import GRPO

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    long = "Count the words of this: " + " ".join(f"w{i}" for i in range(60)) + ". The count is"
    prompts = ["The sky is", long, "Once upon a time", "2 + 2 ="]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "topic": t}) + "\n" for p, t in zip(prompts, "abcd")))
    values = _values(tiny_model, tmp_path, dataset_name=None, train_file=str(data), max_steps=-1, num_train_epochs=1,
                     max_prompt_length=16, max_completion_length=4, mask_truncated_completions=True,
                     scale_rewards="batch", reward_funcs=["grpo_rewards:none_for_odd", "grpo_rewards:as_array"],
                     reward_weights=[1.0, 2.0], save_steps=1, save_final_model=True)
    with pytest.raises(ConfigError) as err:  # the long prompt's last 62 tokens + 4 > the model's 64 positions
        train_in_process({**values, "max_prompt_length": 62}, task=GRPO())
    assert err.value.field_name == "max_prompt_length" and "66 positions, more than the model's 64" in str(err.value)
    with pytest.raises(ConfigError, match="cannot train on a stream") as err:  # the order repeats each prompt
        train_in_process({**values, "streaming": True, "max_steps": 2}, task=GRPO())
    grpo_rewards.PROMPTS_SEEN.clear()
    first = train_in_process(values, task=GRPO())
    assert first["ended"] == "completed" and first["steps"] == 2 and long in grpo_rewards.PROMPTS_SEEN
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"reward"' in line]
    assert len(rows) == 2 and all(r["reward"] == r["reward"] and r["rewards/none_for_odd/mean"] > 0 for r in rows)
    assert {"completions/mean_terminated_length", "completions/max_terminated_length"} <= set(rows[0])
    weights = load_weights(str(tmp_path / "run" / "final"))
    step1 = str(tmp_path / "run" / "checkpoints" / "step-1")
    with pytest.raises(ConfigError) as err:
        train_in_process({**values, "resume_from_checkpoint": step1, "num_generations": 2}, task=GRPO())
    assert err.value.field_name == "num_generations"
    resumed = train_in_process({**values, "resume_from_checkpoint": step1}, task=GRPO())
    assert resumed["steps"] == 2 and resumed["reward_start"] == first["reward_start"]
    assert max_abs_diff(load_weights(str(tmp_path / "run" / "final")), weights) == 0.0
    # the long prompt keeps its last max_prompt_length tokens, and the cut is counted (log, summary.json); unset, as
    # TRL 1.16 has it, every prompt stays whole (before: cut to 512 tokens by default, without a word)
    whole = AutoTokenizer.from_pretrained(tiny_model)(long)["input_ids"]
    for keep in (16, None):
        unset = {k: v for k, v in values.items() if k != "max_prompt_length"}  # the default
        task, cfg = GRPO(), config_from_dict({**unset, "output_dir": str(tmp_path / "tokenized"),
                                              **({"max_prompt_length": keep} if keep else {})})
        assert cfg.train.max_prompt_length == keep
        task.check(cfg)
        tokenizer, said = AutoTokenizer.from_pretrained(tiny_model), []
        task.prepare_tokenizer(tokenizer, cfg)
        task.log = said.append
        train = task.tokenize(task.load_raw(cfg.data), tokenizer, cfg.data, 64)["train"]
        assert train.column_names == ["prompt", "topic", "input_ids", "prompt_index"]  # the reward functions' columns
        assert train["input_ids"][1] == whole[-(keep or len(whole)):]
        assert train["input_ids"][0] == tokenizer(prompts[0])["input_ids"]
        if keep:
            assert task.data_record["prompts_cut"] == {"prompts": 1, "of": 4, "tokens_removed": len(whole) - 16,
                                                       "max_prompt_length": 16}
            assert said == [f"max_prompt_length 16: 1 of 4 prompts cut to their last 16 tokens, {len(whole) - 16} "
                            f"tokens removed (at most {len(whole) - 16} from one prompt)"]
        else:
            assert not said and "prompts_cut" not in task.data_record and len(whole) > 16


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory) -> str:
    """The tiny GPT-2 as a chat model whose turns end in ``<|im_end|>`` (added to its tokenizer; its
    generation_config's second EOS id) while its tokenizer's EOS stays ``<|endoftext|>``, as Qwen's chat models have
    it. Its head leans towards ``<|im_end|>`` (a shift of the final norm's bias along that token's embedding: 0.3-40%
    a position) so that some completions end their turn within a few tokens and some do not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        direction = torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(0))
        direction = 2.0 * direction / direction.norm()
        model.transformer.ln_f.bias += direction
        model.transformer.wte.weight[end] = direction
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, end],
                                               bos_token_id=tokenizer.eos_token_id)
    path = str(tmp_path_factory.mktemp("models") / "tiny-chat")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_chat_models_end_of_turn_ends_a_completion_and_rewards_get_trls_call(chat_model, tmp_path, monkeypatch,
                                                                               capsys):
    """A chat model whose turns end in ``<|im_end|>`` (its generation_config's EOS) while its tokenizer's EOS is
    ``<|endoftext|>``: each completion stops at its turn's end and its mask ends there (TRL 1.16's eos ids); before,
    generation ran past the turn and the rewards, the loss and clipped_ratio counted the text after it. The reward
    functions are called as TRL calls them: ``trainer_state`` (the steps done, the run's steps), ``log_metric``
    (logged as each generation's mean), ``log_extra``, the columns; an ``async def`` one is awaited (before: the run
    stopped at step 0). summary.json's train_rows counts completions, its row_unit (before: the prompts)."""
    import sys

    import grpo_rewards
    from helpers import ROOT, train_in_process
    from transformers import AutoTokenizer

    from toolkit.tasks.grpo.task import GRPO

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    end = AutoTokenizer.from_pretrained(chat_model).convert_tokens_to_ids("<|im_end|>")
    grpo_rewards.CALLS.clear()
    summary = train_in_process(_values(chat_model, tmp_path, reward_funcs=["grpo_rewards:record",
                                                                           "grpo_rewards:async_vowels"],
                                       chat_template="{% for m in messages %}{{ m['content'] }}<|im_end|>\n"
                                                     "{% endfor %}", max_train_samples=8), task=GRPO())
    ids = [c for call in grpo_rewards.CALLS for c in call["completion_ids"]]
    assert len(ids) == 16 and all(0 < len(c) <= 6 for c in ids)
    ended = [c for c in ids if end in c]
    assert ended and all(c.index(end) == len(c) - 1 for c in ended), ids  # nothing after the turn's end
    assert len(ended) < len(ids)  # some ran to max_completion_length without ending their turn
    assert [(call["step"], call["max_steps"]) for call in grpo_rewards.CALLS] == [(0, 2)] * 2 + [(1, 2)] * 2
    assert grpo_rewards.CALLS[0]["keywords"] == ["answer"]  # the column; TRL's own keywords are its parameters
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"reward"' in line]
    assert [r["record/completions"] for r in rows] == [4.0, 4.0]  # a call's value (a micro-batch's 4), its mean
    assert [r["completions/clipped_ratio"] for r in rows] == [
        sum(end not in c for c in ids[8 * k:8 * k + 8]) / 8 for k in range(2)]
    assert all("rewards/async_vowels/mean" in r for r in rows)
    assert (summary["train_rows"], summary["train_prompts"], summary["row_unit"]) == (32, 8, "completions")
    assert "32 training completions" in capsys.readouterr().out


def test_a_run_that_learns_nothing_says_so_and_logs_no_undefined_means(tiny_model, tmp_path, monkeypatch, capsys):
    """Rewards all equal (every group's std 0: every advantage 0, the loss 0): the run warns, in the log and in
    summary.json (before: it reported success and nothing else), with zero_std_batches of generated_batches. Every
    completion truncated and masked (mask_truncated_completions, max_completion_length 1): entropy, kl and the clip
    ratios, token means over no token, are absent from the log (before: 0.0)."""
    import sys

    from helpers import ROOT, train_in_process

    from toolkit.tasks.grpo.task import GRPO

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    summary = train_in_process(_values(tiny_model, tmp_path, reward_funcs=["grpo_rewards:zero"], beta=0.04,
                                       max_completion_length=1, mask_truncated_completions=True), task=GRPO())
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"reward"' in line]
    assert len(rows) == 2 and all(r["completions/clipped_ratio"] == 1.0 and r["frac_reward_zero_std"] == 1.0
                                  for r in rows)
    assert not {"entropy", "kl", "clip_ratio/region_mean"} & {k for r in rows for k in r}, rows
    assert (summary["generated_batches"], summary["zero_std_batches"]) == (2, 2)
    warning = summary["warnings"][0]
    assert warning.startswith("every group of completions had equal rewards in all 2 generated batches")
    assert f"warning: {warning}" in capsys.readouterr().out
    saved = json.load(open(tmp_path / "run" / "summary.json"))
    assert saved["warnings"] == [warning] and saved["train_rows"] == 2048 and saved["train_prompts"] == 512


# ------------------------------------------------------------------------------------------ refusals
def test_a_failing_reward_function_stops_the_run_naming_it(tiny_model, tmp_path, monkeypatch, capsys):
    """The second of two reward functions raises: the run stops with one line naming it (what else a function does
    wrong, e.g. the wrong length, is the same stop with score's line: test_reward_functions_return_what_trl_takes)."""
    import sys

    from helpers import ROOT, train_in_process

    from toolkit.errors import TrainingStopped
    from toolkit.tasks.grpo.task import GRPO

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    with pytest.raises(TrainingStopped, match="reward function grpo_rewards:raises raised ValueError: no score for these"):
        train_in_process(_values(tiny_model, tmp_path, reward_funcs=["arithmetic_correct", "grpo_rewards:raises"],
                                 max_steps=1), task=GRPO())
    # stopped at step 0, before any checkpoint: the end of the run says so (before: "the latest checkpoint holds the
    # last good step", of which there was none)
    assert json.load(open(tmp_path / "run" / "summary.json"))["latest_checkpoint"] is None
    assert "model: not exported (training stopped before any checkpoint was written: a relaunch starts over)" in \
        capsys.readouterr().out


HELD_OUT = "recipes/grpo.py does not use it: delete it"  # toolkit.config.help.unused_field's line for a field GRPO ignores


@pytest.mark.parametrize("values, field, message", [
    ({"loss_type": "sigmoid"}, "loss_type", "GRPO's loss_type is one of dapo, grpo, bnpo, dr_grpo"),
    ({"num_generations": 3}, "num_generations", "global batch of 8 completions"),
    ({"reward_funcs": ["no_such_module:f"]}, "reward_funcs", "cannot import 'no_such_module:f'"),
    ({"reward_funcs": ["arithmetic_correct"], "reward_weights": [1.0, 2.0]}, "reward_weights", "2 weights for 1"),
    # TRL 1.16 calls a reward function with trainer_state, log_metric, log_extra and every column by name; before,
    # a function that could not take them (no **kwargs) or needed a column the data lacks failed at step 0, after the
    # weights loaded and the first completions were drawn
    ({"reward_funcs": ["grpo_rewards:no_kwargs"]}, "reward_funcs",
     "grpo_rewards:no_kwargs cannot be called as TRL 1.16 calls a reward function .* got an unexpected keyword "
     "argument 'completion_ids'; add \\*\\*kwargs to its parameters"),
    ({"reward_funcs": ["grpo_rewards:needs_difficulty"]}, "reward_funcs",
     "missing a required argument: 'difficulty'; the data's columns are \\['answer'\\]"),
    # fields GRPO ignores (no held-out evaluation; prompts whole, tokenized once): before, accepted and unused
    ({"eval_steps": 5}, "eval_steps", HELD_OUT),
    ({"eval_on_start": True}, "eval_on_start", HELD_OUT),
    ({"validation_split_percentage": 10}, "validation_split_percentage", HELD_OUT),
    ({"max_eval_samples": 4}, "max_eval_samples", HELD_OUT),
    ({"block_size": 32}, "block_size", HELD_OUT),
    ({"per_device_eval_batch_size": 2}, "per_device_eval_batch_size", HELD_OUT),
    ({"preprocessing_num_workers": 2}, "preprocessing_num_workers", HELD_OUT),
    ({"dataset_format": "messages"}, "dataset_format", HELD_OUT),
    ({"dataset_mixture": {"datasets": [{"id": "arithmetic"}]}, "dataset_name": None}, "dataset_mixture",
     "GRPO does not take it here"),
])
def test_grpo_refuses_before_any_work(tiny_model, tmp_path, monkeypatch, values, field, message):
    """What every run checks before its weights load (``build.check_inputs``: a recipe's ranks, ``toolkit train``
    before it launches, a notebook's config built without a recipe)."""
    import sys

    from helpers import ROOT

    from toolkit.config import config_from_dict
    from toolkit.errors import ConfigError
    from toolkit.tasks.grpo.task import GRPO
    from toolkit.training.build import check_inputs

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    cfg = config_from_dict({k: v for k, v in _values(tiny_model, tmp_path, **values).items() if v is not None})
    with pytest.raises(ConfigError, match=message) as err:
        check_inputs(cfg, GRPO(), log=lambda line: None)
    assert err.value.field_name == field


def test_toolkit_train_grpo_finds_a_reward_module_beside_the_user_and_refuses_a_bad_one(tiny_model, tmp_path,
                                                                                         monkeypatch, capsys):
    """``toolkit train grpo --reward_funcs my_module:f`` with my_module.py in the current directory: the launching
    process (a console script: its path starts at bin/) and the ranks (recipes/grpo.py: at recipes/) have no current
    directory on their path; before, the check refused the module. A function the module lacks: one line, exit 2,
    before any launch."""
    import sys

    from toolkit.cli import train as launch

    (tmp_path / "beside_user_rewards.py").write_text("def score(prompts, completions, **kwargs):\n"
                                                      "    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "beside_user_rewards", raising=False)
    fields = ["--model_name_or_path", tiny_model, "--dataset_name", "arithmetic", "--output_dir", str(tmp_path / "o"),
              "--chat_template", "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "--num_generations", "4",
              "--per_device_train_batch_size", "4", "--max_completion_length", "8"]  # within the tiny model's 64
    launch.check("grpo", launch.strategy_config("ddp"), 1, [*fields, "--reward_funcs", "beside_user_rewards:score"])
    argv = ["grpo", "--model", tiny_model, "--dataset", "arithmetic", *fields[4:], "--reward_funcs",
            "beside_user_rewards:nope"]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: reward_funcs: cannot import 'beside_user_rewards:nope'")
    monkeypatch.delitem(sys.modules, "beside_user_rewards", raising=False)


def test_beta_and_loss_type_take_each_tasks_default_and_values(tiny_model, tmp_path):
    """One field each, unset by default: GRPO's beta 0 and dapo, DPO's 0.1 and sigmoid (TRL's); DPO refuses a GRPO
    loss and beta 0."""
    from toolkit.config import config_from_dict
    from toolkit.errors import ConfigError
    from toolkit.tasks.dpo import DPO
    from toolkit.tasks.grpo.task import GRPO

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

    from toolkit.reporting import plots

    rows = [{"step": s, "tokens_seen": 100 * s, "loss": 0.0, "reward": 0.1 * s, "loss_unit": "GRPO objective"}
            for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plots.train_key(rows) == "reward" and plots.train_key([{"loss": 1.0}]) == "loss"
    assert os.path.getsize(plots.plot_run(str(tmp_path))) > 0


def test_the_builtin_rewards():
    from toolkit.tasks.grpo.rewards import arithmetic_correct, arithmetic_dataset, arithmetic_format

    completions = ["12 + 7 = 19.", "19", " 18", "The answer is 19 apples", "none"]
    assert arithmetic_correct(None, completions, answer=[19] * 5) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert arithmetic_format(None, completions) == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert arithmetic_correct(None, [[{"role": "assistant", "content": "19"}]], answer=[19]) == [1.0]
    rows = arithmetic_dataset()["train"]
    a, b = (int(x) for x in rows[0]["prompt"][0]["content"][len("What is "):].split("?")[0].split(" + "))
    assert rows[0]["answer"] == a + b and len(rows) == 512

"""Reward functions for GRPO's launched tests (TRL's signature, named by import path ``grpo_rewards:NAME``; this
folder is on the launched processes' path): rewards a random tiny model's completions earn unequally, so that the
advantages, and the gradients, are not zero."""


def characters(prompts, completions, **kwargs) -> list[float]:
    """The completion's length in characters, over 10."""
    return [len(c if isinstance(c, str) else c[0]["content"]) / 10 for c in completions]


def vowels(prompts, completions, answer, **kwargs) -> list[float]:
    """The share of vowels in the completion, plus whether it names the answer's last digit (a column by name)."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[0]["content"]
        out.append(sum(ch in "aeiou" for ch in text) / max(len(text), 1) + float(str(a)[-1] in text))
    return out


def raises(prompts, completions, **kwargs) -> list[float]:
    raise ValueError("no score for these")


def too_few(prompts, completions, **kwargs) -> list[float]:
    return [0.0]


PROMPTS_SEEN: list = []  # what the reward functions were given as prompts (in-process tests read it)


def none_for_odd(prompts, completions, topic, **kwargs) -> list:
    """TRL's "no reward here": None for every other completion; the rest, the completion's length plus its row's
    ``topic`` column's; records the prompts."""
    PROMPTS_SEEN.extend(prompts)
    return [None if i % 2 else len(c) + len(t) for i, (c, t) in enumerate(zip(completions, topic))]


def as_array(prompts, completions, **kwargs):
    """A numpy array (TRL takes any sequence of numbers): the share of spaces."""
    import numpy as np

    return np.array([c.count(" ") / max(len(c), 1) for c in completions])


CALLS: list = []  # what ``record`` was given, one dict a call (in-process tests read it)


def record(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs) -> list[float]:
    """Records its call (the completion ids, the keyword names, the trainer state's step and max_steps), logs a metric
    (TRL's log_metric: the completions it saw) and an extra column (log_extra); rewards each completion's length in
    tokens."""
    CALLS.append({"completion_ids": completion_ids, "keywords": sorted(kwargs), "step": trainer_state.global_step,
                  "max_steps": trainer_state.max_steps})
    log_metric("record/completions", len(completions))
    log_extra("record_lengths", [len(ids) for ids in completion_ids])
    return [float(len(ids)) for ids in completion_ids]


async def async_vowels(prompts, completions, **kwargs) -> list[float]:
    """An ``async def`` reward (TRL awaits it, e.g. a judge behind an API): the completion's vowels."""
    import asyncio

    await asyncio.sleep(0)
    return [float(sum(ch in "aeiou" for ch in (c if isinstance(c, str) else c[0]["content"]))) for c in completions]


def zero(prompts, completions, **kwargs) -> list[float]:
    """A reward no completion earns: every group's rewards equal (std 0), every advantage 0."""
    return [0.0] * len(completions)


def no_kwargs(prompts, completions, answer) -> list[float]:
    """TRL's signature without **kwargs: TRL 1.16's call (trainer_state, log_metric, ...) cannot reach it."""
    return [0.0] * len(completions)


def needs_difficulty(prompts, completions, difficulty, **kwargs) -> list[float]:
    """A column the built-in arithmetic set does not have."""
    return [float(d) for d in difficulty]


def vowels_ending_turns(prompts, completions, answer, completion_ids, end_of_turn, log_metric, **kwargs) -> list[float]:
    """``vowels``, and where the completions it scores end (the capability matrix's GRPO cells on a chat model): of
    their ids (as the loss takes them), how many reached the end of a turn (``end_of_turn``: the id of Qwen2's
    <|im_end|>, a column) and how many tokens came after one (generated, scored and trained past the turn)."""
    reached = after = 0
    for ids, end in zip(completion_ids, end_of_turn):
        ids = list(ids)
        if end in ids:
            reached += 1
            after += len(ids) - ids.index(end) - 1
    log_metric("turns/reached_end", reached)
    log_metric("turns/tokens_after_end", after)
    return vowels(prompts, completions, answer)

"""GRPO's rewards: reward functions named in the config (import paths, TRL's signature), called on a batch of
completions with one line naming a function that fails; and the built-in offline prompt set with verifiable rewards.

A reward function takes ``prompts``, ``completions`` (text, or for conversational prompts a list with one assistant
message each, TRL's convention), ``completion_ids`` and every other column of the dataset as keyword arguments, and
returns one float per completion (TRL's signature; ``**kwargs`` takes the columns it does not use).

``arithmetic`` (``dataset_name: arithmetic``): questions "What is a + b?" (a, b < 50, seeded) as chat prompts with
their ``answer`` column; ``arithmetic_correct`` rewards a completion whose last number is the answer ("12 + 7 =
19" is right),
``arithmetic_format`` one that is a number alone (digits, nothing else but spaces and a final period).
"""

from __future__ import annotations

import importlib
import os
import random
import re
import sys

from toolkit.errors import ConfigError, TrainingStopped

ARITHMETIC = "arithmetic"
NUMBER = re.compile(r"-?\d+")
NUMBER_ALONE = re.compile(r"\s*-?\d+\.?\s*")


def _text(completion) -> str:
    """A completion's text: the string, or the content of its assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def arithmetic_correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's last number is the answer, else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        found = NUMBER.findall(_text(completion))
        out.append(1.0 if found and int(found[-1]) == int(expected) else 0.0)
    return out


def arithmetic_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 where the completion is a number alone, else 0.0."""
    return [1.0 if NUMBER_ALONE.fullmatch(_text(c)) else 0.0 for c in completions]


BUILTIN_REWARDS = {"arithmetic_correct": arithmetic_correct, "arithmetic_format": arithmetic_format}
DEFAULT_REWARDS = {ARITHMETIC: ["arithmetic_correct", "arithmetic_format"]}


def arithmetic_dataset(rows: int = 512, seed: int = 0):
    """The built-in set: ``rows`` questions as chat prompts, with their ``answer`` (train only)."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(rows):
        a, b = rng.randrange(50), rng.randrange(50)
        prompts.append([{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}])
        answers.append(a + b)
    return DatasetDict({"train": Dataset.from_dict({"prompt": prompts, "answer": answers})})


def load_reward_funcs(names: list[str] | None, dataset_name: str | None) -> list[tuple[str, object]]:
    """(name, function) of each reward: a built-in's name or 'module:function'; unset, the built-in set's."""
    if not names:
        names = DEFAULT_REWARDS.get(dataset_name)
        if names is None:
            raise ConfigError("reward_funcs", "name the reward functions, e.g. reward_funcs: [my_module:my_reward] "
                                              "(TRL's signature: prompts, completions, **columns -> list of floats)")
    return [(name, _resolve(name)) for name in names]


def _resolve(name: str):
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ConfigError("reward_funcs", f"{name!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) "
                                          "nor an import path 'module:function'")
    if os.getcwd() not in sys.path and "" not in sys.path:  # a module beside the user, as `python -m` finds it:
        sys.path.append(os.getcwd())  # a launched recipe's path starts at recipes/, the `toolkit` command's at bin/
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError("reward_funcs", f"cannot import {name!r}: {e}; check the module is in the current "
                                          "directory or on PYTHONPATH and defines the function") from None
    if not callable(fn):
        raise ConfigError("reward_funcs", f"{name!r} is not callable")
    return fn


def check_weights(weights: list[float] | None, funcs: list) -> list[float]:
    """One weight per reward function (TRL's reward_weights); 1.0 each when unset."""
    if weights is None:
        return [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError("reward_weights", f"{len(weights)} weights for {len(funcs)} reward functions; give one each")
    return [float(w) for w in weights]


def score(funcs: list[tuple[str, object]], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> tuple[list[list[float]] | None, str | None]:
    """(rewards per function, each a float per completion; None on failure, then) the one line that names the
    function and what it did wrong: raised, or returned other than a sequence of len(completions) numbers. A None is
    TRL's "no reward for this completion": NaN here, as TRL converts it (``toolkit.tasks.grpo.loss.combine_rewards`` then
    leaves it out). The caller raises the line on every rank at once (``TrainingStopped``), so no rank waits in a
    collective for another."""
    out = []
    for name, fn in funcs:
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # noqa: BLE001 (any error of the user's function stops the run, naming it)
            return None, f"reward function {name} raised {type(e).__name__}: {e}"
        sized = not isinstance(values, (str, bytes, dict)) and hasattr(values, "__len__") and hasattr(values, "__iter__")
        if not sized or len(values) != len(completions):  # a list, a tuple, a numpy array or a tensor, as TRL takes
            got = f"{len(values)} values" if sized else type(values).__name__
            return None, f"reward function {name} returned {got} for {len(completions)} completions; return a list " \
                         "of one float per completion"
        try:
            out.append([float("nan") if v is None else float(v) for v in values])
        except (TypeError, ValueError):
            return None, f"reward function {name} returned a value that is not a number: {list(values)!r:.120}"
    return out, None


def stop(errors: list[str | None]) -> None:
    """Every rank's ``score`` errors, gathered: the first one stops the run."""
    for error in errors:
        if error:
            raise TrainingStopped(error)

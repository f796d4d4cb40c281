"""GRPO's rewards: reward functions named in the config (import paths, TRL's signature), called on a batch of
completions with one line naming a function that fails; and the built-in offline prompt set with verifiable rewards.

A reward function takes ``prompts``, ``completions`` (text, or for conversational prompts a list with one assistant
message each, TRL's convention), ``completion_ids``, every other column of the dataset, and TRL 1.16's
``trainer_state`` (transformers' ``TrainerState``: ``global_step``, ``max_steps``, ``epoch``), ``log_metric(name,
value)`` and ``log_extra(column, values)`` as keyword arguments, and returns one number per completion (or None: no
reward for it), as TRL 1.16 calls it; ``**kwargs`` takes what it does not use. A function that cannot take them is
refused before any work (``check_signatures``): TRL's call would fail at the first generation, after the weights
loaded. An ``async def`` function is awaited, every async one of a batch together (TRL runs them with
``asyncio.gather``), in a thread of its own (a notebook's kernel already runs an event loop).

``arithmetic`` (``dataset_name: arithmetic``): questions "What is a + b?" (a, b < 50, seeded) as chat prompts with
their ``answer`` column; ``arithmetic_correct`` rewards a completion whose last number is the answer ("12 + 7 =
19" is right),
``arithmetic_format`` one that is a number alone (digits, nothing else but spaces and a final period).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import os
import random
import re
import sys

from toolkit.errors import ConfigError, TrainingStopped

ARITHMETIC = "arithmetic"
NUMBER = re.compile(r"-?\d+")
NUMBER_ALONE = re.compile(r"\s*-?\d+\.?\s*")
# what TRL 1.16 passes every reward function by name beside the dataset's columns (GRPOTrainer._calculate_rewards)
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


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
    funcs = [(name, _resolve(name)) for name in names]
    check_signatures(funcs)  # with the dataset's columns again once they are known (GRPO.load_raw)
    return funcs


def check_signatures(funcs: list[tuple[str, object]], columns: list[str] | None = None) -> None:
    """Each function takes what TRL 1.16 passes it by name (``TRL_KEYWORDS`` and the dataset's ``columns``) and, once
    the columns are known (not None), needs nothing else: one line naming the function and the argument otherwise."""
    keywords = [*TRL_KEYWORDS, *(columns or ())]
    for name, fn in funcs:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin or an extension's callable: nothing to read, it answers at step 0
            continue
        try:
            (signature.bind if columns is not None else signature.bind_partial)(**dict.fromkeys(keywords))
        except TypeError as e:
            fix = (f"the data's columns are {list(columns)}: use one of them, or give that parameter a default"
                   if "missing" in str(e) else "add **kwargs to its parameters")
            raise ConfigError("reward_funcs", f"{name} cannot be called as TRL 1.16 calls a reward function (by name: "
                                              f"{', '.join(keywords)}): {e}; {fix}") from None


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
          columns: dict[str, list], context: dict | None = None) -> tuple[list[list[float]] | None, str | None]:
    """(rewards per function, each a float per completion; None on failure, then) the one line that names the
    function and what it did wrong: raised, or returned other than a sequence of len(completions) numbers. A None is
    TRL's "no reward for this completion": NaN here, as TRL converts it (``toolkit.tasks.grpo.loss.combine_rewards`` then
    leaves it out). ``context``: TRL's ``trainer_state``, ``log_metric`` and ``log_extra``, passed by name with the
    columns. ``async def`` functions (or any that return an awaitable) are awaited together, after the others ran.
    The caller raises the line on every rank at once (``TrainingStopped``), so no rank waits in a collective for
    another."""
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns,
              **(context or {})}
    returned = {}
    for name, fn in funcs:
        try:
            returned[name] = fn(**kwargs)
        except Exception as e:  # noqa: BLE001 (any error of the user's function stops the run, naming it)
            for value in returned.values():  # the async ones called so far: never awaited now
                if inspect.iscoroutine(value):
                    value.close()
            return None, f"reward function {name} raised {type(e).__name__}: {e}"
    pending = [name for name, value in returned.items() if inspect.isawaitable(value)]
    if pending:
        for name, value in zip(pending, _await_all([returned[n] for n in pending])):
            if isinstance(value, Exception):
                return None, f"reward function {name} raised {type(value).__name__}: {value}"
            returned[name] = value
    out = []
    for name, _ in funcs:
        values, error = _numbers(name, returned[name], len(completions))
        if error:
            return None, error
        out.append(values)
    return out, None


def _await_all(awaitables: list) -> list:
    """Every awaitable's result (or the exception it raised), awaited together on an event loop in a thread of its
    own: ``asyncio.run`` refuses to start in a thread whose loop runs (a notebook kernel's)."""
    async def together():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, together()).result()


def _numbers(name: str, values, expected: int) -> tuple[list[float] | None, str | None]:
    """A function's return value as floats, taken as TRL takes it (``torch.tensor(values, dtype=float32)``, None as
    NaN): a list, a tuple, a numpy array or a tensor of numbers; a string, even "1.5", is no number (float() would
    take it, TRL does not)."""
    import torch

    sized = not isinstance(values, (str, bytes, dict)) and hasattr(values, "__len__") and hasattr(values, "__iter__")
    if not sized or len(values) != expected:
        got = f"{len(values)} values" if sized else type(values).__name__
        return None, f"reward function {name} returned {got} for {expected} completions; return a list of one " \
                     "float per completion"
    try:
        tensor = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    if tensor is None or tensor.dim() != 1:
        return None, f"reward function {name} returned a value that is not a number: {list(values)!r:.120}"
    return tensor.tolist(), None


def stop(errors: list[str | None]) -> None:
    """Every rank's ``score`` errors, gathered: the first one stops the run."""
    for error in errors:
        if error:
            raise TrainingStopped(error)

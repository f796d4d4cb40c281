"""The small checks every argument class shares (``_positive``, ``_one_of``, ...) and the vocabulary of its fields'
metadata (which tasks take a field), so that each feature's fields (``toolkit.config.grpo``, ...) check themselves
exactly as ``toolkit.config``'s do, with the same messages.

Standard library and yaml only (``toolkit.errors``): a config is checked before torch is imported.
"""

from __future__ import annotations

import difflib
import math

import yaml

from toolkit.errors import ConfigError

DATA_EXTENSIONS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# The tasks (Task.name) of a field that only some recipes use (metadata "tasks"; toolkit.config.help): --help lists
# it for those recipes only, and the others refuse it.
DPO_ONLY = ("dpo",)
GRPO_ONLY = ("grpo",)
PREFERENCE_TASKS = ("dpo", "grpo")  # beta and loss_type: one field each, the task's own values and default
CLASSIFICATION_ONLY = ("sequence-classification",)
CHAT_TASKS = ("chat-sft", "dpo", "grpo")  # chat_template: chats, DPO's and GRPO's prompts as messages
TEXT_TASKS = ("causal-lm", "chat-sft", "sequence-classification")  # DPO's columns are prompt/chosen/rejected
# packing and streaming: the tasks that take them; the others refuse them in Task.check, saying why ("task_checks")
PACKING_TASKS = ("causal-lm", "chat-sft")
# Held-out evaluation, rows cut to block_size, and a tokenizing map with workers and a cache: every task but GRPO,
# whose prompts are whole rows (max_prompt_length), tokenized once, and which has no held-out evaluation.
HELD_OUT_TASKS = ("causal-lm", "chat-sft", "dpo", "sequence-classification")
# The tasks whose data toolkit.data.formats converts (dataset_format, a dataset_mixture's sets): not the classifier (one
# labelled set) nor GRPO (prompts only, a loss over sampled completions); those two refuse dataset_mixture themselves,
# saying why.
FORMAT_TASKS = ("causal-lm", "chat-sft", "dpo")
# The tasks whose loss is over a vocabulary's logits (loss_chunk_size); the classifier (a class head) refuses it.
LOGIT_TASKS = ("causal-lm", "chat-sft", "dpo", "grpo")


def _closest(name: str, choices) -> str | None:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    if not close:
        return None
    # A name that drops the train/eval part (per_device_batch_size) is nearer the eval twin by difflib's ratio only
    # because "eval_" is one letter shorter than "train_"; the train-side field is what such a name means far more
    # often, so when both twins are close matches, the train one is preferred.
    twin = close[0].replace("eval", "train")
    if "eval" in close[0] and "eval" not in name and twin in close:
        return twin
    return close[0]


def _suggest(name: str, choices) -> str:
    close = _closest(name, choices)
    return f" Did you mean '{close}'?" if close else ""


def _positive(obj, *names, allow_none=False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None and allow_none:
            continue
        if value is None or value <= 0:
            raise ConfigError(name, f"must be a positive integer, got {value!r}")


def _at_least_zero(obj, *names, why: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ConfigError(name, f"must be >= 0{why}, got {value}")


def _finite(obj, *names) -> None:
    # NaN passes every comparison check (nan < 0 is False) and a NaN max_grad_norm silently makes the weights NaN.
    for name in names:
        value = getattr(obj, name)
        if not math.isfinite(value):
            raise ConfigError(name, f"must be a finite number, got {value}")


def _fraction(obj, *names, why: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0 <= value < 1:  # also refuses NaN
            raise ConfigError(name, f"must be in [0, 1){why}, got {value}")


def _one_of(obj, name: str, choices) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(name, f"unknown value {value!r}; choose one of {', '.join(choices)}."
                                f"{_suggest(value, choices)}")


def _mapping(name: str, value):
    """A mapping field's value as a dict: YAML gives one, the command line its YAML (or JSON) text."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(name, f"is not a YAML mapping: {str(e).splitlines()[0]}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(name, f"expected a mapping, e.g. {{key: value}}, got {value!r:.200}")
    return parsed

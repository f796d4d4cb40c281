"""GRPO's fields (TRL's names: the sampling, the clipped surrogate, the rewards) and their checks, a part of
``toolkit.config``'s ``TrainingArguments``; what they do is ``toolkit.tasks.grpo.task``'s and ``toolkit.tasks.grpo.loss``'s. The
fields GRPO shares with DPO (``beta``, ``loss_type``) stay in ``toolkit.config``: one field each, both tasks' values.

Standard library only (and toolkit.errors, toolkit.config.checks): no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from toolkit.config.checks import GRPO_ONLY, _at_least_zero, _finite, _one_of, _positive
from toolkit.errors import ConfigError

GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")  # GRPO's (toolkit.tasks.grpo.loss)
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GRPOArguments:
    """A part of ``TrainingArguments``: its fields come after that class's own (in --help and config.yaml)."""

    num_generations: int = field(
        default=8, metadata={"help": "GRPO (TRL's name): completions sampled per prompt, a group; the global batch "
                                     "(ranks x per_device_train_batch_size x gradient_accumulation_steps) counts "
                                     "completions and must be a multiple of it.", "tasks": GRPO_ONLY}
    )
    max_prompt_length: Optional[int] = field(
        default=None, metadata={"help": "GRPO: cut each prompt longer than this many tokens to its last ones (the "
                                        "log and summary.json count the prompts cut and the tokens removed). Unset: "
                                        "prompts stay whole, as TRL 1.16 keeps them (it has no such field).",
                                "tasks": GRPO_ONLY}
    )
    max_completion_length: int = field(
        default=512, metadata={"help": "GRPO (TRL's name): tokens generated per completion at most; a completion "
                                       "with no EOS within it is truncated.", "tasks": GRPO_ONLY}
    )
    temperature: float = field(default=1.0, metadata={"help": "GRPO (TRL's name): the sampling temperature (the "
                                                              "log-probs of the loss are taken at it too).",
                                                      "tasks": GRPO_ONLY})
    top_p: float = field(default=1.0, metadata={"help": "GRPO (TRL's name): nucleus sampling's probability mass; 1 "
                                                        "turns it off.", "tasks": GRPO_ONLY})
    top_k: int = field(default=0, metadata={"help": "GRPO (TRL's name): sample among the k likeliest tokens; 0 turns "
                                                    "it off.", "tasks": GRPO_ONLY})
    epsilon: float = field(default=0.2, metadata={"help": "GRPO (TRL's name): the ratio is clipped to [1 - epsilon, "
                                                          "1 + epsilon_high].", "tasks": GRPO_ONLY})
    epsilon_high: Optional[float] = field(default=None, metadata={"help": "GRPO (TRL's name): the upper clip; unset: "
                                                                          "epsilon.", "tasks": GRPO_ONLY})
    num_iterations: int = field(
        default=1, metadata={"help": "GRPO (TRL's name): optimizer steps per generated batch; the steps after the "
                                     "first reuse its completions with the old policy's log-probs (clipped ratio).",
                             "tasks": GRPO_ONLY}
    )
    scale_rewards: str = field(
        default="group", metadata={"help": "GRPO (TRL's name): divide each advantage by its group's reward std "
                                           "('group'), the global batch's ('batch') or not ('none'), + 1e-4.",
                                   "tasks": GRPO_ONLY}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "GRPO (TRL's name): completions with no EOS within max_completion_length "
                                         "take no part in the loss.", "tasks": GRPO_ONLY}
    )
    reward_funcs: Optional[list[str]] = field(
        default=None, metadata={"help": "GRPO: reward functions, import paths 'module:function' (TRL 1.16's call: "
                                        "prompts, completions, completion_ids, the dataset's other columns, "
                                        "trainer_state, log_metric and log_extra as keyword arguments -> a list of "
                                        "floats; async def is awaited) or a built-in's name (arithmetic_correct, "
                                        "arithmetic_format). Unset: the built-in set's.",
                                "nargs": "+", "tasks": GRPO_ONLY}
    )
    reward_weights: Optional[list[float]] = field(
        default=None, metadata={"help": "GRPO (TRL's name): one weight per reward function; unset: 1 each.",
                                "nargs": "+", "tasks": GRPO_ONLY}
    )

    def _check_grpo(self) -> None:
        """GRPO's fields on their own (the global batch against num_generations needs the world size: the task's
        check)."""
        _positive(self, "max_completion_length", "num_iterations")
        _positive(self, "max_prompt_length", allow_none=True)
        _at_least_zero(self, "top_k", why=" (0 turns it off)")
        _finite(self, "temperature", "top_p", "epsilon")
        # the clip range [1 - epsilon, 1 + epsilon_high] holds 1 (an unclipped ratio): a negative bound inverts it
        _at_least_zero(self, "epsilon", why=" (the ratio is clipped to [1 - epsilon, 1 + epsilon_high])")
        if self.epsilon_high is not None:
            _finite(self, "epsilon_high")
            _at_least_zero(self, "epsilon_high", why=" (the ratio is clipped to [1 - epsilon, 1 + epsilon_high]); "
                                                     "unset: epsilon")
        if self.num_generations < 2:
            raise ConfigError("num_generations", f"must be >= 2 (a group's advantages are its rewards against the "
                                                 f"group's mean), got {self.num_generations}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            name = "temperature" if self.temperature <= 0 else "top_p"
            raise ConfigError(name, f"must be {'> 0' if name == 'temperature' else 'in (0, 1]'}, got "
                                    f"{getattr(self, name)}")
        _one_of(self, "scale_rewards", SCALE_REWARDS)

"""The preference tasks' fields (DPO and GRPO: ``beta``, ``loss_type``, one field each with both tasks' values;
DPO's ``precompute_ref_log_probs``) and their checks, a part of ``toolkit.config``'s ``TrainingArguments``. Which
task takes which value and the task's default is the task's (``toolkit.tasks.dpo``, ``toolkit.tasks.grpo.task``).

Standard library only (and toolkit.config.checks, toolkit.config.grpo): no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from toolkit.config.checks import DPO_ONLY, PREFERENCE_TASKS, _at_least_zero, _finite, _one_of
from toolkit.config.grpo import GRPO_LOSS_TYPES

LOSS_TYPES = ("sigmoid", "ipo")  # DPO losses (TRL's loss_type names)


@dataclass
class PreferenceArguments:
    """A part of ``TrainingArguments``: its fields come after that class's own (in --help and config.yaml)."""

    beta: Optional[float] = field(
        default=None, metadata={"help": "DPO and GRPO (TRL's name). DPO: how far the policy may move from the "
                                        "reference; the loss is -logsigmoid(beta x the difference of the chosen and "
                                        "rejected log-ratios); must be > 0. GRPO: the weight of the per-token KL to "
                                        "the reference; 0 loads no reference. Unset: the task's default (DPO: 0.1, "
                                        "GRPO: 0.0, TRL's).",
                                "tasks": PREFERENCE_TASKS}
    )
    loss_type: Optional[str] = field(
        default=None, metadata={"help": "DPO and GRPO (TRL's names). DPO: 'sigmoid', the loss of the DPO paper, or "
                                        "'ipo' (TRL's IPO: the squared distance of the token-averaged log-ratio "
                                        "difference from 1/(2 beta)). GRPO: 'dapo' (over the global batch's "
                                        "completion tokens), 'grpo' (each completion's token mean, averaged), "
                                        "'bnpo' (here the same as dapo: over the global batch's tokens) or "
                                        "'dr_grpo' (over completions x max_completion_length). Unset: the task's "
                                        "default (DPO: sigmoid, GRPO: dapo, TRL's).", "tasks": PREFERENCE_TASKS}
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "DPO (TRL's name): compute the reference's log-probabilities once before "
                                         "training (a whole copy on the device, each rank its share, then freed; "
                                         "kept in output_dir/reference_logps/ for a resume) instead of a live "
                                         "frozen copy sharded like the policy.", "tasks": DPO_ONLY}
    )

    def _check_preference(self) -> None:
        """beta and loss_type on their own: a finite beta >= 0, a loss_type of either task."""
        if self.beta is not None:
            _finite(self, "beta")
            _at_least_zero(self, "beta", why=" (DPO takes > 0, GRPO 0 for no reference)")
        if self.loss_type is not None:  # which task takes which value: the task's check
            _one_of(self, "loss_type", (*LOSS_TYPES, *GRPO_LOSS_TYPES))

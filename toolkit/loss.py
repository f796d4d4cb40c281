"""Causal-LM loss with exact normalisation over the accumulated global batch.

The objective of one optimizer step is the mean token loss over its whole global batch:

    L = (1 / T) * sum over ranks r, micro-steps m, target tokens t of  CE(t)        T = target tokens of the step

Averaging per micro-batch instead (mean of means) weights a token in a short micro-batch more than one in a long
micro-batch: the 2024 transformers accumulation bug (PR #34191). So each micro-step backpropagates its *summed* token
loss, divided by T (all ranks, all micro-steps, counted before the first backward) and multiplied by W * k, because
the framework then divides again:

    - DDP / FSDP average gradients over the W ranks (x 1/W);
    - ``accelerator.backward`` divides by k (and DeepSpeed's engine does the same, ``scale_wrt_gas``) (x 1/k);

leaving sum_r sum_m grad(sum CE) / T = grad L, identical on any world size and accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Target tokens after the causal shift: position i predicts label i+1, so the first label of a row is no target."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row summed cross-entropy (fp32) and per-row target counts, for shifted next-token prediction."""
    shift_logits = logits[..., :-1, :].float()
    shift_labels = labels[..., 1:]
    ce = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    return ce.sum(dim=-1), (shift_labels != IGNORE_INDEX).sum(dim=-1)


def micro_step_loss(
    loss_sum: torch.Tensor,
    local_targets: torch.Tensor,
    global_targets: torch.Tensor,
    num_processes: int,
    accumulation_steps: int,
    normalization: str = "global_tokens",
) -> torch.Tensor:
    """The scalar to hand to ``accelerator.backward`` for one micro-step (see the module docstring)."""
    if normalization == "global_tokens":
        return loss_sum * (num_processes * accumulation_steps) / global_targets.clamp(min=1)
    if normalization == "per_micro_batch":
        # Wrong on purpose (pre-PR-#34191 behaviour), kept to show the bug: each micro-batch's own mean.
        return loss_sum / local_targets.clamp(min=1)
    raise ValueError(f"unknown loss normalization {normalization!r}")

"""GRPO's arithmetic, TRL 1.16's definitions (``trl/trainer/grpo_trainer.py``) on tensors: the per-token
log-probabilities and entropies of completions, the group advantages, the clipped surrogate with its optional KL, and
each ``loss_type`` as a per-row *sum* plus the targets the core divides the global batch's sum by.

Why a row sum and a target count: the core (``toolkit.loss``) divides the summed loss of every micro-batch by the
targets of the whole global batch, which makes N ranks x micro b x accumulation k train as one process with N*b*k.
Each of TRL's losses is such a ratio over its batch (one process, one micro-batch: TRL's loss exactly):

    grpo     mean over completions of (sum over its tokens / its token count)  -> row: that mean, target: 1
    dapo     sum over the batch's completion tokens / their count               -> row: the token sum, target: tokens
    bnpo     TRL's: the same per micro-batch; here over the global batch (one micro-batch: equal to TRL's)
    dr_grpo  sum over the batch's tokens / (completions x max_completion_length) -> row: the token sum, target: L

Per token (p: the policy's log-prob, o: the old policy's, r: the reference's, A: the completion's advantage):

    ratio = exp(p - o);  loss = -min(ratio A, clamp(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta kl
    kl = exp(r - p) - (r - p) - 1   (only with beta > 0; in the loss as ratio x kl, TRL 1.16's bias correction)

With ``num_iterations`` 1 the old policy is the policy itself (``o = p.detach()``: ratio 1, TRL's shortcut).
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def completion_logps(logits: torch.Tensor, completion_ids: torch.Tensor,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each completion token, entropy of the distribution it was drawn from), from the logits
    of the positions that predict the completion (``logits[:, -T-1:-1]`` of prompt + completion), divided by the
    sampling ``temperature`` as TRL's fused head divides them."""
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    token_logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return token_logps, entropy


def _std(x: torch.Tensor, dim=None) -> torch.Tensor:
    """Bessel-corrected standard deviation (TRL's ``nanstd`` on rewards without NaN)."""
    return x.std(dim=dim) if dim is not None else x.std()


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage of each completion, its group's reward std): the completion's reward minus its group's mean, over
    the group's std + 1e-4 (``group``), the batch's (``batch``) or not scaled (``none``). ``rewards``: the global
    batch's weighted rewards, groups of ``num_generations`` consecutive completions."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    group_std = _std(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (group_std + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (_std(rewards).expand_as(rewards) + 1e-4)
    return advantages, group_std


def per_token_losses(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
                     ref_logps: torch.Tensor | None, beta: float, epsilon_low: float,
                     epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(per-token loss, per-token KL or None, importance ratio): the clipped surrogate of the module docstring."""
    old_logps = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)
    loss = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        # TRL 1.16's use_bias_correction_kl (default true): weighted by the ratio, whose gradient counts even where
        # its value is 1 (the unbiased reverse-KL gradient, DeepSeek-V3.2)
        loss = loss + beta * kl * ratio
    return loss, kl, ratio


def row_losses_and_targets(token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str,
                           max_completion_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row summed loss, per-row targets) of ``loss_type`` (the module docstring's table)."""
    mask = mask.to(token_loss.dtype)
    sums = (token_loss * mask).sum(-1)
    tokens = mask.sum(-1)
    if loss_type == "grpo":
        return sums / tokens.clamp(min=1.0), torch.ones_like(sums)
    if loss_type in ("dapo", "bnpo"):
        return sums, tokens
    if loss_type == "dr_grpo":
        return sums, torch.full_like(sums, float(max_completion_length))
    raise ValueError(f"unknown GRPO loss_type {loss_type!r}")


def clip_fractions(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                   epsilon_high: float) -> dict[str, torch.Tensor]:
    """Per-token 0/1 of TRL's ``clip_ratio/low_mean``, ``high_mean`` and ``region_mean`` (masked means are taken by
    the caller over the global batch)."""
    adv = advantages.unsqueeze(1)
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).float()
    return {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": (low + high).clamp(max=1)}

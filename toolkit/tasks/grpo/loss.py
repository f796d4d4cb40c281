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

from toolkit.loss import token_logps

LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def completion_logps(logits: torch.Tensor, completion_ids: torch.Tensor,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each completion token, entropy of the distribution it was drawn from), from the logits
    of the positions that predict the completion (``logits[:, -T-1:-1]`` of prompt + completion), divided by the
    sampling ``temperature`` as TRL's fused head divides them (``toolkit.loss.token_logps``, which the chunked path
    shares)."""
    return token_logps(logits, completion_ids, temperature)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation over the values that are not NaN (TRL's ``nanstd``: NaN with fewer than
    two)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def combine_rewards(per_func: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Each completion's weighted reward, TRL's: a function's NaN (its None: no reward for this completion) counts
    as nothing (``nansum``), and a completion no function rewarded is NaN (left out of its group's statistics; its
    advantage is 0)."""
    rewards = (per_func * torch.tensor(weights, dtype=per_func.dtype).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = float("nan")
    return rewards


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage of each completion, the std it is scaled by: its group's, or the batch's with ``batch``), TRL's
    ``sum_then_normalize``: the completion's reward minus its group's mean, over that std + 1e-4 (``none``: not
    scaled; the std is still the group's, for ``frac_reward_zero_std``). ``rewards``: the global batch's weighted
    rewards (``combine_rewards``), groups of ``num_generations`` consecutive completions; a NaN reward is left out of
    the means and stds and gets advantage 0."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), std


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

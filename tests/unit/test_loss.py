"""``toolkit.loss`` computes what transformers computes, and its accumulation arithmetic gives the global-batch mean.

- ``token_losses`` / ``count_targets`` on padded rows (label -100 at pads, rows of different lengths) agree with
  transformers' own ``ForCausalLMLoss(..., num_items_in_batch=T)`` (what its Trainer uses since the accumulation fix),
  in value and in gradient, for fp32 and bf16 logits (both upcast to fp32);
- ``micro_step_loss`` over W ranks x k micro-steps, after the frameworks' 1/W (gradient average) and 1/k
  (``accelerator.backward``), adds up to the summed token loss / T of the whole global batch, i.e. ForCausalLMLoss on
  the concatenated global batch, gradient included; ``per_micro_batch`` gives the mean of micro-batch means instead,
  which differs when micro-batches have unequal target counts.
"""

from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from toolkit.loss import IGNORE_INDEX, count_targets, micro_step_loss, token_losses

VOCAB = 97


def _batch(lengths, seq_len=None, seed=0, dtype=torch.float32, scale=1.0):
    """Right-padded rows of the given real lengths: random logits, labels = random ids with -100 at the pads."""
    g = torch.Generator().manual_seed(seed)
    seq_len = seq_len or max(lengths)
    logits = (torch.randn(len(lengths), seq_len, VOCAB, generator=g) * scale).to(dtype)
    labels = torch.randint(0, VOCAB, (len(lengths), seq_len), generator=g)
    for i, n in enumerate(lengths):
        labels[i, n:] = IGNORE_INDEX
    return logits, labels


def _ours(logits, labels):
    sums, counts = token_losses(logits, labels)
    return sums.sum() / count_targets(labels), sums, counts


def _theirs(logits, labels):
    return ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=count_targets(labels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_loss_and_gradient(dtype):
    lengths = [9, 4, 1, 6]  # a 1-token row has no target: it must add nothing, not a NaN
    logits, labels = _batch(lengths, seq_len=11, dtype=dtype)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ours, sums, counts = _ours(a, labels)
    theirs = _theirs(b, labels)
    assert ours.dtype == theirs.dtype == torch.float32  # bf16 logits are upcast by both
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    # the count is the number of shifted labels that are not ignored: n - 1 per row of n real tokens
    assert int(count_targets(labels)) == sum(n - 1 for n in lengths) == int(counts.sum())
    assert counts.tolist() == [n - 1 for n in lengths] and float(sums[2].detach()) == 0.0
    ours.backward()
    theirs.backward()
    assert a.grad.dtype == dtype
    # fp32: same math, reduction order may differ; bf16: both gradients are rounded to bf16 from the same fp32 values
    tol = dict(rtol=1e-5, atol=1e-8) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, **tol)
    assert a.grad[:, -1].abs().max() == 0  # the last position predicts nothing
    assert a.grad[0, :8].abs().min() > 0  # every position with a target gets a gradient


def test_row_losses_are_each_rows_own_sum():
    """Per row, the summed loss is that row's loss alone: padding and neighbours change nothing."""
    logits, labels = _batch([8, 3], seq_len=8)
    sums, counts = token_losses(logits, labels)
    for i, n in enumerate([8, 3]):
        alone = ForCausalLMLoss(logits[i : i + 1, :n], labels[i : i + 1, :n], VOCAB, num_items_in_batch=1)
        torch.testing.assert_close(sums[i], alone, rtol=1e-6, atol=0)
        assert int(counts[i]) == n - 1


def _micro_batches(world, accum, seq_len=10):
    """W x k micro-batches of 2 rows, alternately short (3 targets) with a high loss (large logit scale) and long
    (17 targets) with a lower one, so that the mean of means and the global mean are far apart."""
    batches = {}
    for r in range(world):
        for m in range(accum):
            i = r * accum + m
            lengths = [2, 3] if i % 2 == 0 else [seq_len, seq_len - 1]
            batches[r, m] = _batch(lengths, seq_len=seq_len, seed=100 + i, scale=6.0 if i % 2 == 0 else 1.0)
    return batches


@pytest.mark.parametrize("world,accum", [(2, 2), (1, 4), (4, 1), (2, 3)])
def test_accumulated_micro_step_losses_give_the_global_mean(world, accum):
    batches = _micro_batches(world, accum)
    leaves = {key: logits.clone().requires_grad_(True) for key, (logits, _) in batches.items()}
    global_targets = sum(count_targets(labels) for _, labels in batches.values())  # T: all ranks, all micro-steps

    # What the frameworks do with the backward scalars: DDP averages over W ranks, accelerator.backward divides by k.
    total = 0.0
    means = []
    for key, (_, labels) in batches.items():
        sums, counts = token_losses(leaves[key], labels)
        total = total + micro_step_loss(sums.sum(), counts.sum(), global_targets, world, accum) / (world * accum)
        means.append(micro_step_loss(sums.sum(), counts.sum(), global_targets, world, accum,
                                     normalization="per_micro_batch") / (world * accum))
    per_micro = sum(means)

    # transformers' loss on the whole global batch at once
    all_logits = torch.cat([batches[key][0] for key in sorted(batches)]).requires_grad_(True)
    all_labels = torch.cat([batches[key][1] for key in sorted(batches)])
    reference = ForCausalLMLoss(all_logits, all_labels, VOCAB, num_items_in_batch=global_targets)
    torch.testing.assert_close(total, reference, rtol=1e-6, atol=0)

    # the mean of means weights a token of a short micro-batch more: measurably different here
    by_hand = sum(token_losses(*batches[key])[0].sum() / count_targets(batches[key][1]) for key in batches)
    torch.testing.assert_close(per_micro, by_hand / (world * accum), rtol=1e-6, atol=0)
    gap, ref = float((per_micro - reference).detach()), float(reference.detach())
    assert abs(gap) > 0.05 * ref, (gap, ref)

    total.backward()
    reference.backward()
    ours = torch.cat([leaves[key].grad for key in sorted(batches)])
    torch.testing.assert_close(ours, all_logits.grad, rtol=1e-5, atol=1e-9)


def test_unknown_normalization_is_refused():
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="unknown loss normalization"):
        micro_step_loss(one, one, one, 1, 1, normalization="per_token")

"""``train_step`` and ``LoopState`` in process, with no launch: one optimizer step over k padded micro-batches equals
one step on the whole batch at once (the loss normalised by the target tokens of the whole step), and the loop's
position counts steps, epochs and tokens the way a resume reads them back.

The multi-rank form of the same equality runs through ``accelerate launch`` in tests/launch/test_core.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

IGNORE = -100


@pytest.fixture()
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield Accelerator(cpu=True, gradient_accumulation_steps=2)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _tiny_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _micro_batches() -> list[dict]:
    """Two micro-batches of two rows each, of very different lengths (right-padded, pad labels ignored)."""
    from toolkit.data import CausalLMCollator

    gen = torch.Generator().manual_seed(1)
    lengths = [3, 17, 9, 30]
    rows = [{"input_ids": torch.randint(0, 97, (n,), generator=gen).tolist()} for n in lengths]
    for row in rows:
        row["labels"] = list(row["input_ids"])
    collate = CausalLMCollator(pad_token_id=0)
    return [collate(rows[:2]), collate(rows[2:])]


def _one_big_batch_step(model, micro_batches: list[dict], lr: float) -> float:
    """The reference: the mean next-token loss over every target of the step, one backward, one SGD step."""
    total, targets = 0.0, 0
    for batch in micro_batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        total = total + torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                          labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
        targets += int((labels != IGNORE).sum())
    (total / targets).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return float(total.detach())


def _step(accelerator, model, micro_batches, normalization="global_tokens"):
    from transformers import get_scheduler

    from toolkit.loop import train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = get_scheduler("constant", optimizer)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return train_step(accelerator, model, optimizer, scheduler, micro_batches, step=0, data_parallel_size=1,
                      max_grad_norm=0.0, loss_normalization=normalization)


def test_train_step_over_padded_micro_batches_equals_one_big_batch(accelerator):
    model, micro_batches = _tiny_model(), _micro_batches()
    reference = copy.deepcopy(model)
    expected_loss = _one_big_batch_step(reference, micro_batches, lr=0.5)
    result = _step(accelerator, model, micro_batches)
    assert result.targets == sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in micro_batches) == 2 + 16 + 8 + 29
    assert result.tokens == 3 + 17 + 9 + 30
    assert result.skipped is False and result.stop_requested is False
    assert float(result.loss_sum) == pytest.approx(expected_loss, rel=1e-6)
    assert result.grad_norm is not None and result.grad_norm > 0
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
    assert diff < 1e-6, diff


def test_per_micro_batch_normalisation_does_not_equal_one_big_batch(accelerator):
    """The 2024 accumulation bug (a mean of micro-batch means) is visible at this scale: the check above has teeth."""
    model, micro_batches = _tiny_model(), _micro_batches()
    reference = copy.deepcopy(model)
    _one_big_batch_step(reference, micro_batches, lr=0.5)
    _step(accelerator, model, micro_batches, normalization="per_micro_batch")
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
    assert diff > 1e-3, diff


def test_a_nonfinite_gradient_norm_stops_before_the_step(accelerator):
    from toolkit.errors import TrainingStopped

    model, micro_batches = _tiny_model(), _micro_batches()
    before = copy.deepcopy(model.state_dict())
    model.transformer.wte.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    with pytest.raises(TrainingStopped, match="non-finite gradient norm .* at step 1"):
        _step(accelerator, model, micro_batches)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_loop_state_counts_steps_epochs_and_round_trips():
    from toolkit.state import LoopState, StepResult

    state = LoopState(world_size=2, global_batch_size=8)
    result = StepResult(loss_sum=torch.zeros(()), targets=10, tokens=12, grad_norm=1.0)
    ends = [state.finish_step(result, steps_per_epoch=3) for _ in range(4)]
    assert ends == [False, False, True, False]
    assert (state.step, state.epoch, state.step_in_epoch) == (4, 1, 1)
    assert (state.tokens_seen, state.targets_seen, state.samples_seen) == (48, 40, 32)
    assert state.epochs_done(3) == pytest.approx(1 + 1 / 3)
    state.finish_step(StepResult(loss_sum=torch.zeros(()), targets=0, tokens=0, grad_norm=None, skipped=True), 3)
    assert state.skipped_steps == 1
    restored = LoopState()
    restored.load_state_dict(state.state_dict())
    assert restored == state

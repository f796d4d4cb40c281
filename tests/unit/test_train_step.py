"""``train_step`` and ``LoopState`` in process, with no launch: one optimizer step over k padded micro-batches equals
one step on the whole batch at once (the loss normalised by the target tokens of the whole step), and the loop's
position counts steps, epochs and tokens the way a resume reads them back.

The multi-rank form of the same equality runs through ``accelerate launch`` in tests/launch/test_core.py.
"""

from __future__ import annotations

import copy
import math

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
    from toolkit.data.loading import CausalLMCollator

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

    from toolkit.training.loop import train_step

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
    from toolkit.training.state import LoopState, StepResult

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


# ------------------------------------------------------------------------------------- fp16 dynamic loss scaling
INIT_SCALE = 2.0 ** 10


@pytest.fixture()
def fp16_accelerator():
    """An Accelerator whose backward, clip_grad_norm_ and optimizer go through a GradScaler, in process on a CPU.

    accelerate makes no GradScaler on a CPU (and the toolkit refuses fp16 there for real runs:
    tests/launch/test_precision.py::test_fp16_on_a_cpu_is_refused), but torch has one for the CPU, and fp16 autocast.
    Attached before ``prepare`` as accelerate does on a GPU: the AcceleratedOptimizer takes the scaler at prepare
    time, ``backward`` scales the loss when ``scaler`` is set, ``clip_grad_norm_`` unscales when ``native_amp`` is on
    under fp16, and ``native_amp`` also wraps the model's forward in fp16 autocast."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=2)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    accelerator.native_amp = True
    yield accelerator
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _scaled_run(accelerator, steps: int, overflow_at: set[int], **kwargs) -> list[dict]:
    """``steps`` train_step calls, as train() makes them; the gradient hook writes inf at the steps in
    ``overflow_at`` (an overflow, as fp16 makes when the scale is too high). What each step did, one dict a step."""
    from transformers import get_scheduler

    from toolkit.training.loop import train_step
    from toolkit.training.state import LoopState

    model, micro_batches = _tiny_model(), _micro_batches()
    current = {"step": 0}
    model.transformer.wte.weight.register_hook(
        lambda g: torch.full_like(g, float("inf")) if current["step"] in overflow_at else g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert optimizer.scaler is accelerator.scaler  # the optimizer steps through the scaler
    state, overflows, done = LoopState(), 0, []
    for step in range(steps):
        current["step"] = step
        before = [p.detach().clone() for p in model.parameters()]
        lr, scale = scheduler.get_last_lr()[0], accelerator.scaler.get_scale()
        result = train_step(accelerator, model, optimizer, scheduler, micro_batches, step=step, data_parallel_size=1,
                            max_grad_norm=1.0, overflows=overflows, **kwargs)
        overflows = result.overflows
        state.finish_step(result, steps_per_epoch=steps)
        done.append({"result": result, "scale_before": scale, "scale_after": accelerator.scaler.get_scale(),
                     "lr_before": lr, "lr_after": scheduler.get_last_lr()[0],
                     "changed": any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))})
    assert state.step == steps
    return done, state


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_an_fp16_overflow_is_skipped_as_the_scaler_skips_it_and_the_run_goes_on(fp16_accelerator, skip_nonfinite):
    """Before the fix: TrainingStopped at step 2 (the unscaled norm is inf), or with skip_nonfinite_steps the scaler
    never updated and the next step raised "unscale_() has already been called"."""
    done, state = _scaled_run(fp16_accelerator, 5, overflow_at={1}, skip_nonfinite=skip_nonfinite)
    overflow = done[1]
    assert overflow["result"].skipped and overflow["result"].overflows == 1
    assert not math.isfinite(overflow["result"].grad_norm)
    assert not overflow["changed"], "the overflow step changed the weights"
    assert overflow["scale_after"] == overflow["scale_before"] / 2 == INIT_SCALE / 2  # the scaler backed off
    assert overflow["lr_after"] == overflow["lr_before"], "the scheduler stepped on a skipped step"
    for i in (0, 2, 3, 4):
        step = done[i]
        assert not step["result"].skipped and step["result"].overflows == 0, i
        assert step["changed"], f"step {i + 1} did not train"
        assert math.isfinite(float(step["result"].loss_sum)) and math.isfinite(step["result"].grad_norm)
        assert step["lr_after"] < step["lr_before"]  # a linear decay steps on every applied step
    assert done[4]["scale_after"] == INIT_SCALE / 2  # growth comes only after 2000 good steps
    assert state.skipped_steps == 1


def test_fp16_overflows_in_a_row_stop_the_run_at_the_limit(fp16_accelerator):
    from toolkit.errors import TrainingStopped

    with pytest.raises(TrainingStopped, match=r"3 fp16 overflows in a row at step 3 \(max_consecutive_overflows: 3\)"):
        _scaled_run(fp16_accelerator, 5, overflow_at={0, 1, 2, 3, 4}, max_consecutive_overflows=3)
    assert fp16_accelerator.scaler.get_scale() == INIT_SCALE / 8  # each of the three backed the scale off


def test_fp16_overflows_not_in_a_row_do_not_stop_the_run(fp16_accelerator):
    """The count starts again after a step that trains."""
    done, state = _scaled_run(fp16_accelerator, 5, overflow_at={0, 1, 3, 4}, max_consecutive_overflows=3)
    assert [d["result"].overflows for d in done] == [1, 2, 0, 1, 2] and state.skipped_steps == 4


def test_without_a_scaler_a_nonfinite_norm_is_skipped_only_when_asked(accelerator):
    """bf16 and fp32 have no scaler to explain an inf: skip_nonfinite_steps skips it (the loop counts it), nothing
    is an overflow."""
    model, micro_batches = _tiny_model(), _micro_batches()
    before = copy.deepcopy(model.state_dict())
    model.transformer.wte.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    from transformers import get_scheduler

    from toolkit.training.loop import train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = get_scheduler("constant", optimizer)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    result = train_step(accelerator, model, optimizer, scheduler, micro_batches, step=0, data_parallel_size=1,
                        max_grad_norm=1.0, skip_nonfinite=True, max_consecutive_overflows=1)
    assert result.skipped and result.overflows == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _FakeEngine:
    """The four things ``_deepspeed_outcome`` asks of DeepSpeed 0.19.8's engine after its step. A stand-in for the
    decision's unit test only: DeepSpeed's fp16 engine cannot run on the CPU ranks here (no fp16 there, and the
    toolkit refuses fp16 without a GPU); bench/gpu_check.sh runs the real one on a GPU."""

    def __init__(self, fp16: bool, applied: bool, norm: float | None, global_steps: int = 1):
        self.fp16, self.applied, self.norm, self.global_steps = fp16, applied, norm, global_steps

    def fp16_enabled(self):
        return self.fp16

    def was_step_applied(self):
        return self.applied

    def get_global_grad_norm(self):
        return self.norm


def test_deepspeed_fp16_overflow_is_skipped_and_other_nonfinite_norms_stop():
    """DeepSpeed's fp16 engine reports inf as the global norm of a step its loss scaler skipped
    (stage_1_and_2.py / stage3.py set _global_grad_norm = inf on overflow; _take_model_step sets _step_applied =
    not overflow and counts skipped_steps): before the fix, that inf stopped every fp16 DeepSpeed run at its first
    overflow."""
    from toolkit.errors import TrainingStopped
    from toolkit.training.loop import _deepspeed_outcome, _overflow_streak

    inf = float("inf")
    assert _deepspeed_outcome(_FakeEngine(fp16=True, applied=False, norm=inf), step=0) == (inf, True)
    assert _deepspeed_outcome(_FakeEngine(fp16=True, applied=True, norm=1.5), step=0) == (1.5, False)
    assert _deepspeed_outcome(_FakeEngine(fp16=False, applied=True, norm=None), step=0) == (None, False)
    for engine in (_FakeEngine(fp16=False, applied=True, norm=inf),  # bf16 or fp32: nothing explains it
                   _FakeEngine(fp16=False, applied=False, norm=float("nan")),  # bf16 with check_grad_overflow
                   _FakeEngine(fp16=True, applied=True, norm=inf)):  # fp16, but the engine applied it
        with pytest.raises(TrainingStopped, match="non-finite gradient norm .* at step 1"):
            _deepspeed_outcome(engine, step=0)
    with pytest.raises(RuntimeError, match="DeepSpeed took 2 optimizer steps, the loop 1"):
        _deepspeed_outcome(_FakeEngine(fp16=True, applied=False, norm=inf, global_steps=2), step=0)
    # The run goes on through overflows until max_consecutive_overflows of them in a row.
    assert _overflow_streak(True, 0, 20, step=1) == 1
    assert _overflow_streak(False, 18, 20, step=20) == 0
    with pytest.raises(TrainingStopped, match="20 fp16 overflows in a row"):
        _overflow_streak(True, 19, 20, step=20)


def test_the_gradient_norm_on_a_cpu_is_exact_where_torchs_kernel_is_not(accelerator):
    """torch's CPU fp32 2-norm kernel sums a gradient's squares in one fp32 accumulator a lane: a skewed 4M-weight
    gradient's norm comes out 5e-4 low (docs/pitfalls.md#cpu-norm). The norm the loop logs and clips with is within
    1e-7 of float64's, and the clipping is torch's: max_norm / (norm + 1e-6)."""
    from toolkit.parallel.clipping import clip_grad_norm

    torch.manual_seed(0)
    n = 1 << 22
    big = torch.nn.Parameter(torch.zeros(n))
    small = torch.nn.Parameter(torch.zeros(3))
    big.grad = torch.randn(n) * torch.rand(n).pow(8) * 1e-3  # mostly tiny, as an embedding's gradient is
    big.grad[:10] = 1.0
    small.grad = torch.tensor([0.5, -0.25, 2.0])
    exact = math.sqrt(big.grad.double().pow(2).sum().item() + small.grad.double().pow(2).sum().item())
    upstream = torch.nn.utils.get_total_norm([big.grad, small.grad]).item()
    assert abs(upstream - exact) / exact > 1e-5, "torch's kernel is exact now: drop toolkit.parallel.clipping's CPU path"
    before = big.grad.clone()
    # a chunk at a time: no temporary as big as the gradient (16 MB here, 154 MB for GPT-2's embedding)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        norm = clip_grad_norm(accelerator, [big, small], float("inf"))
    assert max(e.cpu_memory_usage for e in prof.events()) <= big.grad.nbytes // 4
    assert abs(norm.item() - exact) / exact < 1e-7 and norm.dtype == torch.float32
    assert torch.equal(big.grad, before)  # max_norm inf: scaled by exactly 1
    norm = clip_grad_norm(accelerator, [big, small], exact / 2)
    scale = (exact / 2) / (norm.item() + 1e-6)
    assert torch.allclose(big.grad, before * scale, rtol=1e-6) and abs(norm.item() - exact) / exact < 1e-7

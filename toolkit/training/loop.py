"""The training loop, the same under DDP, DeepSpeed ZeRO-2/3 and FSDP: ``train_step`` and the outer ``train``.

One optimizer step (``train_step``), on each of the W data-parallel ranks:

    1. this rank's k micro-batches of the step (the rows come from ``toolkit.data.order``: independent of W and k);
    2. count target tokens locally, all-reduce: T = target tokens of the whole global batch (one tiny all-reduce);
    3. for each micro-step, inside ``accelerator.accumulate(model)`` (which applies ``no_sync`` on all but the last
       micro-step where the strategy allows it, and tells DeepSpeed where its boundary is):
           backward( sum of token CE * W * k / T )          (see ``toolkit.loss`` for why this is exact)
    4. on the last micro-step: clip the global grad norm, optimizer step, scheduler step, zero grads.

The outer loop (``train``) does, between steps, a flat sequence: fetch the step's micro-batches from the epoch's
order, ``train_step``, advance the position, log, evaluate, checkpoint; and stops after ``total_steps`` (or when a
stream runs out, or on SIGTERM, or when a step stops the run: however it ends, the summary says how,
docs/reliability.md#how-a-run-ends).

Everything needed to continue exactly lives in ``LoopState`` (``toolkit.training.state``; written as JSON into every
checkpoint, with what the sample order depends on) and the optimizer/scheduler/RNG states that ``save_state`` writes;
``toolkit.checkpointing.Checkpointer`` saves and loads them: the loop calls its ``load`` once and its ``save`` after
every step.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.data import DataLoader

from toolkit import layout
from toolkit.checkpointing import Checkpointer, ResumePlan, plan_resume
from toolkit.config import RunConfig, TrainingArguments, write_config
from toolkit.data.order import GlobalBatchSampler, require_one_global_batch
from toolkit.data.packing import SEQ_LENGTHS, check_packed_attention, packed_guard_row
from toolkit.data.stream import TrainStream, UnreadableLine, no_first_step
from toolkit.env import upstream
from toolkit.env.host_memory import keep_freed_memory, memory_kept, restore_freed_memory
from toolkit.errors import TrainingStopped
from toolkit.loss import micro_step_loss
from toolkit.models.loading import compiled_graphs
from toolkit.parallel import sequence as sequence_parallel
from toolkit.parallel.accelerator import (
    configure_deepspeed,
    data_parallel_size,
    gather_for_metrics,
    keep_embeddings_out_of_fsdp_units,
    keep_process_groups,
)
from toolkit.parallel.clipping import clip_grad_norm
from toolkit.parallel.pipeline import PipelineModel, check_task
from toolkit.parallel.pipeline import build as build_pipeline
from toolkit.reporting.accounting import count_parameters, flops_per_token, model_shape, peak_flops, weights_dtype
from toolkit.reporting.metrics import (
    ENDED_COMPLETED,
    ENDED_DATA_RAN_OUT,
    ENDED_PREEMPTED,
    ENDED_STOPPED,
    LogWindow,
    MetricsLogger,
    format_run_summary,
    parallel_degrees,
    run_summary,
    write_summary,
)
from toolkit.reporting.plots import plot_run
from toolkit.tasks.base import Task
from toolkit.tasks.lm import CausalLM
from toolkit.training.optimizers import MuonWithAdamW, build_muon
from toolkit.training.preemption import Preemption
from toolkit.training.state import LoopState, StepResult

# transformers' schedulers (imported where used) pull in its modeling code: it loads without scipy.optimize
upstream.import_transformers_losses()


def build_optimizer(model: torch.nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    if args.optim == "muon":  # its own split: Muon on the hidden matrices, AdamW on the rest
        return build_muon(model, args)
    # The usual split: no weight decay on biases and norm weights (the 1-D parameters). Under ZeRO-3, transformers
    # builds the model already partitioned (deepspeed.zero.Init: every parameter's data is an empty 1-D tensor), so
    # the real shape is ``ds_shape``; reading ``ndim`` would silently put every weight in the no-decay group.
    def ndim(p):
        return len(getattr(p, "ds_shape", p.shape))

    decay = [p for p in model.parameters() if p.requires_grad and ndim(p) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and ndim(p) < 2]
    # DeepSpeed drops empty groups from the optimizer, after the scheduler has counted them; never hand it one.
    groups = [
        g
        for g in ({"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate)
    if args.optim.endswith("_8bit"):
        from toolkit.models.quantization import eight_bit_adamw

        return eight_bit_adamw(groups, args, paged=args.optim.startswith("paged"))
    return torch.optim.AdamW(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=args.optim == "adamw_torch_fused" or None,
    )


@torch.no_grad()
def evaluate(accelerator, model, eval_dataloader, task=None, chunked: bool = False) -> dict:
    """The task's metrics over the whole validation set (mean token loss and perplexity for a language model).

    Per-row values go through ``gather_for_metrics`` over the data-parallel ranks (``distributed.gather_for_metrics``:
    not the replicas of a tensor-parallel group), which drops the rows accelerate repeats to give every rank an equal
    number of batches, so each validation row counts exactly once. ``chunked``: the model computes its loss in chunks
    (``loss_chunk_size``), in evaluation as in training.
    """
    task = task or CausalLM()
    if isinstance(model, PipelineModel):  # the pipeline's forward, each replica its share of the rows
        return task.eval_metrics(model.evaluate_rows(eval_dataloader, task))
    model.eval()
    rows = [gather_for_metrics(accelerator, task.eval_rows(model, batch, chunked)) for batch in eval_dataloader]
    model.train()
    return task.eval_metrics(rows)


# ------------------------------------------------------------------------------------------------ the step
def _is_deepspeed(accelerator) -> bool:
    return accelerator.distributed_type.value == "DEEPSPEED"


def _global_counts(accelerator, micro_batches: list[dict], task, data_parallel_size: int,
                   stop_flag: bool = False) -> torch.Tensor:
    """[target tokens, real (non-pad) tokens, positions computed, ranks asked to stop] of the whole global batch, on
    the device: the step's one all-reduce, of four integers. The local counts come from the collator (``num_targets``,
    ``num_tokens``, ``num_slots``: counted on the CPU where the batch is built), so no micro-step waits for the
    device; a collator without them is counted on the device. The stop flag rides along so that preemption costs no
    collective (and no host read) of its own."""
    def counts(b):
        slots = b.get("num_slots", b["input_ids"].numel())
        if "num_targets" in b:
            return b["num_targets"], b["num_tokens"], slots
        return task.count_targets(b), b["attention_mask"].sum(), slots

    local = [sum(c) for c in zip(*(counts(b) for b in micro_batches))] + [int(stop_flag)]
    local = torch.stack([torch.as_tensor(c, dtype=torch.long) for c in local]).to(accelerator.device, non_blocking=True)
    total = accelerator.reduce(local, reduction="sum")
    # The ranks of a tensor-parallel group hold the same rows: each row is counted once per replica.
    return torch.cat([total[:3] // _replicas(accelerator, data_parallel_size), total[3:]])


def _replicas(accelerator, data_parallel_size: int) -> int:
    """How many ranks take the same rows (the tensor-parallel degree; 1 without TP)."""
    return accelerator.num_processes // data_parallel_size


def _clip_and_norm(accelerator, model, max_grad_norm: float) -> torch.Tensor | None:
    """Clip to max_grad_norm (0 = off) and return the global pre-clip norm (a device tensor), or None."""
    if _is_deepspeed(accelerator):
        return None  # DeepSpeed clips inside engine.step() (gradient_clipping set from the recipe); norm read after
    # With clipping off, a max norm of inf still returns the norm and scales by exactly 1.0 (min(inf/n, 1) == 1).
    return clip_grad_norm(accelerator, model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))


def _to_host(norm, counts: torch.Tensor) -> tuple[float | None, int, int, int, int]:
    """The step's one host-device synchronisation: the grad norm (needed before the optimizer applies the step, to
    refuse a non-finite one) and the global counts, read together."""
    if norm is None:
        return (None, *counts.tolist())
    values = torch.cat([norm.detach().reshape(1).to(torch.float64), counts.to(torch.float64)]).tolist()
    return (values[0], *(int(v) for v in values[1:]))


def _nonfinite(norm: float | None, step: int) -> TrainingStopped | None:
    if norm is None or math.isfinite(norm):
        return None
    return TrainingStopped(f"non-finite gradient norm ({norm}) at step {step}; the weights are those of the last "
                           "good step (the latest checkpoint is kept). Lower the learning rate or check the data; "
                           "skip_nonfinite_steps: true skips such steps instead")


def _apply_step(accelerator, optimizer, scheduler, grad_norm: float | None, *, step: int,
                skip_nonfinite: bool) -> tuple[bool, bool]:
    """Optimizer and scheduler step at the accumulation boundary; returns (skipped, overflow). A non-finite norm is
    never applied. Under a GradScaler (fp16) it is an overflow, which dynamic loss scaling makes by design while it
    searches for its scale: ``optimizer.step()`` must still run, as the scaler turns it into a no-op and backs its scale
    off there and only there (docs/pitfalls.md#fp16-overflow-norm). Without a scaler nothing explains it: the step is
    skipped (``skip_nonfinite``) or the run stops. ``step``: this step's number, for the message."""
    stop = _nonfinite(grad_norm, step)
    scaler = getattr(accelerator, "scaler", None)
    if stop is not None and scaler is None:
        if not skip_nonfinite:
            raise stop
        skipped = True
    else:
        optimizer.step()  # DeepSpeed: a no-op, the engine stepped in backward(); its overflow shows as skipped
        skipped = accelerator.optimizer_step_was_skipped
        if not skipped:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped, skipped and scaler is not None


def _deepspeed_outcome(engine, step: int) -> tuple[float | None, bool]:
    """After the engine's step (taken inside the last backward): (global grad norm, skipped for an fp16 overflow).

    DeepSpeed's fp16 engine reports inf as the global norm of a step its loss scaler skipped (it backs the scale off,
    counts ``engine.skipped_steps`` and ``was_step_applied()`` is False: docs/pitfalls.md#deepspeed-fp16-overflow);
    such a step is an overflow, not a reason to stop. A non-finite norm anywhere else (bf16, fp32) stops the run:
    the engine has already applied it. ``step``: optimizer steps done before this one."""
    norm = engine.get_global_grad_norm()
    grad_norm = float(norm) if norm is not None else None
    overflow = bool(engine.fp16_enabled()) and not engine.was_step_applied()
    stop = None if overflow else _nonfinite(grad_norm, step + 1)
    if stop is not None:
        raise stop
    if engine.global_steps != step + 1:
        raise RuntimeError(f"DeepSpeed took {engine.global_steps} optimizer steps, the loop {step + 1}")
    return grad_norm, overflow


def _overflow_streak(overflow: bool, overflows: int, limit: int, step: int) -> int:
    """fp16 overflows in a row, this step included (0 after a step that was not one); stops the run at ``limit``.
    Each overflow halves the loss scale (GradScaler and DeepSpeed start at 2^16): after ~17 in a row the scale is
    below 1, so gradients that still overflow are not finite at any scale, and every further step would be skipped."""
    streak = overflows + 1 if overflow else 0
    if streak >= limit:
        raise TrainingStopped(
            f"{streak} fp16 overflows in a row at step {step} (max_consecutive_overflows: {limit}): the loss scaler "
            "skipped each of these steps and halved its scale every time, so the gradients are not finite at any "
            "scale; the weights are those of the last good step (the latest checkpoint is kept). Lower the learning "
            "rate, check the data, or train in bf16")
    return streak


def train_step(accelerator, model, optimizer, scheduler, micro_batches: list[dict], *, step: int,
               data_parallel_size: int, max_grad_norm: float, loss_normalization: str = "global_tokens",
               skip_nonfinite: bool = False, after_backward: Callable[[int], None] | None = None,
               chunked_loss: bool = False, task=None, stop_flag: bool = False, overflows: int = 0,
               max_consecutive_overflows: int = TrainingArguments.max_consecutive_overflows,
               sequence: sequence_parallel.SequenceGroup | None = None) -> StepResult:
    """One optimizer step over this rank's k = ``len(micro_batches)`` micro-batches (steps 2-4 of the module doc).

    ``step``: optimizer steps done before this one (for the checks' messages and DeepSpeed's step count).
    ``data_parallel_size``: ranks that each take a different shard of the global batch (the gradient average
    divides by it). ``after_backward(micro_step)``: called after each backward, inside the accumulation context.
    ``chunked_loss``: the model computes its loss in chunks (``toolkit.models.loading.enable_chunked_loss``).
    ``task``: the loss of a row (``toolkit.tasks.base``; a causal LM by default).
    ``stop_flag``: this rank was asked to stop; summed with the counts, returned as ``stop_requested`` on every rank.
    A non-finite gradient norm is never applied. Under fp16 loss scaling (a GradScaler, or DeepSpeed's fp16 engine)
    it is an overflow: the step is skipped the way the scaler skips it (``skipped``; ``overflows`` in the result),
    and the run stops only at ``max_consecutive_overflows`` in a row (``overflows``: those just before this step).
    Anywhere else the step is skipped (``skip_nonfinite``) or the run stops (under DeepSpeed, whose engine steps
    before the norm is known, after the step).
    ``sequence``: this rank's sequence-parallel group (``toolkit.parallel.sequence``): each micro-batch's rows are
    shared with it, each rank its part of every row.
    """
    task = task or CausalLM()
    accumulation = len(micro_batches)
    engine = model if _is_deepspeed(accelerator) else None
    counts = _global_counts(accelerator, micro_batches, task, data_parallel_size, stop_flag)
    if isinstance(model, PipelineModel):
        return _pipeline_step(accelerator, model, optimizer, scheduler, micro_batches, counts, step, max_grad_norm,
                              skip_nonfinite, overflows, max_consecutive_overflows)
    global_targets = counts[0]
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    grad_norm, skipped, overflow = None, False, False
    for index, batch in enumerate(micro_batches):
        boundary = index == accumulation - 1
        with accelerator.accumulate(model):
            if accelerator.sync_gradients != boundary:
                raise RuntimeError(
                    f"step {step}, micro-step {index}: accelerate's accumulation boundary "
                    f"(sync_gradients={accelerator.sync_gradients}) disagrees with ours (k={accumulation})"
                )
            micro_sum = (task.row_losses(model, batch, chunked_loss) if sequence is None
                         else sequence_parallel.row_losses(model, batch, sequence)).sum()
            local_targets = (torch.as_tensor(batch["num_targets"]) if "num_targets" in batch
                             else task.count_targets(batch))  # used by per_micro_batch only
            loss = micro_step_loss(micro_sum, local_targets, global_targets,
                                   data_parallel_size if sequence is None else sequence.scale(data_parallel_size),
                                   accumulation, loss_normalization)
            accelerator.backward(loss)
            if after_backward is not None:
                after_backward(index)
            loss_sum += micro_sum.detach().double()
            if engine is not None and engine.is_gradient_accumulation_boundary() != boundary:
                raise RuntimeError(f"step {step}: DeepSpeed's accumulation boundary drifted from ours")
            if boundary:
                grad_norm, targets, global_tokens, slots, stopping = _to_host(_clip_and_norm(accelerator, model, max_grad_norm),
                                                                       counts)
                # the norm is the same on every rank, and so is the decision
                skipped, overflow = _apply_step(accelerator, optimizer, scheduler, grad_norm, step=step + 1,
                                                skip_nonfinite=skip_nonfinite)
    if engine is not None:
        grad_norm, overflow = _deepspeed_outcome(engine, step)
        skipped = skipped or overflow
    streak = _overflow_streak(overflow, overflows, max_consecutive_overflows, step + 1)
    return StepResult(loss_sum=loss_sum, targets=targets, tokens=global_tokens, grad_norm=grad_norm, skipped=skipped,
                      overflows=streak, stop_requested=stopping > 0, slots=slots)


def _pipeline_step(accelerator, model: PipelineModel, optimizer, scheduler, micro_batches: list[dict],
                   counts: torch.Tensor, step: int, max_grad_norm: float, skip_nonfinite: bool, overflows: int,
                   max_consecutive_overflows: int) -> StepResult:
    """``train_step`` under pipeline parallelism: the schedule runs every micro-batch's forward and backward
    (``toolkit.parallel.pipeline``), then the same norm check and optimizer step as any other strategy."""
    with accelerator.autocast():  # mixed precision as accelerate's prepared model would run it
        loss_sum = model.forward_backward(micro_batches, counts[0])
    grad_norm, targets, tokens, slots, stopping = _to_host(model.reduce_and_clip(max_grad_norm), counts)
    skipped, overflow = _apply_step(accelerator, optimizer, scheduler, grad_norm, step=step + 1,
                                    skip_nonfinite=skip_nonfinite)
    streak = _overflow_streak(overflow, overflows, max_consecutive_overflows, step + 1)
    return StepResult(loss_sum=loss_sum, targets=targets, tokens=tokens, grad_norm=grad_norm, skipped=skipped,
                      overflows=streak, stop_requested=stopping > 0, slots=slots)


# ------------------------------------------------------------------------------------------- between steps
def epoch_batches(accelerator, train_dl, sampler: GlobalBatchSampler, state: LoopState, accumulation: int):
    """An iterator over this rank's micro-batches from the loop's position to the end of the current epoch; for a
    stream (``train_dl`` None), over its steps from the loop's position (lists of micro-batches)."""
    if train_dl is None:
        return sampler.steps(state.step, state.stream)
    sampler.use_epoch(state.epoch)
    # Mid-epoch resume: skip the micro-batches of the steps already done in this epoch (same order: same epoch).
    skip = state.step_in_epoch * accumulation
    return iter(accelerator.skip_first_batches(train_dl, skip) if skip else train_dl)


def next_micro_batches(batches, run, accelerator) -> list[dict] | None:
    """This rank's micro-batches of the next step; None when a stream has ended (a map-style epoch never runs out
    here: the loop starts the next one)."""
    if run.train_dl is not None:
        return [next(batches) for _ in range(run.sampler.gradient_accumulation_steps)]
    step = next(batches, None)
    if step is None:
        return None
    return [{k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in step]


def _data_ran_out(accelerator, run, state: LoopState) -> None:
    """The one line that says why the run ends before ``max_steps`` (also ``ended`` in summary.json)."""
    accelerator.print(f"the stream ended after step {state.step} of max_steps {run.total_steps} "
                      f"({state.samples_seen} rows trained on): the run ends here, with its final evaluation and "
                      "export", flush=True)


def _finish_step(state: LoopState, result: StepResult, run) -> bool:
    """Count the step into the position; True when a map-style epoch ended (a stream is one pass: instead, where a
    resume restarts it is recorded)."""
    ended = state.finish_step(result, run.steps_per_epoch)
    if run.train_dl is None:
        state.stream = run.sampler.position(state.step)
        return False
    return ended


def _call(callbacks, event: str, **kwargs) -> None:
    for cb in callbacks or ():
        fn = getattr(cb, event, None)
        if fn is not None:
            fn(**kwargs)


class Evaluation:
    """The task's evaluation between steps, and the best value of its metric so far (e.g. perplexity, lower)."""

    def __init__(self, accelerator, model, eval_dl, task, chunked: bool = False):
        self.accelerator, self.model, self.eval_dl, self.task = accelerator, model, eval_dl, task
        self.chunked = chunked  # loss_chunk_size: the evaluation loss in chunks too
        self.name, self.better = task.best_metric  # e.g. ("perplexity", min)
        self.best = None

    def due(self, args: TrainingArguments, step: int, last: bool) -> bool:
        return self.eval_dl is not None and ((args.eval_steps and step % args.eval_steps == 0) or last)

    def into(self, row: dict) -> dict:
        """Collective: evaluate, add the metrics to ``row`` and return it."""
        result = evaluate(self.accelerator, self.model, self.eval_dl, self.task, self.chunked)
        row.update(result)
        value = result[self.name]
        self.best = value if self.best is None else self.better(self.best, value)
        return row


@dataclass
class Run:
    """What the outer loop works with: the strategy's prepared objects, the sample order and the run's length."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_dl: DataLoader
    eval_dl: DataLoader | None
    sampler: GlobalBatchSampler
    total_steps: int
    data_parallel_size: int  # ranks that take different rows (under tensor parallelism: fewer than the world)
    checkpointer: Checkpointer
    flops_per_token: float  # model FLOPs per trained token (toolkit.reporting.accounting)
    peak_flops: float | None
    sequence: sequence_parallel.SequenceGroup | None = None  # this rank's sequence-parallel group

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch


def _reuse_cpu_memory(args: TrainingArguments, model, device: torch.device) -> bool:
    """Whether to keep freed host memory for reuse: on a CPU device only (a GPU rank's large tensors live in torch's
    caching allocator on the device); there ``cpu_memory_reuse``, unset: on, unless the run asked for less memory.
    The kept heap fragments (torch asks glibc for 64-byte aligned blocks, which a freed block of the same size cannot
    serve), and eats what the memory switches save (docs/performance.md#where-a-cpu-step-spends-its-time). The
    model's flag is also set when FSDP's launch-config checkpointing was handed over to transformers."""
    if device.type != "cpu":
        return False
    if args.cpu_memory_reuse is not None:
        return args.cpu_memory_reuse
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers 5's name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return not (args.loss_chunk_size or checkpointing)


def _head(train_dataset, n: int) -> dict:
    """The first ``n`` training rows as columns (a stream's first rows of its global order)."""
    if isinstance(train_dataset, TrainStream):
        rows = train_dataset.head(n)
        return {key: [r[key] for r in rows] for key in rows[0]}
    return train_dataset[: min(len(train_dataset), n)]


def _model_flops_per_token(model, train_dataset, packing: bool) -> float:
    """Before ``prepare`` (ZeRO-3 and FSDP shard the parameters): 6N + 12 L d T at the run's mean attention span (a
    row; a document of a bfd-packed row, which attends to itself only)."""
    layers, width = model_shape(model.config)
    head = _head(train_dataset, 256)
    spans = ([n for row in head[SEQ_LENGTHS] for n in row] if SEQ_LENGTHS in head
             else [len(head["input_ids"][0])] if packing else [len(r) for r in head["input_ids"]])
    return flops_per_token(count_parameters(model), layers, width, sum(spans) / len(spans))


def prepare_run(cfg: RunConfig, accelerator, model, tokenizer, train_dataset, eval_dataset=None, collator=None,
                resume: ResumePlan | None = None, repeats: int = 1) -> Run:
    """The order, the loaders, the optimizer and the scheduler, prepared for the strategy; the resume plan (planned
    here when ``build`` did not plan it) and the ``Checkpointer`` that carries it. ``repeats``: each row listed this
    many times in a row in the order (``Task.sample_repeats``)."""
    args = cfg.train
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    dp = data_parallel_size(accelerator)
    if isinstance(train_dataset, TrainStream):  # its own order (toolkit.data.stream), read in this process: no loader
        sampler, loaders = train_dataset, [None]
    else:
        require_one_global_batch(len(train_dataset) * repeats, micro, dp, accumulation)
        sampler = GlobalBatchSampler(len(train_dataset), micro, dp, accumulation, seed=args.seed, shuffle=args.shuffle,
                                     repeats=repeats, copies=args.split_size)
        loaders = [DataLoader(train_dataset, batch_sampler=sampler, collate_fn=collator,
                              num_workers=args.dataloader_num_workers)]
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * sampler.steps_per_epoch)
    if eval_dataset is not None and len(eval_dataset) > 0:
        loaders.append(DataLoader(eval_dataset, batch_size=args.per_device_eval_batch_size, shuffle=False,
                                  collate_fn=collator, num_workers=args.dataloader_num_workers))
    per_token = _model_flops_per_token(model, train_dataset, cfg.data.packing)
    pipelined = args.pipeline_parallel_size > 1
    if pipelined:  # this rank's stages and its replica's rows (toolkit.parallel.pipeline), not wrapped by accelerate
        model, *loaders = build_pipeline(accelerator, args, model, train_dataset, eval_dataset, sampler, collator)
    optimizer = build_optimizer(model, args)
    if isinstance(optimizer, MuonWithAdamW):
        accelerator.print(optimizer.split)
    upstream.import_peft()  # before the scheduler's import imports peft, and peft bitsandbytes
    from transformers import get_scheduler

    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=total_steps)
    resume = resume or plan_resume(cfg, accelerator, train_dataset, repeats)
    configure_deepspeed(accelerator, args, load_universal=resume.loads_universal)
    group = sequence_parallel.setup(accelerator, args, model)  # collective: before the model is wrapped
    if not pipelined:  # a pipeline's stages are sharded (FSDP2) or replicated by toolkit.parallel.pipeline itself
        keep_embeddings_out_of_fsdp_units(accelerator, model)
        model, optimizer, *prepared, scheduler = accelerator.prepare(model, optimizer, *filter(None, loaders),
                                                                     scheduler)
        loaders = prepared if loaders[0] is not None else [None, *prepared]
    return Run(model=model, optimizer=optimizer, scheduler=scheduler, train_dl=loaders[0],
               eval_dl=loaders[1] if len(loaders) > 1 else None, sampler=sampler, total_steps=total_steps,
               data_parallel_size=dp,
               checkpointer=Checkpointer(accelerator, cfg, resume, model, optimizer, scheduler, tokenizer),
               flops_per_token=per_token, peak_flops=peak_flops(accelerator.device, accelerator.mixed_precision,
                                                                args.peak_flops, weights_dtype(model)),
               sequence=group)


def _open_run_files(cfg: RunConfig, accelerator, run: Run, state: LoopState, resumed_from: str | None,
                    train_dataset, task: Task) -> MetricsLogger:
    """The resolved config, the trackers and metrics.jsonl (a resumed run keeps the rows up to its checkpoint; its
    loss rows name the task's ``loss_unit``); the run's shape printed once, in the task's ``row_unit``."""
    args = cfg.train
    if accelerator.is_main_process:
        write_config(cfg, layout.path(args.output_dir, layout.CONFIG))
    accelerator.init_trackers("toolkit", config={key: value for key, value in cfg.as_dict().items()
                                                 if isinstance(value, (int, float, str, bool))})
    global_batch, per_epoch = run.sampler.global_batch_size, run.steps_per_epoch
    tokens_per_row = len(train_dataset[0]["input_ids"]) if cfg.data.packing and not cfg.data.padding_free else None
    streaming = isinstance(train_dataset, TrainStream)
    rows = None if streaming else len(train_dataset) * run.sampler.repeats  # GRPO: each prompt num_generations times
    degrees = parallel_degrees(accelerator)  # e.g. "pp 2 x dp 2", "tp 2"
    length = ("a stream, one pass" if streaming else
              f"{per_epoch} steps/epoch ({rows - per_epoch * global_batch} rows left out per epoch)")
    accelerator.print(
        f"world size {accelerator.num_processes} ({accelerator.distributed_type.value}"
        f"{'; ' + degrees if degrees else ''}) | micro batch {args.per_device_train_batch_size} | accumulation "
        f"{args.gradient_accumulation_steps} | global batch {global_batch} {task.row_unit}"
        + (f" = {global_batch * tokens_per_row} tokens" if tokens_per_row else
           " (whole documents packed per row, padding-free)" if cfg.data.padding_free else " (padded, variable length)")
        + f" | {length} | {run.total_steps} optimizer steps from step {state.step}"
    )
    return MetricsLogger(accelerator, args.output_dir, run.total_steps, start_step=state.step,
                         resume=resumed_from is not None, loss_unit=task.loss_unit)


def _epochs(run: Run, state: LoopState, stream_ended: bool = False) -> float | None:
    """Passes over the training data so far (metrics.jsonl's ``epoch``, summary.json's ``epochs``). Map-style data:
    steps / steps an epoch. A stream has no length: 1.0 once read to its end (``stream_ended``: every row it holds
    was read, each trained on once, but the tail short of a global batch), None (unknown) before; it was steps /
    max_steps, 0.16 for a stream that ran out after 8 of 50 steps."""
    if run.train_dl is not None:
        return state.epochs_done(run.steps_per_epoch)
    return 1.0 if stream_ended else None


def _log_step(args: TrainingArguments, state: LoopState, result: StepResult, last: bool, run: Run, window: LogWindow,
              evaluation: Evaluation, logger: MetricsLogger, stopping: bool = False,
              ran_out: bool = False) -> dict | None:
    """Collective when it logs or evaluates (every rank decides alike): the step's metrics row, or None.
    ``stopping``: the run stops after this step (preempted): the row is written whatever logging_steps says, or the
    steps since the last row would never be logged (a resume starts after them). ``ran_out``: the stream ended."""
    row = {"step": state.step, "epoch": _epochs(run, state, ran_out), "tokens_seen": state.tokens_seen}
    logged = state.step % args.logging_steps == 0 or last or stopping
    if logged:
        _training_metrics(row, state, result, run, window, evaluation)
    evaluated = evaluation.due(args, state.step, last)
    if evaluated:
        started = time.perf_counter()
        evaluation.into(row)
        window.exclude(time.perf_counter() - started)  # tokens/s counts training time only
    if not (logged or evaluated):
        return None
    logger.log(row)
    return row


def _training_metrics(row: dict, state: LoopState, result: StepResult, run: Run, window: LogWindow,
                      evaluation: Evaluation) -> dict:
    """Collective: the training metrics of the steps since the last row (the window's), added to ``row``."""
    row.update(lr=run.scheduler.get_last_lr()[0], grad_norm=result.grad_norm, **window.flush(),
               **evaluation.task.log_metrics())
    if state.skipped_steps:
        row["skipped_steps"] = state.skipped_steps
    return row


def _log_last_good_step(state: LoopState, unlogged: StepResult | None, run: Run, window: LogWindow,
                        evaluation: Evaluation, logger: MetricsLogger) -> None:
    """Collective, when a step stops the run (TrainingStopped: on every rank at the same step): the step before it,
    the run's last good one, is logged whatever logging_steps says, as a preempted run's last step is (else the steps
    since the last row would never be logged). ``unlogged``: that step's result, None if its row was written."""
    if unlogged is not None:
        row = {"step": state.step, "epoch": _epochs(run, state), "tokens_seen": state.tokens_seen}
        logger.log(_training_metrics(row, state, unlogged, run, window, evaluation))


# ---------------------------------------------------------------------------------------------- the loop
def train(cfg: RunConfig, accelerator, model, tokenizer, train_dataset, eval_dataset=None, collator=None,
          callbacks=None, task=None, resume: ResumePlan | None = None) -> dict:
    """Train, evaluate, checkpoint and export. Returns a summary dict (also printed on the main process).

    ``callbacks``: objects with any of ``on_prepared(accelerator, model, optimizer)``,
    ``on_micro_step(accelerator, state, micro_step)``, ``on_step_end(accelerator, state, row)``,
    ``on_save(accelerator, state, checkpoint)`` (a checkpoint folder written) and
    ``on_end(accelerator, model, summary)``, all called on every rank (tests use them to count all-reduces
    and to probe the trained model). ``task``: what a row's loss and the evaluation are (``toolkit.tasks.base``; a causal
    LM by default). ``resume``: the plan ``toolkit.training.build`` made before the weights loaded (planned here if None).

    On a CPU, freed host memory is kept for reuse while it trains (``cpu_memory_reuse``, ``toolkit.env.host_memory``) and
    glibc's settings come back when it returns or raises, if this call made them: the process (a notebook kernel,
    what it forks next) goes on as it came in. Settings a caller made before the call stay.
    """
    kept_here = not memory_kept() and _reuse_cpu_memory(cfg.train, model, accelerator.device) and keep_freed_memory()
    if memory_kept():
        accelerator.print("host memory: freed blocks are kept for reuse (cpu_memory_reuse; toolkit/env/host_memory.py)")
    try:
        return _train(cfg, accelerator, model, tokenizer, train_dataset, eval_dataset, collator, callbacks, task,
                      resume)
    finally:
        if kept_here:
            restore_freed_memory()


def _check_packing(accelerator, model, strategy: str, train_dataset) -> None:
    """The padding-free guard (toolkit.data.packing.check_packed_attention) on the prepared model: every rank, the same row
    (a sharded model may need collectives for a forward)."""
    rows = train_dataset.head(64) if isinstance(train_dataset, TrainStream) else train_dataset
    check_packed_attention(model, packed_guard_row(rows), accelerator.device)
    accelerator.print(f"packing_strategy {strategy}: checked that a packed document's logits do not "
                      "depend on the documents before it in its flattened micro-batch")


def _train(cfg: RunConfig, accelerator, model, tokenizer, train_dataset, eval_dataset, collator, callbacks, task,
           resume: ResumePlan | None) -> dict:
    task, args, started = task or CausalLM(), cfg.train, time.time()
    if args.pipeline_parallel_size > 1:
        check_task(task, model)
    run = prepare_run(cfg, accelerator, model, tokenizer, train_dataset, eval_dataset, collator, resume,
                      repeats=task.sample_repeats(cfg))
    model = run.model
    run.checkpointer.task = task  # its state (GRPO: a batch the next steps reuse) goes into each checkpoint
    task.total_steps, task.steps_per_epoch = run.total_steps, run.steps_per_epoch  # GRPO's reward functions read them
    task.prepared(accelerator, model)  # e.g. DPO's live reference, prepared as the model was
    if cfg.data.padding_free:
        _check_packing(accelerator, model, cfg.data.packing_strategy, train_dataset)
    _call(callbacks, "on_prepared", accelerator=accelerator, model=model, optimizer=run.optimizer)
    state = LoopState(world_size=accelerator.num_processes, global_batch_size=run.sampler.global_batch_size)
    resumed_from = run.checkpointer.load(state)  # the checkpoint's weights, optimizer, position; or a fresh start
    first = _first_stream_step(accelerator, run, state)
    logger = _open_run_files(cfg, accelerator, run, state, resumed_from, train_dataset, task)
    start_step, start_tokens = state.step, state.tokens_seen  # a resumed run's rates count this attempt only
    evaluation = Evaluation(accelerator, model, run.eval_dl, task, chunked=args.loss_chunk_size > 0)
    if run.eval_dl is not None and args.eval_on_start and state.step == 0:
        logger.log(evaluation.into({"step": 0, "epoch": 0.0, "tokens_seen": 0}))
    # ranks whose loss sums are of the same rows (a sequence-parallel group's sum up to their rows': not replicas)
    window = LogWindow(accelerator, run.flops_per_token, run.peak_flops,
                       replicas=accelerator.num_processes // run.data_parallel_size // args.split_size)
    preemption, stop = Preemption(), None
    model.train()
    try:  # the previous SIGTERM handler comes back even when a step raises (a notebook kernel lives on)
        ended = _run_steps(cfg, accelerator, run, state, task, logger, evaluation, window, preemption, callbacks,
                           first)
    except (TrainingStopped, UnreadableLine) as e:  # on every rank at the same step (the norm and the overflow
        # streak are global; every rank reads every row of a stream, so meets a line it cannot read at the same row)
        ended, stop = ENDED_STOPPED, e
    finally:
        preemption.restore()
        run.checkpointer.finish()  # async_save: the write under way completes before the run goes on or exits
        for saved_state, saved in run.checkpointer.completed():  # async_save: a write completed last of all
            _call(callbacks, "on_save", accelerator=accelerator, state=saved_state, checkpoint=saved)
        # a stream's steps (and any read-ahead of them) end with the run, however it ends
        if hasattr(first[0], "close"):
            first[0].close()
        logger.close()  # also when a step raises: the bar ends its line before the error message is printed
    if args.torch_compile:  # bounded: shapes dynamic from the first call (toolkit.models.loading.compile_blocks)
        accelerator.print(f"torch_compile: {compiled_graphs()}", flush=True)
    if ended in (ENDED_COMPLETED, ENDED_DATA_RAN_OUT):
        _export_if_not_yet(accelerator, run, state, start_step, ended)
    if args.plot and accelerator.is_main_process:
        plot_run(args.output_dir)
    exported = run.checkpointer.exported
    summary = run_summary(
        accelerator, state, epochs=_epochs(run, state, ended == ENDED_DATA_RAN_OUT), seconds=time.time() - started,
        tokens=state.tokens_seen - start_tokens, steps=state.step - start_step, flops_per_token=run.flops_per_token,
        peak_flops=run.peak_flops, best=(evaluation.name, evaluation.best), ended=ended, total_steps=run.total_steps,
        stop_reason=str(stop) if stop else None, final_model=os.path.abspath(exported) if exported else None,
        data_parallel_size=run.data_parallel_size, fill_rate=window.run_fill_rate(),
        # an epoch's rows of the sample order, in the task's row_unit (GRPO: each prompt num_generations times)
        train_rows=state.samples_seen if isinstance(train_dataset, TrainStream)
        else len(train_dataset) * run.sampler.repeats)
    summary.update(row_unit=task.row_unit, **task.summary(accelerator, model))  # row_unit: what a global batch counts
    latest = layout.latest_checkpoint(args.output_dir)  # what a relaunch continues from (none: it starts over)
    summary["latest_checkpoint"] = os.path.abspath(latest) if latest else None
    # Before end_training, which destroys the process group: a sharded model (ZeRO-3, FSDP) needs collectives even
    # for a forward pass. A stopped run's model is not the run's result: no on_end.
    if stop is None:
        _call(callbacks, "on_end", accelerator=accelerator, model=model, summary=summary)
    if accelerator.is_main_process:
        write_summary(args.output_dir, summary)
        print(format_run_summary(summary), flush=True)
    if stop is not None:
        # Every rank exits non-zero next; the launcher then SIGTERMs the ranks still running. Without this barrier
        # the first rank could be killed while it writes summary.json (another rank's exit came first).
        accelerator.wait_for_everyone()
    keep_process_groups()  # freed with the model on return, a group could deadlock in its destructor
    accelerator.end_training()
    if stop is not None:
        raise stop  # after the summary and the plot: the recipe's process still exits 1 with the reason
    return summary


def _run_steps(cfg: RunConfig, accelerator, run: Run, state: LoopState, task, logger: MetricsLogger,
               evaluation: Evaluation, window: LogWindow, preemption: Preemption, callbacks,
               first: tuple = (None, None)) -> str:
    """The optimizer steps from the loop's position to the end of the run; returns how they ended (summary.json's
    ``ended``: ENDED_COMPLETED, ENDED_DATA_RAN_OUT or ENDED_PREEMPTED; a stopped run raises TrainingStopped, after
    logging its last good step; a stream with a line it cannot read raises that ConfigError, after logging and
    saving the step before it).

    Whatever ends the run, its last step is the last step of a run: logged, evaluated, the bar closed, then saved
    and exported. A stream's next step is read before this step is logged, so that a stream that ends makes this
    step the last one (not a break before a step that never comes). ``first``: a stream's steps and its first
    step, already read (``_first_stream_step``)."""
    args, model = cfg.train, run.model

    def after_backward(micro_step: int) -> None:
        _call(callbacks, "on_micro_step", accelerator=accelerator, state=state, micro_step=micro_step)

    (batches, ahead), overflows, streaming, unlogged = first, 0, run.train_dl is None, None
    while state.step < run.total_steps:
        if batches is None:  # an epoch starts, or resumes part-way
            batches = epoch_batches(accelerator, run.train_dl, run.sampler, state, args.gradient_accumulation_steps)
        micro_batches, ahead = ahead or next_micro_batches(batches, run, accelerator), None
        if micro_batches is None:  # a resume at the stream's end (every rank reads it: all see its end here)
            return _resumed_at_the_end(accelerator, run, state, logger, evaluation)
        micro_batches = task.step_batches(accelerator, model, micro_batches, state.step)  # GRPO: its completions
        try:
            result = train_step(accelerator, model, run.optimizer, run.scheduler, micro_batches, step=state.step,
                                data_parallel_size=run.data_parallel_size, max_grad_norm=args.max_grad_norm,
                                loss_normalization=args.loss_normalization, skip_nonfinite=args.skip_nonfinite_steps,
                                after_backward=after_backward, chunked_loss=args.loss_chunk_size > 0, task=task,
                                stop_flag=preemption.requested(), overflows=overflows,
                                max_consecutive_overflows=args.max_consecutive_overflows, sequence=run.sequence)
        except TrainingStopped:
            _log_last_good_step(state, unlogged, run, window, evaluation, logger)
            raise
        overflows = result.overflows
        if _finish_step(state, result, run):  # (a stream's resume position is recorded here, before reading ahead)
            batches = None  # the epoch's last step: the next one starts the next epoch
        ahead, unreadable = _read_ahead(batches, run, accelerator, state)
        ran_out = streaming and state.step < run.total_steps and ahead is None and unreadable is None
        window.add(result)
        logger.advance()
        last = state.step == run.total_steps or ran_out
        # Agreed on by every rank through the step's counts: a signal that arrives during a step stops the run
        # after the next one (the flag is sent with the counts, before the step's first backward).
        preempted = not last and result.stop_requested
        stopping = preempted or unreadable is not None  # logged and saved whatever logging_steps and save_steps say
        row = _log_step(args, state, result, last, run, window, evaluation, logger, stopping=stopping, ran_out=ran_out)
        unlogged = None if row is not None and "loss" in row else result
        _call(callbacks, "on_step_end", accelerator=accelerator, state=state, row=row)
        if last or stopping:  # the bar ends with training: the lines and the export's own bars below it
            logger.close()
        if ran_out:
            _data_ran_out(accelerator, run, state)
        saved = run.checkpointer.save(state, last_step=last, preempted=stopping)  # every save_steps; final/ last
        # complete and named by latest (a launcher records it: scripts/ray_train.py); async_save's writes once they
        # completed, with the state they hold
        for saved_state, folder in run.checkpointer.completed() + ([(state, saved)] if saved is not None else []):
            _call(callbacks, "on_save", accelerator=accelerator, state=saved_state, checkpoint=folder)
        if unreadable is not None:
            accelerator.print(f"the stream cannot be read after step {state.step}: "
                              + (f"saved checkpoint step-{state.step}" if saved else "no checkpoint written"),
                              flush=True)
            raise unreadable
        if preempted:
            accelerator.print(f"{preemption.reason()}: saved checkpoint step-{state.step}; relaunch with "
                              "resume_from_checkpoint: latest to continue", flush=True)
            return ENDED_PREEMPTED
        if ran_out:
            return ENDED_DATA_RAN_OUT
    return ENDED_COMPLETED


def _read_ahead(batches, run: Run, accelerator, state: LoopState) -> tuple[list | None, UnreadableLine | None]:
    """A stream's next step, read before this step is logged (None at its end or for map-style data), or the error
    of a line the stream cannot read (every rank reads every row: all meet it at the same step; an error only some
    ranks raise, e.g. in tokenizing their own rows, is raised: the others cannot follow it)."""
    if run.train_dl is not None or state.step >= run.total_steps:
        return None, None
    try:
        return next_micro_batches(batches, run, accelerator), None
    except UnreadableLine as e:
        return None, e


def _resumed_at_the_end(accelerator, run: Run, state: LoopState, logger: MetricsLogger,
                        evaluation: Evaluation) -> str:
    """A resume whose stream has no step left (the run had trained to the stream's end, then was stopped or killed
    before it finished): it ends as a run whose data ran out does, with its final evaluation (with a validation set)
    and the line saying so; the export follows (``_export_if_not_yet``)."""
    if run.eval_dl is not None:
        logger.log(evaluation.into({"step": state.step, "epoch": _epochs(run, state, stream_ended=True),
                                    "tokens_seen": state.tokens_seen}))
    logger.close()
    _data_ran_out(accelerator, run, state)
    return ENDED_DATA_RAN_OUT


def _first_stream_step(accelerator, run: Run, state: LoopState) -> tuple:
    """A stream's steps from the loop's position and the first of them, read before the run writes a file: a fresh
    run whose stream ends before its first global batch is refused there (rather than exporting the model as loaded
    and calling it trained), and a relaunch into the same output_dir starts clean. (None, None) for map-style data."""
    if run.train_dl is not None:
        return None, None
    batches = epoch_batches(accelerator, None, run.sampler, state, run.sampler.accumulation)
    micro_batches = next_micro_batches(batches, run, accelerator)
    if micro_batches is None and state.step == 0:
        raise no_first_step(run.sampler.global_batch_size)
    return batches, micro_batches


def _export_if_not_yet(accelerator, run: Run, state: LoopState, start_step: int, ended: str) -> None:
    """A finished run whose last step was not trained in this attempt (a resume of a run that had finished, e.g.
    killed during its export): the weights loaded are the run's result; final/ is written from them. (A stream
    resumed at its end has said so: ``_resumed_at_the_end``.)"""
    if (state.step == start_step and run.checkpointer.exported is None and run.checkpointer.args.save_final_model
            and ended == ENDED_COMPLETED):
        accelerator.print(f"the checkpoint is at step {state.step} of {run.total_steps}: nothing left to train; "
                          "exporting its weights to final/", flush=True)
    run.checkpointer.export()  # collective; once per run: a no-op after the last step's export

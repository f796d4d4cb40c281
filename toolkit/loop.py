"""The training loop, the same under DDP, DeepSpeed ZeRO-2/3 and FSDP: ``train_step`` and the outer ``train``.

One optimizer step (``train_step``), on each of the W data-parallel ranks:

    1. this rank's k micro-batches of the step (the rows come from ``toolkit.order``: independent of W and k);
    2. count target tokens locally, all-reduce: T = target tokens of the whole global batch (one tiny all-reduce);
    3. for each micro-step, inside ``accelerator.accumulate(model)`` (which applies ``no_sync`` on all but the last
       micro-step where the strategy allows it, and tells DeepSpeed where its boundary is):
           backward( sum of token CE * W * k / T )          (see ``toolkit.loss`` for why this is exact)
    4. on the last micro-step: clip the global grad norm, optimizer step, scheduler step, zero grads.

The outer loop (``train``) does, between steps, a flat sequence: fetch the step's micro-batches from the epoch's
order, ``train_step``, advance the position, log, evaluate, checkpoint; and stops after ``total_steps``.

Everything needed to continue exactly lives in ``LoopState`` (written as JSON into every checkpoint, with what the
sample order depends on; ``toolkit.resume``) and the optimizer/scheduler/RNG states that ``save_state`` writes.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from toolkit import checkpoint as ckpt
from toolkit import layout
from toolkit.accounting import count_parameters, flops_per_token, model_shape, peak_flops, peak_memory_gb
from toolkit.config import RunConfig, TrainArgs, write_config
from toolkit.convert import UNIVERSAL, convert
from toolkit.distributed import (
    configure_deepspeed,
    data_parallel_size,
    keep_embeddings_out_of_fsdp_units,
    strategy_name,
)
from toolkit.errors import TrainingStopped
from toolkit.host_memory import keep_freed_memory
from toolkit.loss import micro_step_loss
from toolkit.metrics import MetricsLogger, Throughput, format_run_summary, write_summary
from toolkit.order import GlobalBatchSampler, require_one_global_batch
from toolkit.plots import plot_run
from toolkit.preemption import Preemption
from toolkit.resume import check_resume, order_record
from toolkit.tasks import CausalLM


@dataclass
class LoopState:
    """The loop's position. Saved in every checkpoint's ``toolkit_state.json``."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # current epoch
    step_in_epoch: int = 0  # optimizer steps completed within the current epoch
    tokens_seen: int = 0  # non-pad input tokens, all ranks
    targets_seen: int = 0  # next-token targets, all ranks
    samples_seen: int = 0  # rows, all ranks
    skipped_steps: int = 0  # steps whose gradient norm was not finite (skip_nonfinite_steps)
    world_size: int = 1  # the world of this run (in a checkpoint: the world that wrote it)
    global_batch_size: int = 0  # rows per optimizer step: the step -> rows mapping of toolkit.order depends on it

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def finish_step(self, result: StepResult, steps_per_epoch: int) -> bool:
        """Count a finished optimizer step; True when it was the epoch's last (the position moves to the next epoch,
        so a checkpoint taken now resumes at the start of the next epoch)."""
        self.step += 1
        self.step_in_epoch += 1
        self.tokens_seen += result.tokens
        self.targets_seen += result.targets
        self.samples_seen += self.global_batch_size
        self.skipped_steps += result.skipped
        if self.step_in_epoch < steps_per_epoch:
            return False
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return True

    def epochs_done(self, steps_per_epoch: int) -> float:
        return self.epoch + self.step_in_epoch / steps_per_epoch


@dataclass
class StepResult:
    """What one optimizer step did. ``loss_sum`` is this rank's share (reduced only when logged, to save a
    collective per step); ``targets`` and ``tokens`` are global."""

    loss_sum: torch.Tensor  # summed token cross-entropy of this rank's micro-batches, fp64, on the device
    targets: int  # next-token targets of the whole global batch
    tokens: int  # non-pad input tokens of the whole global batch
    grad_norm: float | None  # global pre-clip gradient norm
    skipped: bool = False  # the norm was not finite and the optimizer step was not applied
    stop_requested: bool = False  # some rank was asked to stop (SIGTERM) before this step began


def build_optimizer(model: torch.nn.Module, args: TrainArgs) -> torch.optim.Optimizer:
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
    return torch.optim.AdamW(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=args.optim == "adamw_torch_fused" or None,
    )


@torch.no_grad()
def evaluate(accelerator, model, eval_dataloader, task=None) -> dict:
    """The task's metrics over the whole validation set (mean token loss and perplexity for a language model).

    Per-row values go through ``gather_for_metrics``, which drops the rows accelerate repeats to give every rank an
    equal number of batches, so each validation row counts exactly once.
    """
    task = task or CausalLM()
    model.eval()
    rows = [accelerator.gather_for_metrics(task.eval_rows(model, batch)) for batch in eval_dataloader]
    model.train()
    return task.eval_metrics(rows)


# ------------------------------------------------------------------------------------------------ the step
def _is_deepspeed(accelerator) -> bool:
    return accelerator.distributed_type.value == "DEEPSPEED"


def _global_counts(accelerator, micro_batches: list[dict], task, data_parallel_size: int,
                   stop_flag: bool = False) -> torch.Tensor:
    """[target tokens, non-pad tokens, ranks asked to stop] of the whole global batch, on the device: the step's one
    all-reduce, of three integers. The local counts come from the collator (``num_targets``, ``num_tokens``: counted
    on the CPU where the batch is built), so no micro-step waits for the device; a collator without them is counted
    on the device. The stop flag rides along so that preemption costs no collective (and no host read) of its own."""
    def counts(b):
        if "num_targets" in b:
            return b["num_targets"], b["num_tokens"]
        return task.count_targets(b), b["attention_mask"].sum()

    local = [sum(c) for c in zip(*(counts(b) for b in micro_batches))] + [int(stop_flag)]
    local = torch.stack([torch.as_tensor(c, dtype=torch.long) for c in local]).to(accelerator.device, non_blocking=True)
    total = accelerator.reduce(local, reduction="sum")
    # The ranks of a tensor-parallel group hold the same rows: each row is counted once per replica.
    return torch.cat([total[:2] // _replicas(accelerator, data_parallel_size), total[2:]])


def _replicas(accelerator, data_parallel_size: int) -> int:
    """How many ranks take the same rows (the tensor-parallel degree; 1 without TP)."""
    return accelerator.num_processes // data_parallel_size


def _clip_and_norm(accelerator, model, max_grad_norm: float) -> torch.Tensor | None:
    """Clip to max_grad_norm (0 = off) and return the global pre-clip norm (a device tensor), or None."""
    if _is_deepspeed(accelerator):
        return None  # DeepSpeed clips inside engine.step() (gradient_clipping set from the recipe); norm read after
    # With clipping off, a max norm of inf still returns the norm and scales by exactly 1.0 (min(inf/n, 1) == 1).
    return accelerator.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))


def _to_host(norm, counts: torch.Tensor) -> tuple[float | None, int, int, int]:
    """The step's one host-device synchronisation: the grad norm (needed before the optimizer applies the step, to
    refuse a non-finite one) and the global counts, read together."""
    if norm is None:
        return (None, *counts.tolist())
    values = torch.cat([norm.detach().reshape(1).to(torch.float64), counts.to(torch.float64)]).tolist()
    return values[0], int(values[1]), int(values[2]), int(values[3])


def _nonfinite(norm: float | None, step: int) -> TrainingStopped | None:
    if norm is None or math.isfinite(norm):
        return None
    return TrainingStopped(f"non-finite gradient norm ({norm}) at step {step}; the weights are those of the last "
                           "good step (the latest checkpoint is kept). Lower the learning rate or check the data; "
                           "skip_nonfinite_steps: true skips such steps instead")


def train_step(accelerator, model, optimizer, scheduler, micro_batches: list[dict], *, step: int,
               data_parallel_size: int, max_grad_norm: float, loss_normalization: str = "global_tokens",
               skip_nonfinite: bool = False, after_backward: Callable[[int], None] | None = None,
               chunked_loss: bool = False, task=None, stop_flag: bool = False) -> StepResult:
    """One optimizer step over this rank's k = ``len(micro_batches)`` micro-batches (steps 2-4 of the module doc).

    ``step``: optimizer steps done before this one (for the checks' messages and DeepSpeed's step count).
    ``data_parallel_size``: ranks that each take a different shard of the global batch (the gradient average
    divides by it). ``after_backward(micro_step)``: called after each backward, inside the accumulation context.
    ``chunked_loss``: the model computes its loss in chunks (``toolkit.model.enable_chunked_loss``).
    ``task``: the loss of a row (``toolkit.tasks``; a causal LM by default).
    ``stop_flag``: this rank was asked to stop; summed with the counts, returned as ``stop_requested`` on every rank.
    A non-finite gradient norm is never applied: the step is skipped (``skip_nonfinite``) or the run stops (except
    under DeepSpeed, whose engine steps before the norm is known: there the run stops after the step).
    """
    task = task or CausalLM()
    accumulation = len(micro_batches)
    engine = model if _is_deepspeed(accelerator) else None
    counts = _global_counts(accelerator, micro_batches, task, data_parallel_size, stop_flag)
    global_targets = counts[0]
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    grad_norm, skipped = None, False
    for index, batch in enumerate(micro_batches):
        boundary = index == accumulation - 1
        with accelerator.accumulate(model):
            if accelerator.sync_gradients != boundary:
                raise RuntimeError(
                    f"step {step}, micro-step {index}: accelerate's accumulation boundary "
                    f"(sync_gradients={accelerator.sync_gradients}) disagrees with ours (k={accumulation})"
                )
            micro_sum = task.row_losses(model, batch, chunked_loss).sum()
            local_targets = (torch.as_tensor(batch["num_targets"]) if "num_targets" in batch
                             else task.count_targets(batch))  # used by per_micro_batch only
            loss = micro_step_loss(micro_sum, local_targets, global_targets, data_parallel_size, accumulation,
                                   loss_normalization)
            accelerator.backward(loss)
            if after_backward is not None:
                after_backward(index)
            loss_sum += micro_sum.detach().double()
            if engine is not None and engine.is_gradient_accumulation_boundary() != boundary:
                raise RuntimeError(f"step {step}: DeepSpeed's accumulation boundary drifted from ours")
            if boundary:
                grad_norm, targets, global_tokens, stopping = _to_host(_clip_and_norm(accelerator, model, max_grad_norm),
                                                                       counts)
                stop = _nonfinite(grad_norm, step + 1)  # the norm is the same on every rank
                if stop is not None and not skip_nonfinite:
                    raise stop
                skipped = stop is not None
                if not skipped:
                    optimizer.step()
                    if not accelerator.optimizer_step_was_skipped:
                        scheduler.step()
                optimizer.zero_grad(set_to_none=True)
    if engine is not None:
        norm = engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else None
        stop = _nonfinite(grad_norm, step + 1)
        if stop is not None:
            raise stop
        if engine.global_steps != step + 1:
            raise RuntimeError(f"DeepSpeed took {engine.global_steps} optimizer steps, the loop {step + 1}")
    return StepResult(loss_sum=loss_sum, targets=targets, tokens=global_tokens, grad_norm=grad_norm, skipped=skipped,
                      stop_requested=stopping > 0)


# ------------------------------------------------------------------------------------------- between steps
def epoch_batches(accelerator, train_dl, sampler: GlobalBatchSampler, state: LoopState, accumulation: int):
    """An iterator over this rank's micro-batches from the loop's position to the end of the current epoch."""
    sampler.use_epoch(state.epoch)
    # Mid-epoch resume: skip the micro-batches of the steps already done in this epoch (same order: same epoch).
    skip = state.step_in_epoch * accumulation
    return iter(accelerator.skip_first_batches(train_dl, skip) if skip else train_dl)


class LogWindow:
    """Training loss, throughput, MFU and peak memory since the last logged step. The loss is reduced over ranks only
    when logged (``toolkit.accounting`` says how MFU is counted)."""

    def __init__(self, accelerator, flops_per_token: float, peak_flops: float | None, replicas: int = 1):
        self.accelerator = accelerator
        self.replicas = replicas  # ranks holding the same rows (tensor parallel): their losses are the same rows
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        self.targets = 0
        self.steps = 0
        self.throughput = Throughput()

    def add(self, result: StepResult) -> None:
        self.loss += result.loss_sum
        self.targets += result.targets
        self.steps += 1
        self.throughput.add(result.tokens)

    def exclude(self, seconds: float) -> None:
        self.throughput.t0 += seconds  # tokens/s counts training time only (not evaluation)

    def flush(self) -> dict:
        """Collective: the window's mean token loss, throughput, MFU and the peak memory of every rank."""
        total = float(self.accelerator.reduce(self.loss.clone(), reduction="sum")) / self.replicas
        memory = peak_memory_per_rank(self.accelerator)
        tokens_per_s, world = self.throughput.rate(), self.accelerator.num_processes
        out = {"loss": total / max(self.targets, 1), "tokens_per_s": tokens_per_s,
               "tokens_per_s_per_device": tokens_per_s / world,
               "steps_per_s": self.steps / max(self.throughput.seconds(), 1e-9),
               "peak_memory_gb": float(memory.max()),
               "peak_memory_gb_per_rank": [round(float(m), 3) for m in memory.tolist()]}
        if self.peak_flops:
            out["mfu"] = self.flops_per_token * tokens_per_s / world / self.peak_flops
        self.loss.zero_()
        self.targets = self.steps = 0
        self.throughput.reset()
        return out


def peak_memory_per_rank(accelerator) -> torch.Tensor:
    """Collective: every rank's peak memory so far, in GB (``toolkit.accounting.peak_memory_gb``)."""
    return accelerator.gather(torch.tensor([peak_memory_gb(accelerator.device)], device=accelerator.device))


def parallel_degrees(accelerator) -> str:
    """'; dp_replicate 2 x dp_shard 2' when accelerate's ParallelismConfig splits the ranks (HSDP), else ''."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or config.total_size <= 1:
        return ""
    parts = [f"{name} {getattr(config, name + '_size')}" for name in ("dp_replicate", "dp_shard", "tp", "cp")
             if getattr(config, name + "_size", 1) > 1]
    return "; " + " x ".join(parts)


def _call(callbacks, event: str, **kwargs) -> None:
    for cb in callbacks or ():
        fn = getattr(cb, event, None)
        if fn is not None:
            fn(**kwargs)


@dataclass
class ResumePlan:
    checkpoint: str  # the checkpoint resume_from_checkpoint names
    load_from: str  # the folder that loads: the checkpoint, or its converted copy
    conversion: str | None  # toolkit.convert's kind, or None
    saved: dict  # its toolkit_state.json


def _plan_resume(accelerator, cfg: RunConfig, order: dict, model) -> ResumePlan | None:
    """Before ``prepare``: the checkpoint ``resume_from_checkpoint`` names, after refusing one that cannot continue
    the same sample order (``toolkit.resume``; ``build`` has checked it already, before the weights loaded), and the
    folder to load, converted first if this launch cannot load it as written (collective: ``toolkit.convert``).
    None when the run starts afresh."""
    resume_from = layout.resolve_resume(cfg.train.output_dir, cfg.train.resume_from_checkpoint)
    if resume_from is None:
        return None
    saved, conversion = check_resume(resume_from, cfg, order, accelerator)
    load_from = resume_from if conversion is None else convert(accelerator, resume_from, conversion, model,
                                                               log=accelerator.print)
    return ResumePlan(resume_from, load_from, conversion, saved)


def _resume(accelerator, cfg: RunConfig, state: LoopState, optimizer, scheduler, plan: ResumePlan | None) -> str | None:
    """After ``prepare``: load the planned checkpoint (collective) and the loop's position. Returns its folder."""
    if plan is None:
        return None
    saved = plan.saved
    accelerator.print(f"resuming from {plan.checkpoint} (written by {saved['loop']['world_size']} ranks, "
                      f"{saved['strategy']}, at step {saved['loop']['step']})")
    ckpt.load_checkpoint(accelerator, plan.load_from, optimizer, scheduler, universal=plan.conversion == UNIVERSAL)
    state.load_state_dict(saved["loop"])
    state.world_size = accelerator.num_processes
    # accelerate restores its own micro-step counter, counted in the writer's accumulation; with another split of
    # the same global batch (8 x 1 resumed as 4 x 2) its boundaries would fall mid-step. Ours is the truth.
    accelerator.step = state.step * cfg.train.gradient_accumulation_steps
    return plan.checkpoint


def _prepare_output_dir(accelerator, args: TrainArgs, resume_from: str | None) -> None:
    """Main process, before the run writes anything: clear a killed save's leftovers; move an earlier run aside."""
    for path in layout.remove_stale_temporaries(args.output_dir):
        accelerator.print(f"removed {path}, left by a save that was interrupted")
    if resume_from is None and args.overwrite_output_dir:
        aside = layout.move_run_aside(args.output_dir)
        if aside:
            accelerator.print(f"overwrite_output_dir: the earlier run's files were moved to {aside}")


def checkpoint_record(accelerator, state: LoopState, order: dict) -> dict:
    """The JSON written into a checkpoint: the loop's position (with the writer's world size and global batch),
    what the order depends on, and the strategy whose format the checkpoint is in."""
    return {"loop": state.state_dict(), "order": order, "strategy": strategy_name(accelerator)}


# ---------------------------------------------------------------------------------------------- the loop
def _reuse_cpu_memory(args: TrainArgs, model) -> bool:
    """``cpu_memory_reuse``, unset: on, unless the run asked for less memory. The kept heap fragments (torch asks glibc
    for 64-byte aligned blocks, which a freed block of the same size cannot serve), and eats what the memory switches
    save: bench/memory.py measured activation checkpointing + chunked loss at 3.4 GB peak RSS without it, 8.8 GB
    with it. The model's flag is also set when FSDP's launch-config checkpointing was handed over to transformers."""
    if args.cpu_memory_reuse is not None:
        return args.cpu_memory_reuse
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers 5's name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return not (args.loss_chunk_size or checkpointing)


def train(cfg: RunConfig, accelerator, model, tokenizer, train_dataset, eval_dataset=None, collator=None,
          callbacks=None, task=None) -> dict:
    """Train, evaluate, checkpoint and export. Returns a summary dict (also printed on the main process).

    ``callbacks``: objects with any of ``on_prepared(accelerator, model, optimizer)``,
    ``on_micro_step(accelerator, state, micro_step)``, ``on_step_end(accelerator, state, row)`` and
    ``on_end(accelerator, model, summary)``, all called on every rank (tests use them to count all-reduces
    and to probe the trained model). ``task``: what a row's loss and the evaluation are (``toolkit.tasks``; a causal
    LM by default).
    """
    task = task or CausalLM()
    args = cfg.train
    world, accumulation, micro = accelerator.num_processes, args.gradient_accumulation_steps, \
        args.per_device_train_batch_size
    dp = data_parallel_size(accelerator)  # ranks that take different rows (under tensor parallelism: fewer than world)
    started = time.time()

    # --- the order, the loaders, the optimizer; prepared for the strategy
    require_one_global_batch(len(train_dataset), micro, dp, accumulation)
    sampler = GlobalBatchSampler(len(train_dataset), micro, dp, accumulation, seed=args.seed, shuffle=args.shuffle)
    global_batch, steps_per_epoch = sampler.global_batch_size, sampler.steps_per_epoch
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)

    train_dl = DataLoader(train_dataset, batch_sampler=sampler, collate_fn=collator,
                          num_workers=args.dataloader_num_workers)
    eval_dl = None
    if eval_dataset is not None and len(eval_dataset) > 0:
        eval_dl = DataLoader(eval_dataset, batch_size=args.per_device_eval_batch_size, shuffle=False,
                             collate_fn=collator, num_workers=args.dataloader_num_workers)
    if accelerator.device.type == "cpu" and _reuse_cpu_memory(args, model) and keep_freed_memory():
        accelerator.print("host memory: freed blocks are kept for reuse (cpu_memory_reuse; toolkit/host_memory.py)")
    n_params = count_parameters(model)  # before prepare: ZeRO-3 and FSDP shard the parameters
    optimizer = build_optimizer(model, args)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=total_steps)
    order = order_record(cfg, train_dataset)  # fixed for the run: hashed once, written into every checkpoint
    plan = _plan_resume(accelerator, cfg, order, model)
    configure_deepspeed(accelerator, args, load_universal=plan is not None and plan.conversion == UNIVERSAL)
    keep_embeddings_out_of_fsdp_units(accelerator, model)
    if eval_dl is not None:
        model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl,
                                                                             scheduler)
    else:
        model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    _call(callbacks, "on_prepared", accelerator=accelerator, model=model, optimizer=optimizer)

    # --- the position (from a checkpoint when resuming), the run's files
    state = LoopState(world_size=world, global_batch_size=global_batch)
    resume_from = _resume(accelerator, cfg, state, optimizer, scheduler, plan)
    if accelerator.is_main_process:
        _prepare_output_dir(accelerator, args, resume_from)
        write_config(cfg, layout.path(args.output_dir, layout.CONFIG))
    accelerator.init_trackers("toolkit", config={key: value for key, value in cfg.as_dict().items()
                                                 if isinstance(value, (int, float, str, bool))})
    logger = MetricsLogger(accelerator, args.output_dir, total_steps, start_step=state.step,
                           resume=resume_from is not None)
    tokens_at_start, start_step = state.tokens_seen, state.step  # a resumed run's rates count this attempt only
    tokens_per_row = len(train_dataset[0]["input_ids"]) if cfg.data.packing else None
    accelerator.print(
        f"world size {world} ({accelerator.distributed_type.value}{parallel_degrees(accelerator)}) | micro batch "
        f"{micro} | accumulation "
        f"{accumulation} | global batch {global_batch} sequences"
        + (f" = {global_batch * tokens_per_row} tokens" if tokens_per_row else " (padded, variable length)")
        + f" | {steps_per_epoch} steps/epoch ({len(train_dataset) - steps_per_epoch * global_batch} "
        f"rows left out per epoch) | {total_steps} optimizer steps from step {state.step}"
    )

    best_name, better = task.best_metric  # e.g. ("perplexity", min)
    best = None

    def evaluate_into(row: dict) -> None:
        nonlocal best
        result = evaluate(accelerator, model, eval_dl, task)
        row.update(result)
        best = result[best_name] if best is None else better(best, result[best_name])

    if eval_dl is not None and args.eval_on_start and state.step == 0:
        row = {"step": 0, "epoch": 0.0, "tokens_seen": 0}
        evaluate_into(row)
        logger.log(row)

    # --- the steps
    def after_backward(micro_step: int) -> None:
        _call(callbacks, "on_micro_step", accelerator=accelerator, state=state, micro_step=micro_step)

    layers, width = model_shape(accelerator.unwrap_model(model).config)
    mean_row = (sum(len(r) for r in train_dataset[:256]["input_ids"]) / min(len(train_dataset), 256))
    per_token = flops_per_token(n_params, layers, width, tokens_per_row or mean_row)
    peak = peak_flops(accelerator.device, accelerator.mixed_precision, args.peak_flops)
    window = LogWindow(accelerator, per_token, peak, replicas=world // dp)
    preemption = Preemption()
    preempted = False
    batches = None
    model.train()
    try:  # the previous SIGTERM handler comes back even when a step raises (a notebook kernel lives on)
        while state.step < total_steps:
            if batches is None:  # an epoch starts, or resumes part-way
                batches = epoch_batches(accelerator, train_dl, sampler, state, accumulation)
            micro_batches = [next(batches) for _ in range(accumulation)]
            result = train_step(accelerator, model, optimizer, scheduler, micro_batches,
                                step=state.step, data_parallel_size=dp, max_grad_norm=args.max_grad_norm,
                                loss_normalization=args.loss_normalization, skip_nonfinite=args.skip_nonfinite_steps,
                                after_backward=after_backward, chunked_loss=args.loss_chunk_size > 0, task=task,
                                stop_flag=preemption.requested())
            if state.finish_step(result, steps_per_epoch):
                batches = None
            window.add(result)
            logger.advance()

            # Every rank takes the same decisions here, so the collectives inside (loss reduction, eval) are matched.
            last = state.step == total_steps
            row = {"step": state.step, "epoch": state.epochs_done(steps_per_epoch), "tokens_seen": state.tokens_seen}
            logged = state.step % args.logging_steps == 0 or last
            if logged:
                window_stats = window.flush()
                row.update(lr=scheduler.get_last_lr()[0], grad_norm=result.grad_norm, **window_stats)
                if state.skipped_steps:
                    row["skipped_steps"] = state.skipped_steps
            evaluated = eval_dl is not None and ((args.eval_steps and state.step % args.eval_steps == 0) or last)
            if evaluated:
                eval_started = time.perf_counter()
                evaluate_into(row)
                window.exclude(time.perf_counter() - eval_started)
            if logged or evaluated:
                logger.log(row)
            _call(callbacks, "on_step_end", accelerator=accelerator, state=state,
                  row=row if (logged or evaluated) else None)
            # Agreed on by every rank through the step's counts: a signal that arrives during a step stops the run
            # after the next one (the flag is sent with the counts, before the step's first backward).
            preempted = state.step < total_steps and result.stop_requested
            if (args.save_steps and state.step % args.save_steps == 0) or preempted:
                record = checkpoint_record(accelerator, state, order)
                ckpt.save_checkpoint(accelerator, args.output_dir, state.step, args.save_total_limit, record=record,
                                     protect=resume_from)
            if preempted:
                accelerator.print(f"{preemption.reason()}: saved checkpoint step-{state.step}; relaunch with "
                                  "resume_from_checkpoint: latest to continue", flush=True)
                break
    finally:
        preemption.restore()

    # --- the end: plot, export, summary (a preempted run is not finished: no export)
    logger.close()
    if accelerator.is_main_process:
        plot_run(args.output_dir)
    final_dir = layout.final_dir(args.output_dir)
    if args.save_final_model and not preempted:
        ckpt.save_final(accelerator, model, tokenizer, final_dir, merge_lora=cfg.model.merge_lora)
    elapsed = time.time() - started
    memory = peak_memory_per_rank(accelerator)
    tokens_per_s = (state.tokens_seen - tokens_at_start) / elapsed if elapsed > 0 else 0.0
    summary = {
        "steps": state.step,
        "epochs": state.epochs_done(steps_per_epoch),
        "tokens_seen": state.tokens_seen,
        "seconds": elapsed,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / world,
        "steps_per_s": (state.step - start_step) / elapsed if elapsed > 0 else 0.0,
        "mfu": per_token * tokens_per_s / world / peak if peak else None,
        "peak_memory_gb_per_rank": [round(float(m), 3) for m in memory],
        f"best_eval_{best_name}": best,
        "final_model": os.path.abspath(final_dir) if args.save_final_model and not preempted else None,
        "preempted": preempted,
        "world_size": world,
        "data_parallel_size": dp,  # ranks taking other rows: world / tp_size
        "distributed_type": accelerator.distributed_type.value,
    }
    # Before end_training, which destroys the process group: a sharded model (ZeRO-3, FSDP) needs collectives even
    # for a forward pass.
    _call(callbacks, "on_end", accelerator=accelerator, model=model, summary=summary)
    accelerator.end_training()
    if accelerator.is_main_process:
        write_summary(args.output_dir, summary)
        print(format_run_summary(summary), flush=True)
    return summary

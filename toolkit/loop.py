"""The training loop: one readable function, the same under DDP, DeepSpeed ZeRO-2/3 and FSDP.

One optimizer step, on each of the W ranks:

    1. take this rank's k micro-batches of the step (the rows come from ``toolkit.order``: independent of W and k);
    2. count target tokens locally, all-reduce: T = target tokens of the whole global batch (one tiny all-reduce);
    3. for each micro-step, inside ``accelerator.accumulate(model)`` (which applies ``no_sync`` on all but the last
       micro-step where the strategy allows it, and tells DeepSpeed where its boundary is):
           backward( sum of token CE * W * k / T )          (see ``toolkit.loss`` for why this is exact)
    4. on the last micro-step: clip the global grad norm, optimizer step, scheduler step, zero grads.

Everything needed to continue exactly lives in ``LoopState`` (and the optimizer/scheduler/RNG states that
``save_state`` writes): step, epoch, the position inside the epoch, and the token counters.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from toolkit import checkpoint as ckpt
from toolkit.config import ConfigError, RunConfig, TrainingArguments, write_config
from toolkit.distributed import configure_deepspeed
from toolkit.loss import count_targets, micro_step_loss, token_losses
from toolkit.metrics import MetricsLogger, Throughput
from toolkit.order import GlobalBatchSampler, require_one_global_batch


@dataclass
class LoopState:
    """The loop's position. Saved in every checkpoint (``register_for_checkpointing``)."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # current epoch
    step_in_epoch: int = 0  # optimizer steps completed within the current epoch
    tokens_seen: int = 0  # non-pad input tokens, all ranks
    targets_seen: int = 0  # next-token targets, all ranks
    samples_seen: int = 0  # rows, all ranks
    world_size: int = 1  # the world that wrote the checkpoint (informational)
    global_batch_size: int = 0  # rows per optimizer step: the step -> rows mapping of toolkit.order depends on it

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def build_optimizer(model: torch.nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
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


def _unwrapped_positions(model) -> int | None:
    config = getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, attr, None), int):
            return getattr(config, attr)
    return None


@torch.no_grad()
def evaluate(accelerator, model, eval_dataloader) -> dict:
    """Mean token loss and perplexity over the whole validation set.

    Per-row sums go through ``gather_for_metrics``, which drops the rows accelerate repeats to give every rank an
    equal number of batches, so each validation row counts exactly once.
    """
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    targets = torch.zeros((), dtype=torch.long, device=accelerator.device)
    for batch in eval_dataloader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        row_loss, row_targets = token_losses(logits, batch["labels"])
        row_loss, row_targets = accelerator.gather_for_metrics((row_loss, row_targets))
        loss_sum += row_loss.double().sum()
        targets += row_targets.sum()
    model.train()
    loss = (loss_sum / targets.clamp(min=1)).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(targets.item())}


def _clip_and_norm(accelerator, model, max_grad_norm: float):
    """Clip to max_grad_norm (0 = off) and return the global pre-clip norm, as a float or None."""
    if accelerator.distributed_type.value == "DEEPSPEED":
        return None  # DeepSpeed clips inside engine.step() (gradient_clipping set from the recipe); norm read after
    # With clipping off, a max norm of inf still returns the norm and scales by exactly 1.0 (min(inf/n, 1) == 1).
    norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))
    return float(norm) if norm is not None else None


def _deepspeed_engine(accelerator, model):
    if accelerator.distributed_type.value != "DEEPSPEED":
        return None
    return model


def _call(callbacks, event: str, **kwargs) -> None:
    for cb in callbacks or ():
        fn = getattr(cb, event, None)
        if fn is not None:
            fn(**kwargs)


def train(cfg: RunConfig, accelerator, model, tokenizer, train_dataset, eval_dataset=None, collator=None,
          callbacks=None) -> dict:
    """Train, evaluate, checkpoint and export. Returns a summary dict (also printed on the main process).

    ``callbacks``: objects with any of ``on_prepared(accelerator, model, optimizer)``,
    ``on_micro_step(accelerator, state, micro_step)``, ``on_step_end(accelerator, state, row)`` and
    ``on_end(accelerator, model, summary)``, all called on every rank (tests use them to count all-reduces
    and to probe the trained model).
    """
    t = cfg.train
    world, k, micro = accelerator.num_processes, t.gradient_accumulation_steps, t.per_device_train_batch_size
    started = time.time()

    require_one_global_batch(len(train_dataset), micro, world, k)
    sampler = GlobalBatchSampler(len(train_dataset), micro, world, k, seed=t.seed, shuffle=t.shuffle)
    global_batch = sampler.global_batch_size
    total_steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * sampler.steps_per_epoch)

    train_dl = DataLoader(train_dataset, batch_sampler=sampler, collate_fn=collator, num_workers=t.dataloader_num_workers)
    eval_dl = None
    if eval_dataset is not None and len(eval_dataset) > 0:
        eval_dl = DataLoader(eval_dataset, batch_size=t.per_device_eval_batch_size, shuffle=False, collate_fn=collator,
                             num_workers=t.dataloader_num_workers)

    optimizer = build_optimizer(model, t)
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=t.warmup_steps,
                              num_training_steps=total_steps)
    configure_deepspeed(accelerator, t)
    if eval_dl is not None:
        model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    else:
        model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    engine = _deepspeed_engine(accelerator, model)
    _call(callbacks, "on_prepared", accelerator=accelerator, model=model, optimizer=optimizer)

    state = LoopState(world_size=world, global_batch_size=global_batch)
    accelerator.register_for_checkpointing(state)
    resume_from = ckpt.resolve_resume(t.output_dir, t.resume_from_checkpoint)
    if resume_from is not None:
        accelerator.print(f"resuming from {resume_from}")
        ckpt.load_checkpoint(accelerator, resume_from, optimizer)
        if state.global_batch_size not in (0, global_batch):
            # Step s covers rows [s*B, (s+1)*B) of the epoch's order: another B would skip or repeat rows.
            raise ConfigError(
                "per_device_train_batch_size",
                f"the checkpoint {resume_from} was written with a global batch of {state.global_batch_size} rows, "
                f"this run has {global_batch} ({world} ranks x {micro} x {k} accumulation); keep "
                "ranks x per_device_train_batch_size x gradient_accumulation_steps equal to resume",
            )
        state.world_size, state.global_batch_size = world, global_batch
    if accelerator.is_main_process:
        write_config(cfg, os.path.join(t.output_dir, "config.yaml"))
    accelerator.init_trackers("toolkit", config={k_: v for k_, v in cfg.as_dict().items()
                                                 if isinstance(v, (int, float, str, bool))})
    logger = MetricsLogger(accelerator, t.output_dir, total_steps, start_step=state.step, resume=resume_from is not None)

    tokens_per_row = len(train_dataset[0]["input_ids"]) if cfg.data.packing else None
    accelerator.print(
        f"world size {world} ({accelerator.distributed_type.value}) | micro batch {micro} | accumulation {k} | "
        f"global batch {global_batch} sequences"
        + (f" = {global_batch * tokens_per_row} tokens" if tokens_per_row else " (padded, variable length)")
        + f" | {sampler.steps_per_epoch} steps/epoch ({len(train_dataset) - sampler.steps_per_epoch * global_batch} "
        f"rows left out per epoch) | {total_steps} optimizer steps from step {state.step}"
    )

    best_eval = None

    def run_eval(row: dict):
        nonlocal best_eval
        if eval_dl is None:
            return
        result = evaluate(accelerator, model, eval_dl)
        row.update(result)
        if best_eval is None or result["perplexity"] < best_eval:
            best_eval = result["perplexity"]

    if t.eval_on_start and state.step == 0:
        row = {"step": 0, "epoch": 0.0, "tokens_seen": 0}
        run_eval(row)
        logger.log(row)

    window_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    window_targets = 0
    throughput = Throughput()
    grad_norm = None
    model.train()
    while state.step < total_steps:
        sampler.use_epoch(state.epoch)
        # Mid-epoch resume: skip the micro-batches of the steps already done in this epoch (same order: same epoch).
        dl = accelerator.skip_first_batches(train_dl, state.step_in_epoch * k) if state.step_in_epoch else train_dl
        batches = iter(dl)
        while state.step_in_epoch < sampler.steps_per_epoch and state.step < total_steps:
            micro_batches = [next(batches) for _ in range(k)]
            local = torch.tensor(
                [sum(int(count_targets(b["labels"])) for b in micro_batches),
                 sum(int(b["attention_mask"].sum()) for b in micro_batches)],
                device=accelerator.device,
            )
            global_targets, global_tokens = accelerator.reduce(local, reduction="sum")
            step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            for m, batch in enumerate(micro_batches):
                with accelerator.accumulate(model):
                    if accelerator.sync_gradients != (m == k - 1):
                        raise RuntimeError(
                            f"step {state.step}, micro-step {m}: accelerate's accumulation boundary "
                            f"(sync_gradients={accelerator.sync_gradients}) disagrees with ours (k={k})"
                        )
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    row_loss, _ = token_losses(logits, batch["labels"])
                    loss_sum = row_loss.sum()
                    loss = micro_step_loss(loss_sum, count_targets(batch["labels"]), global_targets, world, k,
                                           t.loss_normalization)
                    accelerator.backward(loss)
                    _call(callbacks, "on_micro_step", accelerator=accelerator, state=state, micro_step=m)
                    step_loss += loss_sum.detach().double()
                    if engine is not None and engine.is_gradient_accumulation_boundary() != (m == k - 1):
                        raise RuntimeError(f"step {state.step}: DeepSpeed's accumulation boundary drifted from ours")
                    if accelerator.sync_gradients:
                        grad_norm = _clip_and_norm(accelerator, model, t.max_grad_norm)
                        optimizer.step()
                        if not accelerator.optimizer_step_was_skipped:
                            scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
            if engine is not None:
                grad_norm = engine.get_global_grad_norm()
                grad_norm = float(grad_norm) if grad_norm is not None else None
                if engine.global_steps != state.step + 1:
                    raise RuntimeError(
                        f"DeepSpeed took {engine.global_steps} optimizer steps, the loop {state.step + 1}"
                    )

            state.step += 1
            state.step_in_epoch += 1
            state.tokens_seen += int(global_tokens)
            state.targets_seen += int(global_targets)
            state.samples_seen += global_batch
            window_loss += step_loss  # this rank's share; reduced only when logged
            window_targets += int(global_targets)
            throughput.add(int(global_tokens))
            logger.advance()

            last = state.step == total_steps
            do_log = state.step % t.logging_steps == 0 or last
            do_eval = eval_dl is not None and ((t.eval_steps and state.step % t.eval_steps == 0) or last)
            if do_log or do_eval:
                row = {
                    "step": state.step,
                    "epoch": state.epoch + state.step_in_epoch / sampler.steps_per_epoch,
                    "tokens_seen": state.tokens_seen,
                }
                if do_log:
                    # do_log is the same on every rank, so this collective is matched.
                    window_total = float(accelerator.reduce(window_loss.clone(), reduction="sum"))
                    row.update(
                        loss=window_total / max(window_targets, 1),
                        lr=scheduler.get_last_lr()[0],
                        grad_norm=grad_norm,
                        tokens_per_s=throughput.rate(),
                    )
                    window_loss.zero_()
                    window_targets = 0
                    throughput.reset()
                if do_eval:
                    eval_started = time.perf_counter()
                    run_eval(row)
                    throughput.t0 += time.perf_counter() - eval_started  # tokens/s counts training time only
                logger.log(row)
            _call(callbacks, "on_step_end", accelerator=accelerator, state=state, row=row if (do_log or do_eval) else None)
            if t.save_steps and state.step % t.save_steps == 0:
                ckpt.save_checkpoint(accelerator, t.output_dir, state.step, t.save_total_limit, protect=resume_from)
        if state.step_in_epoch >= sampler.steps_per_epoch:
            state.epoch += 1
            state.step_in_epoch = 0

    logger.close()
    if accelerator.is_main_process:
        from toolkit.plots import plot_run

        plot_run(t.output_dir)
    final_dir = os.path.join(t.output_dir, "final")
    if t.save_final_model:
        ckpt.save_final(accelerator, model, tokenizer, final_dir)
    elapsed = time.time() - started
    summary = {
        "steps": state.step,
        "epochs": state.epoch + state.step_in_epoch / sampler.steps_per_epoch,
        "tokens_seen": state.tokens_seen,
        "seconds": elapsed,
        "tokens_per_s": state.tokens_seen / elapsed if elapsed > 0 else 0.0,
        "best_eval_perplexity": best_eval,
        "final_model": os.path.abspath(final_dir) if t.save_final_model else None,
        "world_size": world,
        "distributed_type": accelerator.distributed_type.value,
    }
    # Before end_training, which destroys the process group: a sharded model (ZeRO-3, FSDP) needs collectives even
    # for a forward pass.
    _call(callbacks, "on_end", accelerator=accelerator, model=model, summary=summary)
    accelerator.end_training()
    if accelerator.is_main_process:
        import json

        from toolkit.report import SUMMARY_FILE, format_run_summary

        # `toolkit report` reads it: world size, strategy and wall time are in no other file of the run.
        with open(os.path.join(t.output_dir, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=2)
        print(format_run_summary(summary), flush=True)
    return summary

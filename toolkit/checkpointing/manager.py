"""The one object the loop talks to about checkpoints (as torchtitan's ``CheckpointManager``): ``load`` once after
``prepare``, ``save`` after every optimizer step (it decides whether that step writes, and exports ``final/`` after
the last one).

The resume is planned once, before the weights load (``plan_resume``: ``toolkit.training.build`` calls it so that a resume
that cannot continue is refused before any weights load), and the plan is carried into ``Checkpointer``. What the
plan decides before ``prepare`` (DeepSpeed must be told it will load a universal checkpoint) is read from it; the
conversion itself, the load and the position happen in ``load``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from toolkit import layout
from toolkit.checkpointing import checkpoint
from toolkit.checkpointing.convert import UNIVERSAL, convert
from toolkit.checkpointing.resume import check_resume, check_resume_of, checkpoint_format, launched_format, order_record


@dataclass
class ResumePlan:
    """What a run continues from, decided before the weights load."""

    order: dict  # what this run's sample order depends on (``order_record``), written into every checkpoint
    checkpoint: str | None = None  # the checkpoint resume_from_checkpoint names; None: the run starts afresh
    saved: dict | None = None  # its toolkit_state.json
    conversion: str | None = None  # toolkit.checkpointing.convert's kind when it cannot load as written

    @property
    def loads_universal(self) -> bool:
        """DeepSpeed's config must say so before ``prepare`` (``toolkit.parallel.accelerator.configure_deepspeed``)."""
        return self.conversion == UNIVERSAL


def plan_resume(cfg, accelerator, train_dataset, repeats: int = 1) -> ResumePlan:
    """The checkpoint ``resume_from_checkpoint`` names (``latest`` resolved), after refusing one that cannot continue
    the same sample order or that this launch cannot load, even converted (``toolkit.checkpointing.resume``).
    ``repeats``: the task's ``sample_repeats``."""
    order = order_record(cfg, train_dataset, repeats)  # hashed once per run
    resume_from = layout.resolve_resume(cfg.train.output_dir, cfg.train.resume_from_checkpoint)
    if resume_from is None:
        return ResumePlan(order)
    saved, conversion = check_resume(resume_from, cfg, order, accelerator)
    return ResumePlan(order, resume_from, saved, conversion)


def check_resume_before_launch(cfg, train_dataset, repeats: int, num_processes: int, ranks: int) -> None:
    """``plan_resume``'s refusals from the files alone, in the launching process (``toolkit train``'s check, in the
    environment ``accelerate launch`` gives the ranks): another LoRA layout, quantized base, optimizer, sample order
    or global batch, or a format this launch cannot load, is one line and exit 2 before the launch. The ranks check
    again (``plan_resume``): ``accelerate launch`` alone reaches only that."""
    resume_from = layout.resolve_resume(cfg.train.output_dir, cfg.train.resume_from_checkpoint)
    if resume_from is not None:
        check_resume_of(resume_from, cfg, order_record(cfg, train_dataset, repeats), launched_format(cfg),
                        num_processes, ranks)


class Checkpointer:
    """Checkpoints of one run: the prepared model, optimizer and scheduler, and the loop's position (``LoopState``)."""

    def __init__(self, accelerator, cfg, plan: ResumePlan, model, optimizer, scheduler, tokenizer=None):
        self.accelerator, self.args, self.plan = accelerator, cfg.train, plan
        self.merge_lora = cfg.model.merge_lora
        self.model, self.optimizer, self.scheduler, self.tokenizer = model, optimizer, scheduler, tokenizer
        self.exported: str | None = None  # final/, once this run wrote it (the summary names only what was written)
        self.task = None  # the run's task (toolkit.tasks.base): its checkpoint_state is saved and loaded with the loop's
        self.async_saves = checkpoint.AsyncSaves() if cfg.train.async_save else None
        self.stalls: list[float] = []  # seconds the loop waited per synchronous save (async: async_saves.stalls)

    def load(self, state) -> str | None:
        """Collective. Load the planned checkpoint (converted first when this launch cannot read it as written) and
        the loop's position into ``state``; then, on the main process, clear a killed save's leftovers and move an
        earlier run aside (``overwrite_output_dir``). Returns the checkpoint, or None for a fresh run."""
        plan, accelerator = self.plan, self.accelerator
        if plan.checkpoint is not None:
            saved = plan.saved
            accelerator.print(f"resuming from {plan.checkpoint} (written by {saved['loop']['world_size']} ranks, "
                              f"{saved['strategy']}, at step {saved['loop']['step']})")
            load_from = plan.checkpoint
            if plan.conversion is not None:  # the unwrapped model names the tied parameters a plain copy leaves out
                load_from = convert(accelerator, plan.checkpoint, plan.conversion, self._whole_model(),
                                    log=accelerator.print)
            checkpoint.load_checkpoint(accelerator, load_from, self.optimizer, self.scheduler,
                                       universal=plan.loads_universal, pipeline_model=self._stages())
            state.load_state_dict(saved["loop"])
            if self.task is not None:
                self.task.load_checkpoint_state(saved.get("task"))
            state.world_size = accelerator.num_processes
            # accelerate restores its own micro-step counter, counted in the writer's accumulation; with another
            # split of the same global batch (8 x 1 resumed as 4 x 2) its boundaries would fall mid-step. Ours wins.
            accelerator.step = state.step * self.args.gradient_accumulation_steps
        if accelerator.is_main_process:
            self._prepare_output_dir()
        return plan.checkpoint

    def _stages(self):
        """A pipeline's stages (``toolkit.parallel.pipeline``), checkpointed by the whole model's names; None otherwise."""
        return self.model if self.args.pipeline_parallel_size > 1 else None

    def _whole_model(self):
        return self.model.whole_model if self._stages() is not None else self.accelerator.unwrap_model(self.model)

    def _prepare_output_dir(self) -> None:
        for path in layout.remove_stale_temporaries(self.args.output_dir):
            self.accelerator.print(f"removed {path}, left by a save that was interrupted")
        foreign = self.plan.checkpoint is None or not layout.belongs_to(self.plan.checkpoint, self.args.output_dir)
        if foreign and self.args.overwrite_output_dir:  # a fresh start, or another output_dir's checkpoint
            aside = layout.move_run_aside(self.args.output_dir)
            if aside:
                self.accelerator.print(f"overwrite_output_dir: the earlier run's files were moved to {aside}")

    def save(self, state, last_step: bool = False, preempted: bool = False) -> str | None:
        """Collective, after every optimizer step (every rank takes the same decision). A checkpoint every
        ``save_steps`` and when the run was preempted; after the last step, the final export (a preempted run is
        not finished: no export). Returns the checkpoint written, if any."""
        args, written = self.args, None
        due = (args.save_steps and state.step % args.save_steps == 0) or preempted
        if self.async_saves is not None:
            self.async_saves.poll(self.accelerator)  # a write that finished since: latest moves to it now (collective)
            if due and not preempted:  # a preempted run's save is its last: written before the process exits
                self._save_async(state)
                due = False
            elif due:
                self.async_saves.wait(self.accelerator)
        if due:
            started, stages = time.perf_counter(), self._stages()
            written = checkpoint.save_checkpoint(self.accelerator, args.output_dir, state.step, args.save_total_limit,
                                                 record=self.record(state), protect=self.plan.checkpoint,
                                                 pipeline=None if stages is None else (stages, self.optimizer, self.scheduler))
            self.stalls.append(time.perf_counter() - started)
        if last_step and not preempted:
            self.export()
        return written

    def _save_async(self, state) -> None:
        """Collective: stage a checkpoint and write it in the background (``checkpoint.AsyncSaves``); the loop's
        ``on_save`` is called for it once the write is complete (``completed``), with the state as it was saved."""
        saves = self.async_saves
        saves.start(self.accelerator, self.args.output_dir, state.step, self.args.save_total_limit,
                    record={**self.record(state), "layout": checkpoint.ASYNC_FOLDER}, protect=self.plan.checkpoint,
                    state=copy.copy(state))
        if len(saves.stalls) == 1:
            self.accelerator.print(f"async_save: each checkpoint is staged in {saves.staged_bytes / 2**20:.1f} MiB "
                                   "of host memory per rank and written in the background", flush=True)

    def finish(self) -> None:
        """Every rank, once the loop ended however it ended: the write under way (async_save) finishes and completes
        before the process goes on (and exits); the loop's stall per save is printed."""
        import statistics

        stalls = self.stalls
        if self.async_saves is not None:
            self.async_saves.close(self.accelerator)
            stalls = self.async_saves.stalls + stalls
        if stalls:
            kind = "async_save" if self.async_saves is not None else "synchronous"
            self.accelerator.print(f"checkpoint stall: median {statistics.median(stalls):.4f} s per save over "
                                   f"{len(stalls)} saves ({kind})", flush=True)

    def completed(self) -> list[tuple[object, str]]:
        """The asynchronous writes completed since the last call, oldest first: (the loop's state as saved, the
        checkpoint folder ``latest`` now names), the same on every rank (``AsyncSaves.poll``)."""
        if self.async_saves is None:
            return []
        done, self.async_saves.completed = self.async_saves.completed, []
        return done

    def export(self) -> str | None:
        """Collective: the final export (``final/``) of the weights as they are, when ``save_final_model`` asks for
        it; once per run. Returns the folder written (also kept in ``exported``), or None."""
        if self.args.save_final_model and self.exported is None:
            path = layout.final_dir(self.args.output_dir)
            checkpoint.save_final(self.accelerator, self.model, self.tokenizer, path, merge_lora=self.merge_lora)
            self.exported = path
        return self.exported

    def record(self, state) -> dict:
        """Collective. The JSON written into a checkpoint: the loop's position (with the writer's world size and global
        batch), what the order depends on, the strategy whose format the checkpoint is in, and the task's state."""
        record = {"loop": state.state_dict(), "order": self.plan.order, "strategy": checkpoint_format(self.accelerator)}
        task_state = self.task.checkpoint_state(state.step) if self.task is not None else None  # collective
        return {**record, "task": task_state} if task_state else record

"""The loop's position (``LoopState``, saved in every checkpoint) and what one optimizer step did (``StepResult``).

A bottom-layer module (no toolkit imports, no torch at import time) so that the loop, the metrics and the
checkpoints share these two types without importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class LoopState:
    """The loop's position. Saved in every checkpoint's ``toolkit_state.json``."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # current epoch
    step_in_epoch: int = 0  # optimizer steps completed within the current epoch
    tokens_seen: int = 0  # non-pad input tokens, all ranks
    targets_seen: int = 0  # next-token targets, all ranks
    samples_seen: int = 0  # rows, all ranks
    skipped_steps: int = 0  # steps not applied: a non-finite norm (skip_nonfinite_steps) or an fp16 overflow
    world_size: int = 1  # the world of this run (in a checkpoint: the world that wrote it)
    global_batch_size: int = 0  # rows per optimizer step: the step -> rows mapping of toolkit.data.order depends on it
    stream: dict | None = None  # streaming: where the source restarts for the next step (toolkit.data.stream.position)

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
    overflows: int = 0  # fp16 loss-scaling overflows in a row, this step included (0: this step was not one)
    stop_requested: bool = False  # some rank was asked to stop (SIGTERM) before this step began
    slots: int = 0  # positions the forward computed over the whole global batch (real tokens + padding)


"""Preemption: SIGTERM (what SLURM and cloud schedulers send before they kill a job) becomes "save and stop".

The handler only sets a flag; the loop asks ``stop_requested()`` after each optimizer step. Ranks do not all get the
signal at the same moment (or at all: a scheduler may signal one process), so the answer is agreed on by one tiny
all-reduce: if any rank was signalled, every rank finishes the same step, saves the same checkpoint and stops.
``accelerate launch`` (torch elastic) forwards SIGTERM to its ranks and gives them 30 s before SIGKILL; the launcher
itself then exits 143 (128 + SIGTERM), the convention schedulers requeue on, while each rank exits 0.
"""

from __future__ import annotations

import signal

import torch


class Preemption:
    def __init__(self, accelerator, signals=(signal.SIGTERM,)):
        self.accelerator = accelerator
        self.received: int | None = None
        self._previous = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some notebook runners): no handler, never preempted
                pass

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def stop_requested(self) -> bool:
        """Collective when there are several processes: True on every rank if any rank was signalled."""
        flag = 1 if self.received is not None else 0
        if self.accelerator.num_processes > 1:
            flag = int(self.accelerator.reduce(torch.tensor([flag], device=self.accelerator.device), "max").item())
        return bool(flag)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

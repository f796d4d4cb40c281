"""Preemption: SIGTERM (what SLURM and cloud schedulers send before they kill a job) becomes "save and stop".

The handler only sets a flag; the loop sends it with each step's counts (``loop.train_step``, one all-reduce for
both) and stops when any rank's flag was set. Ranks do not all get the signal at the same moment (or at all: a
scheduler may signal one process), so the sum decides: if any rank was signalled, every rank finishes the same
step, saves the same checkpoint and stops. A signal that lands during a step is sent with the next step's counts,
so the run stops one step later than it could: a step of delay inside the launcher's 30 s grace period, instead of
a collective and a host-device synchronisation of its own every step.
``accelerate launch`` (torch elastic) forwards SIGTERM to its ranks and gives them 30 s before SIGKILL; the launcher
itself then exits 143 (128 + SIGTERM), the convention schedulers requeue on, while each rank exits 0.
"""

from __future__ import annotations

import signal


class Preemption:
    def __init__(self, signals=(signal.SIGTERM,)):
        self.received: int | None = None
        self._previous = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some notebook runners): no handler, never preempted
                pass

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

"""Preemption: SIGTERM (what SLURM and cloud schedulers send before they kill a job) becomes "save and stop"; so does
the loss of the launcher.

The handler only sets a flag; the loop sends it with each step's counts (``loop.train_step``, one all-reduce for
both) and stops when any rank's flag was set. Ranks do not all get the signal at the same moment (or at all: a
scheduler may signal one process), so the sum decides: if any rank was signalled, every rank finishes the same
step, saves the same checkpoint and stops. A signal that lands during a step is sent with the next step's counts,
so the run stops one step later than it could: a step of delay inside the launcher's 30 s grace period, instead of
a collective and a host-device synchronisation of its own every step.
``accelerate launch`` (torch elastic) forwards SIGTERM to its ranks and gives them 30 s before SIGKILL; the launcher
itself then exits 143 (128 + SIGTERM), the convention schedulers requeue on, while each rank exits 0.

A launcher that dies without forwarding anything (SIGKILL, the OOM killer, a closed terminal's process group) leaves
its ranks running: torch elastic starts each worker in a session of its own, so nothing reaches them, and orphaned
ranks would go on training and writing into ``output_dir`` while the user relaunches into it. Under torch elastic a
rank therefore also raises the flag when its parent process changes (the kernel re-parents an orphan): the ranks
finish the step, save and stop, as on SIGTERM. The launcher's pid is recorded when the process starts
(``toolkit.env.elastic.record_launcher``), so a launcher lost during tokenization, model loading or a conversion is seen at
the first step. One ``getppid`` per step; no thread, no ``PR_SET_PDEATHSIG`` (which
fires when the *thread* that started the child exits, not the process).
"""

from __future__ import annotations

import os
import signal

from toolkit.env import elastic


class Preemption:
    def __init__(self, signals=(signal.SIGTERM,)):
        self.received: int | None = None
        self._previous = {}
        self._launcher = elastic.launcher_pid()  # recorded at process start (toolkit.env.elastic.record_launcher)
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some notebook runners): no handler, never preempted
                pass

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def launcher_gone(self) -> bool:
        return self._launcher is not None and os.getppid() != self._launcher

    def requested(self) -> bool:
        """This rank was asked to stop: a signal arrived, or its launcher is gone."""
        return self.received is not None or self.launcher_gone()

    def reason(self) -> str:
        """What this rank saw, for the log line (another rank's request stops it too, with nothing seen here)."""
        if self.received is not None:
            return signal.Signals(self.received).name
        if self.launcher_gone():
            return "launcher gone"
        return "stop requested by another rank"

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

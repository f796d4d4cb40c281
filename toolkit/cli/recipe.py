"""A recipe's ``main`` as a process: what a user's mistake or a stopped run looks like on the command line, and how a
launched rank ends.

``cli(main)`` is the last line of every recipe: a ``ConfigError`` becomes one line on stderr and exit code 2, a
``TrainingStopped`` one line and exit code 1, and a recipe run as a script (a launched rank, or plain ``python
recipes/x.py``) whose work is done exits without the interpreter's teardown. Parsing (``toolkit.config``) only raises; the exit happens here.

Under a launcher every rank meets the same mistake: each exits with the code, but only the first rank of a machine
to fail prints the line (``toolkit.env.elastic.first_to_report``). What the launchers then print and return:
docs/reliability.md#exit-codes.
"""

from __future__ import annotations

import os
import sys

from toolkit.env.elastic import first_to_report
from toolkit.errors import ConfigError, TrainingStopped


def cli(main_fn):
    """Run ``main_fn``; a ConfigError becomes one line on stderr and exit code 2 (argparse's code for usage), a
    TrainingStopped one line and exit code 1."""
    try:
        result = main_fn()
    except ConfigError as e:
        _report("config-error", f"config error: {e}")
        sys.exit(2)
    except TrainingStopped as e:
        _report("training-stopped", f"training stopped: {e}")
        sys.exit(1)
    if "LOCAL_RANK" in os.environ or sys._getframe(1).f_globals.get("__name__") == "__main__":
        _exit_without_teardown()  # a script's last line (a launched rank or `python recipe.py`), not a library call
    return result


def _report(what: str, line: str) -> None:
    """``line`` on stderr in one write (print writes the text and the newline apart: two ranks' lines interleaved),
    by the first rank of the machine that fails this way."""
    if first_to_report(what):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _exit_without_teardown() -> None:
    """End a recipe process whose work is done and written: exit handlers, then exit 0, skipping the interpreter's
    teardown.

    In that teardown a rank aborts now and then, after everything is saved and the process group is gone
    ("terminate called without an active exception", exit -6: a C++ thread destroyed while joinable; seen under
    ZeRO-3, about once per full test suite, 0 in 12 targeted launches). The launcher then reports the whole job as
    failed and SLURM requeues a finished run. Python's exit handlers (trackers, logging, our process-group
    teardown) still run first; only the object and module teardown after them is skipped. A plain one-process run
    skips it too: freeing every object of torch, transformers and accelerate one by one costs about 1 s of CPU
    (measured: 1.15 s, docs/performance.md) and writes nothing.
    """
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

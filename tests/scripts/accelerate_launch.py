"""accelerate's own launcher (``accelerate.commands.launch.main``: what ``accelerate launch`` and ``python -m
accelerate.commands.launch`` run), ending without the interpreter's teardown once it has returned.

The tests' launches (``helpers.launch_command``) go through it: a launcher process that imported torch and accelerate
spends about 0.55 s of CPU freeing them at exit, after its ranks are done, at every launch (docs/testing.md). What it
prints and its exit code are accelerate's: a ``SystemExit`` keeps its code, an exception is printed by Python's own
hook and exits 1, as an uncaught one does. From the test process's main thread, ``helpers.popen`` runs ``_run`` in a
fork of the test process, which imported torch and accelerate already, instead of a new interpreter (1.2-1.4 s a
launch: docs/testing.md). Tests that check the launcher module itself (test_multinode.py, test_reliability.py's lost
launcher, ``toolkit verify``) run ``python -m accelerate.commands.launch`` in an interpreter of its own.

Usage: accelerate_launch.py <accelerate launch arguments>
"""

import os
import sys

from accelerate.commands.launch import main


def _run() -> int:
    try:
        main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


if __name__ == "__main__":
    code = _run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

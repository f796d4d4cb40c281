"""The real recipe (recipes/gpt2.py) with one test hook for elastic restarts: on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0), rank 1 kills itself with SIGKILL at the end of optimizer step
``TOOLKIT_TEST_KILL_AT_STEP`` (default 2; before that step's checkpoint is saved), as a crashed machine would.
torch elastic then restarts every rank (``--max_restarts``), and the restart resumes on its own (toolkit.config).
"""

import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipes"))
import gpt2  # noqa: E402  the recipe itself, unchanged

KILL_AT_STEP = int(os.environ.get("TOOLKIT_TEST_KILL_AT_STEP", "2"))


class KillRankOnce:
    def on_step_end(self, accelerator, state, row):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and accelerator.process_index == 1 and state.step == KILL_AT_STEP:
            print(f"elastic_run: rank 1 kills itself after step {state.step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from toolkit.cli import cli

    cli(lambda: gpt2.main(callbacks=[KillRankOnce()]))

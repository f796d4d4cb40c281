"""Several runs of the real recipe (tests/scripts/probe_run.py: recipes/gpt2.py with its probes) one after another in
the same ranks, so that they pay for one process start (imports, the process group: ~5-10 s a launch) between them.

Usage: probe_runs.py RUNS_JSON. RUNS_JSON is a list of {"argv": the recipe's command line, "copy_from": null or
[run_dir, step, output_dir], "recipe": "gpt2" (default), "sft", "classify" or "dpo" (recipes/<recipe>.py's ``main``),
"probe": true (default: probe_run.py's callbacks, gpt2 only) or false}. A run with ``copy_from`` starts from a copy of
``run_dir``'s ``checkpoints/step-<step>`` in its output_dir (made by the main process, after the run it comes from,
before anyone parses the config).

Between runs: the process group is kept (``accelerator.end_training`` would destroy it; the toolkit's exit handler
destroys it at the end), accelerate's per-run state (``AcceleratorState``, ``GradientState``) is reset, and every rank
waits for every other at a barrier, as a fresh launch would at its process group's start. Each run builds its own
Accelerator, seed, data, model and optimizer from its own config exactly as a fresh process does. The first run that
fails ends the launch (as a lone launch would: its exit code, its message).

A run still going after its ``"timeout"`` seconds (default RUN_TIMEOUT_S; these runs take seconds) hangs, e.g. in a
collective another rank never joins: ``faulthandler`` prints every thread's stack ("Timeout (h:mm:ss)!" and where each
rank waits) and exits the rank with status 1, so the launch fails there instead of waiting for the test's timeout.
"""

import faulthandler
import gc
import importlib
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
import probe_run  # noqa: E402  the recipe and its probes
import torch.distributed as dist  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402

from toolkit.cli.recipe import cli  # noqa: E402

RUN_TIMEOUT_S = 300


def _run_all(runs: list[dict]) -> None:
    destroy = PartialState.destroy_process_group
    PartialState.destroy_process_group = lambda self, group=None: None  # kept for the next run
    try:
        for i, run in enumerate(runs):
            if i:
                AcceleratorState._reset_state(reset_partial_state=False)
                GradientState._reset_state()
                gc.collect()
            # What is alive now lives as long as the process (the modules, and those a recipe's main imported in the
            # first run): out of the collector's sight, the collection above and the automatic ones during a run
            # walk only what runs made (0.22 s a collection otherwise, measured).
            gc.freeze()
            main = int(os.environ.get("RANK", "0")) == 0
            if run.get("copy_from"):
                src, step, out = run["copy_from"]
                name = os.path.join("checkpoints", f"step-{step}")
                if main:
                    shutil.copytree(os.path.join(src, name), os.path.join(out, name))
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            sys.argv = [sys.argv[0], *run["argv"]]
            recipe = importlib.import_module(run.get("recipe", "gpt2"))  # recipes/ is on the path (probe_run.py)
            probe = probe_run.Probe() if run.get("probe", True) else None
            faulthandler.dump_traceback_later(run.get("timeout") or RUN_TIMEOUT_S, exit=True)
            try:
                recipe.main(callbacks=[probe] if probe else None)
                if probe:
                    probe.after_train()
            finally:
                faulthandler.cancel_dump_traceback_later()
    finally:
        PartialState.destroy_process_group = destroy


if __name__ == "__main__":
    runs = json.load(open(sys.argv[1]))
    cli(lambda: _run_all(runs))

"""Several runs of the real recipe (tests/scripts/probe_run.py: recipes/gpt2.py with its probes) one after another in
the same ranks, so that they pay for one process start (imports, the process group: ~5-10 s a launch) between them.

Usage: probe_runs.py RUNS_JSON. RUNS_JSON is a list of {"argv": the recipe's command line, "copy_from": null or
[run_dir, step, output_dir], "recipe": "gpt2" (default), "sft", "classify" or "dpo" (recipes/<recipe>.py's ``main``),
"probe": true (default: probe_run.py's callbacks, gpt2 only) or false, and the options (helpers.RUN_OPTIONS):
"env" (variables set for this run only, null: unset: the launcher's environment beyond the launch config's, e.g.
bf16 mixed precision, or another launch config's of the same distributed type: helpers.CONFIG_VARIANTS), "sigterm_at" (SIGTERM to rank 0 after that step, as a scheduler signals one process: every rank ends
the next step, saves it and stops), "watchdog_s" (a run still going after that many seconds ends the launch, exit
124, its output_dir's ``watchdog.txt`` saying so: a hang fails its cell instead of the session), "keep_going" (an
exception of this run is written to its output_dir's ``error_rank<R>.txt`` and, if every rank raised, the next run
starts; a rank the others left waiting ends the launch within 30 s)}. A run with ``copy_from`` starts from a copy of
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
import signal
import sys
import threading
import time
import traceback

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
                _forget_compiled_graphs(run, runs[i - 1])
                gc.collect()
            # What is alive now lives as long as the process (the modules, and those a recipe's main imported in the
            # first run): out of the collector's sight, the collection above and the automatic ones during a run
            # walk only what runs made (0.22 s a collection otherwise, measured).
            gc.freeze()
            main = int(os.environ.get("RANK", "0")) == 0
            if run.get("copy_from"):
                src, step, out = run["copy_from"]
                name = os.path.join("checkpoints", f"step-{step}")
                # a source that failed left no checkpoint: this run starts without one (and fails on its own)
                if main and (os.path.isdir(os.path.join(src, name)) or not run.get("keep_going")):
                    shutil.copytree(os.path.join(src, name), os.path.join(out, name))
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            started = time.time()
            _one_run(run)
            _log_run(run, time.time() - started)
    finally:
        PartialState.destroy_process_group = destroy


def _inductor(run: dict) -> bool:
    argv = " ".join(run["argv"])
    return "--torch_compile true" in argv and "aot_eager" not in argv


def _forget_compiled_graphs(run: dict, previous: dict) -> None:
    """An inductor run (torch_compile without aot_eager) compiles as in a process of its own: dynamo's graphs, shape
    history and counters are per process, and a batch's earlier aot_eager run otherwise left graphs and shapes that
    the inductor run reused, so it did not compile (nor put in its cache folder) every graph it would alone, and its
    log's counts summed over the runs (issue 50, measured: 2 misses in the one-process run that read that cache).
    The run after an inductor run starts without its graphs too (an aot_eager run must not find inductor's code).
    Other runs keep what earlier runs compiled (an aot_eager resume reuses its source run's graphs: 0.7 s, not 20)."""
    if "torch._dynamo" in sys.modules and (_inductor(run) or _inductor(previous)):
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()


def _log_run(run: dict, seconds: float) -> None:
    """With ``TOOLKIT_TEST_LAUNCH_LOG`` set (helpers.log_launches), rank 0 appends each run's own wall time to
    ``<log>.runs``: a launch of several runs is one line of the launch log, and the suite's time is cut run by run."""
    log = os.environ.get("TOOLKIT_TEST_LAUNCH_LOG")
    if log and int(os.environ.get("RANK", "0")) == 0:
        with open(log + ".runs", "a") as f:
            f.write(json.dumps({"out": _output_dir(run), "recipe": run.get("recipe", "gpt2"),
                                "world": int(os.environ.get("WORLD_SIZE", "1")), "seconds": round(seconds, 2),
                                "argv": " ".join(run["argv"])[:400]}) + "\n")


def _one_run(run: dict) -> None:
    sys.argv = [sys.argv[0], *run["argv"]]
    recipe = importlib.import_module(run.get("recipe", "gpt2"))  # recipes/ is on the path (probe_run.py)
    probe = probe_run.Probe() if run.get("probe", True) else None
    callbacks = [probe] if probe else []
    if run.get("sigterm_at"):
        callbacks.append(SigtermAt(run["sigterm_at"]))
    saved = dict(os.environ)
    for name, value in (run.get("env") or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    watchdog = run.get("watchdog_s") and threading.Timer(run["watchdog_s"], _watchdog_fired, (run,))
    if watchdog:
        watchdog.daemon = True
        watchdog.start()
    faulthandler.dump_traceback_later(run.get("timeout") or RUN_TIMEOUT_S, exit=True)
    try:
        recipe.main(callbacks=callbacks or None)
        if probe:
            probe.after_train()
    except Exception:
        if not run.get("keep_going"):
            raise
        traceback.print_exc()
        out = _output_dir(run)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"error_rank{os.environ.get('RANK', '0')}.txt"), "w") as f:
            f.write(traceback.format_exc())
        _together_or_exit()
    finally:
        faulthandler.cancel_dump_traceback_later()
        if watchdog:
            watchdog.cancel()
        os.environ.clear()
        os.environ.update(saved)


def _together_or_exit(seconds: float = 30) -> None:
    """After a run that raised: the next run starts only if every rank raised too (all meet here); a rank the others
    left in a collective of that run never comes, so after ``seconds`` this rank exits 1 and the launcher ends the
    launch at once, instead of at the watchdog."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    timer = threading.Timer(seconds, os._exit, (1,))
    timer.daemon = True
    timer.start()
    dist.barrier()
    timer.cancel()


def _output_dir(run: dict) -> str:
    return run["argv"][run["argv"].index("--output_dir") + 1]


def _watchdog_fired(run: dict) -> None:
    out = _output_dir(run)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "watchdog.txt"), "a") as f:
        f.write(f"rank {os.environ.get('RANK', '0')}: still running after {run['watchdog_s']} s\n")
    print(f"watchdog: {out} still running after {run['watchdog_s']} s; ending the launch", file=sys.stderr,
          flush=True)
    os._exit(124)


class SigtermAt:
    """SIGTERM to this process after ``step`` on rank 0 only: the preemption flag travels with the next step's counts
    (toolkit.training.preemption), so every rank ends step + 1, saves it and stops."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, accelerator, state, row):
        if state.step == self.step and accelerator.is_main_process:
            os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    runs = json.load(open(sys.argv[1]))
    cli(lambda: _run_all(runs))

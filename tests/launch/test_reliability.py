"""Real failures: a SIGTERM (what SLURM and cloud schedulers send) and bad numbers, with real signals and real runs.

- SIGTERM to the launcher mid-run: every rank finishes its optimizer step, a checkpoint is saved, the job exits 0;
  the relaunch with ``resume_from_checkpoint: latest`` ends with the weights of the uninterrupted run.
- A non-finite gradient norm stops the run naming the step, before the optimizer applies it, keeping the last good
  checkpoint; with ``skip_nonfinite_steps`` the step is skipped instead and counted in the metrics.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    ROOT,
    Interrupted,
    Killed,
    Runs,
    args_from,
    descendants,
    kill_job,
    launch,
    load_weights,
    max_abs_diff,
    popen,
    read_probes,
    subprocess_env,
    wait_until_gone,
)
from helpers import saving_checkpoints as _saving
from helpers import steps_logged as _steps_logged

COMMON = dict(packing=False, block_size=48, shuffle=True, logging_steps=1, seed=7, report_to="none",
              per_device_eval_batch_size=3, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              lr_scheduler_type="constant", weight_decay=0, per_device_train_batch_size=2,
              gradient_accumulation_steps=2)


# The uninterrupted runs the tests below compare with (recipes/gpt2.py, 2 ranks x 2 x 2), planned: those under one
# launch config share a launch (helpers.Runs.plan). So do the SIGKILL tests' relaunches (helpers.Killed): no launch
# of their own.
# 24 steps of a 6-step epoch: the signal (sent once 3 steps are logged) lands mid-run, and the resume crosses epoch
# boundaries. The stop comes within about 2 steps of the signal; 60 steps only made three runs longer.
SIGTERM_STRAIGHT = {"max_steps": 24}
SIGTERM_STEPS = SIGTERM_STRAIGHT["max_steps"]
SIGKILL = {"max_steps": 9, "save_steps": 1, "save_total_limit": 2}
SIGKILL_CONFIGS = ["ddp.yaml", "zero3.yaml", "fsdp.yaml"]
ASYNC_CONFIGS = ["ddp.yaml", "fsdp.yaml"]  # async_save: DDP and FSDP2 (refused elsewhere: tests/unit/test_config.py)
# SIGKILLed mid-write under FSDP2 only: the same AsyncSaves and DCP write under DDP, where a kill costs one more launch
# of its own (about 7 s of the suite) to show the same `latest` rule
ASYNC_KILLED = ["fsdp.yaml"]
NONFINITE = {"max_steps": 12, "save_steps": 1, "learning_rate": 1e20}  # SGD at lr 1e20 blows the weights up
SKIPPED = {**NONFINITE, "skip_nonfinite_steps": True, "save_steps": 12}
STREAM = {"streaming": True, "shuffle_buffer_size": 12, "packing": True}
OVERWRITTEN = {"max_steps": 2, "save_steps": 1}  # the earlier run of the overwrite test, one process x 8


def plan_runs(pool, tmp_path_factory, tiny_model, padded_data, text_shards):
    """Planned (conftest's run_pool): they join the session's 2-rank DDP launch, and the overwrite test's earlier run
    the one-process launch (run beside tests/unit). Each interrupted run (``Killed``, ``Preempted``, ``LauncherLost``)
    is interrupted right before its launch config's batch launches, and its relaunch and the uninterrupted run it is
    compared with run in that batch."""
    r = Runs(tmp_path_factory.mktemp("reliability"), tiny_model, padded_data, COMMON, pool=pool)
    r.plan("sigterm_straight", "ddp.yaml", 2, 2, 2, SIGTERM_STRAIGHT, probe=False)
    r.plan("preempted", "ddp.yaml", 2, 2, 2, SIGTERM_STRAIGHT, probe=False, interrupted=Preempted())
    r.plan("launcher_lost", "ddp.yaml", 2, 2, 2, SIGTERM_STRAIGHT, probe=False, interrupted=LauncherLost())
    r.plan("nonfinite_skipped", "ddp.yaml", 2, 2, 2, SKIPPED, probe=False)
    r.plan("nonfinite_skipped_fsdp", "fsdp.yaml", 2, 2, 2, SKIPPED, probe=False)  # the norm over shards: both ranks
    r.plan("overwritten", None, 1, 8, 1, OVERWRITTEN, probe=False)
    for config in SIGKILL_CONFIGS:  # the resume crosses the epoch's end (6 steps)
        r.plan(f"killed_{config}", config, 2, 2, 2, SIGKILL, probe=False, interrupted=Killed(before_step=6, config=config))
        r.plan(f"straight_{config}", config, 2, 2, 2, SIGKILL, probe=False)
    for config in ASYNC_CONFIGS:  # the same runs with async_save: a checkpoint written in the background every step
        if config in ASYNC_KILLED:
            r.plan(f"killed_async_{config}", config, 2, 2, 2, {**SIGKILL, "async_save": True}, probe=False,
                   interrupted=Killed(before_step=6, config=config))
        r.plan(f"straight_async_{config}", config, 2, 2, 2, {**SIGKILL, "async_save": True})  # on_save probed
    # the stream: killed on 2 ranks x 2 x 2, resumed on 1 process x 8 (the one-process launch after the 2-rank one)
    stream = Runs(tmp_path_factory.mktemp("reliability-stream"), tiny_model, text_shards, COMMON, pool=pool)
    for name, killed in (("killed", Killed(before_step=SIGKILL["max_steps"] - 1, micro=2, accum=2)), ("straight", None)):
        stream.plan(name, "ddp.yaml", 1, 8, 1, {**SIGKILL, **STREAM}, probe=False, interrupted=killed)
    return {"runs": r, "stream_runs": stream}


@pytest.fixture(scope="module")
def runs(run_pool):
    return run_pool.modules[(__name__, "runs")]


@pytest.fixture(scope="module")
def stream_runs(run_pool):
    return run_pool.modules[(__name__, "stream_runs")]


def _signal_after_3_steps(cmd: list[str], out: str) -> tuple[str, int]:
    """Start ``cmd``, send it SIGTERM once 3 steps are logged, return its output and exit code (bounded in time)."""
    proc = popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while len(_steps_logged(out)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be signalled"
    proc.send_signal(signal.SIGTERM)  # as a scheduler does
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return output, proc.returncode


@pytest.mark.slow
def test_sigterm_to_a_plain_process_saves_and_exits_zero(tmp_path, tiny_model, padded_data):
    out = str(tmp_path / "single")
    cfg = {**COMMON, **padded_data, "model_name_or_path": tiny_model, "max_steps": 200,
           "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "output_dir": out}
    output, returncode = _signal_after_3_steps([sys.executable, os.path.join(ROOT, "recipes", "gpt2.py"),
                                                *args_from(cfg)], out)
    assert returncode == 0, output[-4000:]
    stopped = max(_steps_logged(out))
    assert f"SIGTERM: saved checkpoint step-{stopped}" in output and stopped < 200
    assert open(os.path.join(out, "checkpoints", "latest")).read() == f"step-{stopped}"


def _interrupted_state(hook, out: str) -> None:
    """What the interrupted run left, read before its relaunch continues it: the last step logged, ``latest``,
    whether ``final/`` exists, the summary."""
    hook.stopped = max(_steps_logged(out))
    hook.latest = open(os.path.join(out, "checkpoints", "latest")).read()
    hook.final = os.path.exists(os.path.join(out, "final"))
    summary = os.path.join(out, "summary.json")
    hook.summary = json.load(open(summary)) if os.path.isfile(summary) else None


class Preempted(Interrupted):
    """The 2-rank DDP launch SIGTERMed once 3 steps are logged, as a scheduler does: its output, exit code and what
    it left."""

    def __call__(self, out: str) -> None:
        self.output, self.returncode = _signal_after_3_steps(self.launcher(), out)
        _interrupted_state(self, out)


class LauncherLost(Interrupted):
    """The launcher SIGKILLed alone once 3 steps are logged (no signal reaches the ranks: torch elastic gives each a
    session of its own): what the orphaned ranks printed, whether they were gone within 30 s, what they left."""

    def launcher(self) -> list[str]:
        """``python -m accelerate.commands.launch``: the launcher module itself, in an interpreter of its own."""
        cmd = super().launcher()
        return [cmd[0], "-m", "accelerate.commands.launch", *cmd[2:]]

    def __call__(self, out: str) -> None:
        proc = subprocess.Popen(self.launcher(), cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        ranks: list[int] = []
        try:
            deadline = time.time() + 120
            while len(_steps_logged(out)) < 3 and time.time() < deadline and proc.poll() is None:
                time.sleep(0.05)
            ranks = descendants(proc.pid)
            assert proc.poll() is None and len(ranks) >= 2, "the run ended before its launcher could be killed"
            proc.kill()
            self.output, _ = proc.communicate(timeout=120)  # the ranks hold the pipe: EOF once both have closed it
            self.ranks_gone = wait_until_gone(ranks, timeout=30)
        finally:
            for pid in ranks:  # never leave an orphan training behind a failed assertion
                kill_job(pid)
        _interrupted_state(self, out)


@pytest.mark.slow
def test_sigterm_or_a_lost_launcher_checkpoints_and_resumes_exactly(runs):
    """SIGTERM to the launcher mid-run, and the launcher SIGKILLed alone, each once 3 steps are logged (made right
    before the shared DDP launch: ``Preempted``, ``LauncherLost``); each relaunch with ``resume_from_checkpoint:
    latest``, in that launch, ends with the uninterrupted run's weights."""
    straight = runs.get_planned("sigterm_straight")
    out, lost = runs.get_planned("preempted"), runs.get_planned("launcher_lost")
    preempted, launcher_lost = runs.interrupted["preempted"], runs.interrupted["launcher_lost"]
    # torch elastic forwards SIGTERM to the ranks (which save and exit 0) and then exits 128 + SIGTERM itself: the
    # convention schedulers requeue on.
    assert preempted.returncode == 128 + signal.SIGTERM, preempted.output[-4000:]
    stopped = preempted.stopped
    print(f"SIGTERM once 3 steps were logged: stopped after step {stopped} of {SIGTERM_STEPS}")
    assert 3 <= stopped < SIGTERM_STEPS
    assert f"SIGTERM: saved checkpoint step-{stopped}" in preempted.output
    assert preempted.latest == f"step-{stopped}"
    assert not preempted.final, "a preempted run is not finished"
    summary = preempted.summary
    assert (summary["ended"], summary["steps"], summary["final_model"]) == ("preempted", stopped, None)

    # The orphaned ranks see their parent change, finish the step, save and exit, instead of training on into
    # output_dir.
    assert launcher_lost.ranks_gone, "a rank outlived its launcher"
    stopped = launcher_lost.stopped
    print(f"launcher killed once 3 steps were logged: stopped after step {stopped} of {SIGTERM_STEPS}")
    assert 3 <= stopped < SIGTERM_STEPS
    assert f"launcher gone: saved checkpoint step-{stopped}" in launcher_lost.output, launcher_lost.output[-4000:]
    assert launcher_lost.latest == f"step-{stopped}" and not launcher_lost.final

    assert max_abs_diff(load_weights(os.path.join(out, "final")), load_weights(os.path.join(straight, "final"))) <= 1e-6
    assert _steps_logged(out) == list(range(1, SIGTERM_STEPS + 1))
    assert max_abs_diff(load_weights(os.path.join(lost, "final")), load_weights(os.path.join(straight, "final"))) <= 1e-6


@pytest.mark.slow
def test_nonfinite_gradient_stops_naming_the_step_and_keeps_the_last_good_checkpoint(runs, tmp_path, tiny_model,
                                                                                    padded_data):
    # SGD at lr 1e20 blows the weights up: a few steps later the gradient norm is inf or nan.
    cfg = {**COMMON, **padded_data, "model_name_or_path": tiny_model, **NONFINITE}
    out = str(tmp_path / "blowup")
    proc = launch(args_from({**cfg, "output_dir": out}), check=False)
    assert proc.returncode != 0
    message = next(line for line in proc.stderr.splitlines() if "non-finite gradient norm" in line)
    assert message.startswith("training stopped: non-finite gradient norm")
    bad_step = int(re.search(r"at step (\d+)", message).group(1))
    assert 1 <= bad_step <= 12
    assert open(os.path.join(out, "checkpoints", "latest")).read() == f"step-{bad_step - 1}" or bad_step == 1
    assert not os.path.exists(os.path.join(out, "checkpoints", f"step-{bad_step}"))
    assert not os.path.exists(os.path.join(out, "final"))
    summary = json.load(open(os.path.join(out, "summary.json")))  # written by both ranks' end, before exit 1
    assert summary["ended"] == "stopped" and summary["steps"] == bad_step - 1 and summary["final_model"] is None
    assert summary["stop_reason"] == message[len("training stopped: "):] and summary["world_size"] == 2

    for config, name in (("ddp.yaml", "nonfinite_skipped"), ("fsdp.yaml", "nonfinite_skipped_fsdp")):
        # skip_nonfinite_steps, save_steps 12; FSDP2: a shard's inf or nan reaches both ranks' norm (toolkit.parallel.clipping),
        # so both skip the same steps and the run ends (a rank that stepped alone would hang the other)
        skipped = runs.get(name, config, 2, 2, 2, SKIPPED)
        rows = [json.loads(line) for line in open(os.path.join(skipped, "metrics.jsonl")) if '"loss"' in line]
        assert [r["step"] for r in rows] == list(range(1, 13))
        assert rows[-1]["skipped_steps"] >= 12 - bad_step + 1 > 0
        final = load_weights(os.path.join(skipped, "final"))
        assert all(bool(t.isfinite().all()) for t in final.values()), "skipped steps must never reach the weights"



def _tree(folder: str) -> dict:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


@pytest.mark.slow
def test_overwrite_moves_the_earlier_run_aside_and_writes_final_atomically(runs, tmp_path, tiny_model, padded_data):
    """overwrite_output_dir once left the earlier run's checkpoints/ and latest in place (a new run that died before
    its first save then "resumed" the old one): they are moved to replaced-<time>/, byte for byte. A killed save's
    leftovers (step-N.tmp, final.tmp) are removed, and final/ appears only complete (written as final.tmp, renamed).
    The earlier run is planned (one process, in the pool's one-process launch) and copied here."""
    out = tmp_path / "run"
    cfg = {**COMMON, **padded_data, "model_name_or_path": tiny_model, **OVERWRITTEN,
           "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "output_dir": str(out)}
    shutil.copytree(runs.get("overwritten", None, 1, 8, 1, OVERWRITTEN), out)
    earlier = _tree(str(out))
    assert "checkpoints/step-2/toolkit_state.json" in earlier and "final/model.safetensors" in earlier
    (out / "checkpoints" / "step-3.tmp").mkdir()  # what a save killed mid-way leaves
    (out / "final.tmp").mkdir()

    proc = launch(args_from({**cfg, "max_steps": 1, "overwrite_output_dir": True}), num_processes=1)
    aside = [p for p in os.listdir(out) if p.startswith("replaced-")]
    assert len(aside) == 1 and f"moved to {out / aside[0]}" in proc.stdout
    moved = _tree(str(out / aside[0]))
    assert moved == {k: v for k, v in earlier.items()}, "the earlier run must be moved intact"
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-1"]  # only the new run's own
    assert not (out / "final.tmp").exists() and (out / "final" / "model.safetensors").is_file()
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl") if '"loss"' in line] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("config", SIGKILL_CONFIGS)
def test_sigkill_anywhere_then_resume_is_bit_identical(runs, config):
    """SIGKILL to the whole job (launcher and ranks, frozen first so that none runs on) once a few steps are logged and
    a checkpoint save is under way (its ``step-N.tmp`` exists: the kill lands inside ``save_state``). The previous
    checkpoint and ``latest`` stay loadable; the relaunch from `latest` clears the leftover, crosses an epoch boundary
    (6 steps per epoch) and ends with exactly the weights of the uninterrupted run."""
    out, straight = runs.get_planned(f"killed_{config}"), runs.get_planned(f"straight_{config}")
    killed = runs.interrupted[f"killed_{config}"]
    assert killed.left and not _saving(out), "the relaunch removes what the killed save left"
    diff = max_abs_diff(load_weights(os.path.join(out, "final")), load_weights(os.path.join(straight, "final")))
    print(f"{config}: killed after step {killed.at}, resumed: max|dw| = {diff:.1e}")
    assert diff == 0.0
    assert _steps_logged(out) == list(range(1, 10))


@pytest.mark.slow
@pytest.mark.parametrize("config", ASYNC_CONFIGS)
def test_async_save_changes_nothing_and_a_kill_mid_write_resumes_exactly(runs, config):
    """async_save: true (toolkit.checkpointing.checkpoint.AsyncSaves), a checkpoint every step written while the next
    steps train: the run ends with exactly the weights of the run with synchronous saves, and its last checkpoints
    are complete (latest names the newest, written by DCP). SIGKILLed (FSDP2) while a write is under way (its step-N.tmp
    exists: the background thread is writing it), the previous checkpoint is latest; the relaunch from it (an
    async checkpoint, loaded by DCP) clears the leftover and ends with exactly the synchronous run's weights."""
    straight, quick = runs.get_planned(f"straight_{config}"), runs.get_planned(f"straight_async_{config}")
    diff = max_abs_diff(load_weights(os.path.join(quick, "final")), load_weights(os.path.join(straight, "final")))
    assert diff == 0.0, diff
    latest = open(os.path.join(quick, "checkpoints", "latest")).read()
    assert latest == "step-9" and sorted(os.listdir(os.path.join(quick, "checkpoints"))) == ["latest", "step-8",
                                                                                              "step-9"]
    assert os.path.isdir(os.path.join(quick, "checkpoints", latest, "model_optimizer_dcp")) and not _saving(quick)
    # the loop's on_save, once per checkpoint on every rank, once its write completed (latest names it on rank 0),
    # with the state it holds
    ranks = read_probes(quick)
    assert [s[:2] for s in ranks[0]["saves"]] == [s[:2] for s in ranks[1]["saves"]] == [
        [step, f"step-{step}"] for step in range(1, 10)]
    assert [s[2] for s in ranks[0]["saves"]] == [f"step-{step}" for step in range(1, 10)]
    if config not in ASYNC_KILLED:
        return
    out, killed = runs.get_planned(f"killed_async_{config}"), runs.interrupted[f"killed_async_{config}"]
    assert killed.left and not _saving(out), "the relaunch removes what the killed write left"
    diff = max_abs_diff(load_weights(os.path.join(out, "final")), load_weights(os.path.join(straight, "final")))
    print(f"{config} async_save: killed after step {killed.at} inside {killed.left}, resumed: max|dw| = {diff:.1e}")
    assert diff == 0.0
    assert _steps_logged(out) == list(range(1, 10))


@pytest.mark.slow
def test_a_stream_sigkilled_mid_run_resumes_on_one_process_in_the_same_order(stream_runs):
    """streaming: true (recipes/gpt2.py, 4 files, windows of 12 rows, bfd packing): 2 ranks x 2 x 2 SIGKILLed inside a
    save from step 3 on, relaunched on 1 process x 8 from ``latest``: the source restarts at the checkpoint's window
    and the run takes exactly the rows of the uninterrupted 1-process run (the same tokens at every step) and ends
    with its weights (SGD: 1e-6; another world size sums in another order, so not bit for bit)."""
    out, straight = stream_runs.get_planned("killed"), stream_runs.get_planned("straight")
    killed = stream_runs.interrupted["killed"]
    assert killed.left and not _saving(out), "the relaunch removes what the killed save left"
    tokens = {run: [(r["step"], r["tokens_seen"]) for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))
                    if "loss" in r] for run in (out, straight)}
    assert tokens[out] == tokens[straight] and len(tokens[out]) == SIGKILL["max_steps"]
    diff = max_abs_diff(load_weights(os.path.join(out, "final")), load_weights(os.path.join(straight, "final")))
    print(f"stream: killed after step {killed.at}, resumed on 1 process: max|dw| = {diff:.1e}")
    assert diff <= 1e-6, diff

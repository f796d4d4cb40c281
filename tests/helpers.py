"""Helpers shared by the tests (imported as ``helpers``; fixtures live in conftest.py, which imports this too).

Every multi-process test goes through ``accelerate launch`` with real gloo ranks; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "gpt2.py")
CONFIGS = os.path.join(ROOT, "accelerate_configs")
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
sys.path.insert(0, SCRIPTS)  # the probes (probe_run.PROBE_IDS) are imported by tests


LAUNCH_LOG_ENV = "TOOLKIT_TEST_LAUNCH_LOG"


def log_launches(path: str) -> None:
    """Append one JSON line to ``path`` for every subprocess that ends from now on (this process's ``subprocess.Popen``
    replaced by a subclass): the test that started it (``PYTEST_CURRENT_TEST``), the command, its wall time and exit
    code. conftest.py turns it on when ``TOOLKIT_TEST_LAUNCH_LOG`` names a file; tests/scripts/launch_log.py sums it per
    test file."""
    base = subprocess.Popen
    if getattr(base, "_toolkit_logged", False):
        return

    class LoggedPopen(base):
        _toolkit_logged = True

        def __init__(self, args, *a, **kw):
            self._log_started, self._log_done = time.time(), False
            self._log_cpu = _children_cpu()
            prefetched = threading.current_thread().name.startswith("prefetch")  # RunPool.prefetch's thread
            self._log_test = "(prefetched)" if prefetched else os.environ.get("PYTEST_CURRENT_TEST", "")
            super().__init__(args, *a, **kw)

        def _log_end(self) -> None:
            if self._log_done or self.returncode is None:
                return
            self._log_done = True
            cmd = self.args if isinstance(self.args, (list, tuple)) else [str(self.args)]
            line = {"test": self._log_test, "cmd": " ".join(map(str, cmd))[:600], "rc": self.returncode,
                    "seconds": round(time.time() - self._log_started, 2), "ended": round(time.time(), 2),
                    # CPU of every finished process below this one (ranks included) meanwhile: less noisy than the
                    # wall time on a shared machine; overlapping launches (multinode) count each other's
                    "cpu_seconds": round(_children_cpu() - self._log_cpu, 2)}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

        def wait(self, timeout=None):
            rc = super().wait(timeout)
            self._log_end()
            return rc

        def poll(self):
            rc = super().poll()
            self._log_end()
            return rc

    subprocess.Popen = LoggedPopen


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def subprocess_env() -> dict:
    """The environment of every subprocess a test starts: offline, one thread per rank, the repo importable."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        # 2 ranks on 2 cores: one thread each, or they fight over the cores.
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "recipes"), env.get("PYTHONPATH", "")]),
    )
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), from /proc. torch elastic starts each rank in a session of
    its own, so a process-group kill of the launcher never reaches them: a test that kills "the job" must find them."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def alive(pid: int) -> bool:
    """Running or stopped (a zombie has finished: nobody may reap it in a container whose init does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until_gone(pids: list[int], timeout: float) -> bool:
    """True once none of ``pids`` is alive (bounded: False after ``timeout`` seconds)."""
    deadline = time.time() + timeout
    while any(alive(p) for p in pids):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def kill_job(pid: int) -> None:
    """SIGKILL a launcher and every process below it as one event, as a node failure does: first each is frozen
    (SIGSTOP, repeated until no new process appears), then all are killed; no rank runs a line after the freeze."""
    frozen: list[int] = []
    while new := [p for p in [pid, *descendants(pid)] if p not in frozen]:
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        frozen += new
    for p in frozen:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# Held by whichever thread of the test process starts subprocesses (a test, or RunPool.prefetch's thread): one launch
# (or run_all's group) at a time, so a test's launch never shares the two cores with a prefetched one; a test that
# needs no subprocess runs on meanwhile.
LAUNCHING = threading.RLock()


def run(cmd: list[str], check: bool = True, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``env``: variables set for this command on top of ``subprocess_env()``."""
    with LAUNCHING:
        proc = _run(cmd, timeout, env)
    if check and proc.returncode != 0:
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def _run(cmd: list[str], timeout: int, env: dict | None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` through ``popen``."""
    with popen(cmd, cwd=ROOT, env={**subprocess_env(), **(env or {})}, stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            e.output, e.stderr = proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


# ------------------------------------------------------------------ the launcher, forked from the test process
WRAPPER = os.path.join(SCRIPTS, "accelerate_launch.py")
FORK_LAUNCHER_ENV = "TOOLKIT_TEST_FORK_LAUNCHER"  # "0": every launcher a new interpreter, as before
_POPEN = subprocess.Popen  # the class before log_launches replaces it: a forked launcher's own subprocesses use it
_FORKED: dict[type, type] = {}


def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)``; where ``cmd`` is tests/scripts/accelerate_launch.py's (``launch_command``)
    and this is the main thread, the launcher process is a fork of this one instead of a new interpreter.

    Why: a launcher imports torch and accelerate before it starts a rank (1.9 s of one core, measured; the ranks and
    what they run are the same either way), about 40 times a suite. The test process imported them already: a fork
    of it runs accelerate's own ``main()`` at once, as the new interpreter would after its imports (``_launcher``
    below gives it the interpreter's state that matters: its descriptors, folder, environment, arguments, signals,
    logging and warnings). Only from the main thread: a fork copies one thread, and another thread of ours (the
    prefetch, ``run_all``'s workers) may hold a lock the copy would then wait on forever."""
    fork = (len(cmd) > 1 and cmd[1] == WRAPPER and threading.current_thread() is threading.main_thread()
            and os.environ.get(FORK_LAUNCHER_ENV, "1") != "0")
    if not fork:
        return subprocess.Popen(cmd, **kwargs)
    import accelerate.commands.launch  # noqa: F401  (imported once, here; every fork finds it)
    import accelerate_launch  # noqa: F401  (tests/scripts)
    import torch.distributed.run  # noqa: F401

    base = subprocess.Popen  # LoggedPopen where the launch log is on: the fork is logged as the process was
    if base not in _FORKED:
        _FORKED[base] = type("ForkedLauncher", (_ForkedLauncher, base), {})
    return _FORKED[base](cmd, **kwargs)


class _ForkedLauncher:
    """``subprocess.Popen`` whose child is a fork running tests/scripts/accelerate_launch.py's ``_run`` (the parent's
    side, pipes, ``wait``, ``kill``, ``communicate``, is Popen's own)."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids,
                       uid, umask, start_new_session, process_group):
        pid = os.fork()
        if pid == 0:  # never returns: whatever happens, this copy of the test process ends here
            code = 1
            try:
                code = _launcher(list(args), cwd, env, (p2cread, c2pwrite, errwrite), pass_fds, start_new_session)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _launcher(args: list[str], cwd, env, fds: tuple[int, int, int], pass_fds, new_session: bool) -> int:
    """In the fork: what a new interpreter running ``args`` would start with, then accelerate's launcher."""
    import faulthandler
    import gc
    import io
    import logging
    import warnings

    gc.freeze()  # the test process's objects: never collected here, so their pages are never copied
    faulthandler.disable()  # pytest's, on a descriptor closed below
    if new_session:
        os.setsid()
    for fd, target in zip(fds, (0, 1, 2)):  # Popen's -1: inherited, as exec would
        if fd != -1 and fd != target:
            os.dup2(fd, target)
    low = 3  # close_fds (but pass_fds): no copy of another pipe's end keeps its reader from EOF
    for fd in sorted({*pass_fds, 1 << 16}):
        os.closerange(low, fd)
        low = fd + 1
    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    # PYTHONUNBUFFERED=1 (subprocess_env): written through, as the interpreter would
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                   errors="backslashreplace")
    faulthandler.enable()  # on the new stderr
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for module in list(sys.modules.values()):  # the ranks: not lines of the launch log (torch elastic's handler
        if getattr(getattr(module, "__dict__", {}).get("Popen"), "_toolkit_logged", False):  # bound Popen at import)
            module.Popen = _POPEN
    root = logging.getLogger()  # pytest's capture handlers: an interpreter's root logger has none
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for logger in [root, *logging.Logger.manager.loggerDict.values()]:  # torch's own handlers ("torch", dynamo's...)
        for handler in getattr(logger, "handlers", ()):  # hold the stderr of when they were made: pytest's capture
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr
    logging.captureWarnings(False)
    warnings.resetwarnings()  # an interpreter's default filters (pytest's per-test filters and recording undone)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.showwarning = warnings._showwarning_orig
    warnings._showwarnmsg_impl = lambda msg: sys.stderr.write(warnings._formatwarnmsg(msg))
    sys.argv = list(args[1:])  # accelerate_launch.py and its arguments, as sys.argv is for ``python script ...``
    import accelerate_launch

    return accelerate_launch._run()


def run_all(cmds: list[list[str]], timeout: int = 600, envs: list[dict] | None = None, processes_each: int = 1
            ) -> list[subprocess.CompletedProcess]:
    """Independent commands, each as ``run(cmd, check=False, env=...)`` would run it: one-process commands all at once
    (their start-ups, imports on one thread each, overlap instead of adding up), launches of ``processes_each`` > 1
    ranks as many at once as the cores take (ranks waiting in a gloo collective spin: on 2 cores four 2-rank launches
    at once took 29 s and 143 CPU s, one after another 23.9 s and 41.8 CPU s; three 1-process launches took 8.5 s at
    once, 10.3 s two at a time; 2026-12-05, AMD EPYC)."""
    from concurrent.futures import ThreadPoolExecutor

    envs = envs or [None] * len(cmds)
    workers = len(cmds) if processes_each == 1 else (os.cpu_count() or 1) // processes_each
    workers = max(1, min(len(cmds), workers))
    if workers == 1:  # one after another in this thread: ``popen`` forks launchers from the main thread only
        with LAUNCHING:
            return [_run(cmd, timeout, env) for cmd, env in zip(cmds, envs)]
    with LAUNCHING, ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda c: _run(c[0], timeout, c[1]), zip(cmds, envs)))


def launch_command(script_args: list[str], num_processes: int = 2, config: str = "ddp.yaml", script: str = RECIPE,
                   launcher_args: tuple = ()) -> list[str]:
    """The command ``launch`` runs."""
    if num_processes == 1 and config == "ddp.yaml" and not launcher_args:
        return [sys.executable, script, *script_args]
    return [sys.executable, os.path.join(SCRIPTS, "accelerate_launch.py"), "--config_file", os.path.join(CONFIGS, config),
            "--num_processes", str(num_processes), "--main_process_port", str(free_port()), *launcher_args, script,
            *script_args]


def launch(script_args: list[str], num_processes: int = 2, config: str = "ddp.yaml", script: str = RECIPE,
           check: bool = True, launcher_args: tuple = (), timeout: int = 600) -> subprocess.CompletedProcess:
    """``accelerate launch`` (accelerate's launcher through tests/scripts/accelerate_launch.py: its exit skips the
    interpreter's teardown), or plain ``python`` for one process with the DDP config (the user's two ways to run; one
    process under DeepSpeed or FSDP goes through ``accelerate launch --num_processes 1``, as it must).
    ``launcher_args``: more options for ``accelerate launch`` (e.g. ``--mixed_precision bf16``)."""
    cmd = launch_command(script_args, num_processes, config, script, launcher_args)
    return run(cmd, check=check, timeout=timeout)


def args_from(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        out += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out


# The SGD job of the multi-machine and cluster tests (test_multinode.py, test_ray.py: 2 ranks x micro batch 2 x
# accumulation 2, 3 steps) whose one-machine run (conftest.py's ``one_machine_run``) they end equal to.
CLUSTER_JOB = dict(packing=False, block_size=48, shuffle=True, logging_steps=1, seed=7, report_to="none",
                   per_device_eval_batch_size=3, optim="sgd", learning_rate=0.5, max_grad_norm=0,
                   lr_scheduler_type="constant", weight_decay=0, max_steps=3)
CLUSTER_MICRO, CLUSTER_ACCUM = 2, 2


def cluster_job_args(runs, out: str, **extra) -> list[str]:
    """The recipe's command line for CLUSTER_JOB (``runs``: conftest.py's ``cluster_runs``) into ``out``."""
    return args_from({**runs.common, **runs.data, "model_name_or_path": runs.model, "output_dir": out,
                      "per_device_train_batch_size": CLUSTER_MICRO, "gradient_accumulation_steps": CLUSTER_ACCUM,
                      **extra})


class RunPool:
    """The planned runs of the whole session (conftest's ``run_pool``), whichever module planned them: the first test
    that asks for a planned run launches, in one launch of tests/scripts/probe_runs.py, every planned run not yet done
    with the same launch config and world size (a *kind*), in the order planned (one run after another in the same
    ranks, each with its own output_dir, bit-identical to lone launches). A run that resumes another's checkpoint
    (``copy_from``) joins once that run is done or earlier in the same launch.

    Runs are known by their output_dir. A planned run equal to one planned before (the same script, launch config and
    its content, world size and every field: ``Runs._shared_key``) is that run; a run made outside a plan is kept
    under its key too, so that any module asking for an equal run reads it instead of launching it again. Runs seeded
    with a checkpoint are never shared. A launch that fails fails every test that asks for one of its runs, once:
    the others get its error without launching it again."""

    def __init__(self):
        self.specs: dict[str, dict] = {}  # output_dir -> what to launch
        self.done: dict[str, str] = {}  # output_dir -> where the run is (itself, or an equal run's)
        self.same: dict[str, str] = {}  # output_dir -> that of an equal run planned before
        self.planned_keys: dict[str, str] = {}  # key -> output_dir of the run planned under it
        self.finished: dict[str, str] = {}  # key -> output_dir of a finished run
        self.failed: dict[str, str] = {}  # output_dir -> the error of the launch that held it
        self.modules: dict[tuple[str, str], "Runs"] = {}  # (module, fixture) -> its Runs, planned at the session's start

    def add(self, out: str, spec: dict) -> None:
        config, world = spec["kind"]
        if config in CONFIG_VARIANTS:  # joins the launch of the config it varies, its variables set for it alone
            options = spec["options"]
            env = {**variant_env(config, CONFIG_VARIANTS[config], world), **options.get("env", {})}
            spec = {**spec, "kind": (CONFIG_VARIANTS[config], world), "options": {**options, "env": env}}
        key = spec["key"]
        if key is not None and key in self.planned_keys:
            self.same[out] = self.planned_keys[key]
            return
        if key is not None:
            self.planned_keys[key] = out
        if spec["copy_from"]:
            source, step = spec["copy_from"]
            spec = {**spec, "copy_from": (self.same.get(source, source), step)}
        if spec.get("after"):
            spec = {**spec, "after": self.same.get(spec["after"], spec["after"])}
        self.specs[out] = spec

    def get(self, out: str, _launching: tuple = ()) -> str:
        """The output_dir of a planned run, launched (with every planned run that can join it) if not done yet."""
        out = self.same.get(out, out)
        if out not in self.done and out not in self.failed:
            with LAUNCHING:  # a prefetching thread may be launching it now: it is done (or failed) once that ends
                return self._get(out, _launching)
        if out in self.failed:
            raise AssertionError(f"{out}: its launch failed earlier in this session:\n{self.failed[out]}")
        return self.done[out]

    def prefetch(self) -> threading.Thread:
        """Launch, in a thread of this process, the batches of the one-process kinds in the order planned, each
        without the runs that start from another kind's checkpoint (they wait for a later launch, as in ``get``), and
        return the thread. conftest starts it before the session's first test and runs tests/unit/ first: a
        one-process batch runs on one core (one thread), the in-process tests on the other. A test asking for one of
        their runs waits for its batch; a test starting a subprocess waits for the launch in progress
        (``LAUNCHING``); a failed batch fails the tests that ask for its runs, as in ``get``."""
        first = {}
        for out, spec in self.specs.items():
            if spec["kind"][1] == 1 and not spec["copy_from"] and not spec.get("after") and not spec.get("before"):
                first.setdefault(spec["kind"], out)

        def launch_all():
            for out in first.values():
                try:
                    with LAUNCHING:
                        self._get(out, prefetching=True)
                except AssertionError:
                    pass  # recorded in self.failed: the tests asking for its runs fail with it

        thread = threading.Thread(target=launch_all, name="prefetch one-process runs", daemon=True)
        thread.start()
        return thread

    def _get(self, out: str, _launching: tuple = (), prefetching: bool = False) -> str:
        if out in self.done:
            return self.done[out]
        if out in self.failed:
            raise AssertionError(f"{out}: its launch failed earlier in this session:\n{self.failed[out]}")
        spec = self.specs[out]
        kind = spec["kind"]
        if _needs(spec):
            self.get(_needs(spec), _launching)  # its source's launch first
        # The sources of this kind's other runs, where they are of another kind, so that those runs join this launch
        # (unless that kind waits on this one: then they wait for a later launch).
        for other, s in list(self.specs.items()) if not prefetching else ():
            source = _needs(s)
            if other in self.done or s["kind"] != kind or not source or source in self.done or source in self.failed:
                continue
            if self.specs[source]["kind"] != kind and self.specs[source]["kind"] not in _launching:
                self.get(source, (*_launching, kind))
        batch: list[str] = []
        for other, s in self.specs.items():
            if other in self.done or other in self.failed or s["kind"] != kind:
                continue
            if _needs(s) and _needs(s) not in self.done and _needs(s) not in batch:
                continue  # its source is of another kind, not run yet: a later launch
            if s.get("before") and prefetching:
                continue  # an interrupted run to make first: not on the prefetching thread, beside the unit tests
            batch.append(other)
        for other in list(batch):  # what a run resumes (Interrupted), made now: its failure fails that run alone
            if self.specs[other].get("before"):
                try:
                    self.specs[other]["before"](other)
                except Exception as e:  # noqa: BLE001 (a timeout, an assertion: that test's failure, not the batch's)
                    self.failed[other] = f"what {other} resumes could not be made: {e!r}"
                    batch.remove(other)
        runs = []
        for other in batch:
            s = self.specs[other]
            if s["key"] is not None and s["key"] in self.finished:
                self.done[other] = self.finished[s["key"]]
                continue
            run = {"out": other, "argv": s["argv"], "recipe": s["recipe"], "probe": s["probe"], "key": s["key"],
                   "timeout": s.get("timeout"), **s.get("options", {})}
            if s["copy_from"]:
                source, step = s["copy_from"]
                if source in self.done:  # made before this launch: seeded here
                    CopyCheckpoint(self.done[source], step)(other)
                else:  # made earlier in this launch: seeded there, after it
                    run["copy_from"] = [source, step, other]
            runs.append(run)
        try:
            if len(runs) == 1 and not set(runs[0]) & {"copy_from", *RUN_OPTIONS} and not runs[0].get("timeout") and (
                    runs[0]["recipe"], runs[0]["probe"]) == ("gpt2", True):
                launch(runs[0]["argv"], num_processes=kind[1], config=kind[0],
                       script=os.path.join(SCRIPTS, "probe_run.py"))
            elif runs:
                launch_runs(os.path.dirname(runs[0]["out"]), runs, num_processes=kind[1], config=kind[0])
        except AssertionError as e:
            for r in runs:
                self.failed[r["out"]] = str(e)[-20000:]
            raise
        for r in runs:
            self.done[r["out"]] = r["out"]
            if r["key"] is not None:
                self.finished[r["key"]] = r["out"]
        if out in self.failed:
            raise AssertionError(self.failed[out])
        return self.done[out]


def _needs(spec: dict) -> str | None:
    """The run a planned run must follow: the one whose checkpoint it copies, or its ``after``."""
    return (spec["copy_from"] and spec["copy_from"][0]) or spec.get("after")


class Runs:
    """Lazily launched, cached runs of the real recipe (through tests/scripts/probe_run.py) of one test module, keyed
    by name, so that several tests share one launch (each costs ~5-10 s of process start).

    Runs declared with ``plan`` go into ``pool`` (``RunPool``: the session's ``run_pool``, where every module's runs of
    one launch config and world size share a launch; a private pool when none is given). ``get`` of a run never
    planned launches it alone, unless the pool holds an equal run (planned or made)."""

    def __init__(self, tmp, model: str | None, data: dict, common: dict, pool: RunPool | None = None):
        self.tmp, self.model, self.data, self.common, self.done = tmp, model, data, common, {}
        self.pool = pool if pool is not None else RunPool()
        self.planned: dict[str, dict] = {}
        self.interrupted: dict[str, Interrupted] = {}  # name -> what its planned run resumes (plan's interrupted=)

    def _cfg(self, out: str, micro: int, accum: int, extra: dict) -> dict:
        # plot false: loss.png costs rank 0 0.1-0.3 s a run while the others wait (the notebook's runs draw it)
        cfg = {"plot": False, **self.common, **self.data, "model_name_or_path": self.model, "output_dir": out,
               "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum, **extra}
        return {k: v for k, v in cfg.items() if v is not None}  # None: leave the field at its default

    def _shared_key(self, config: str, world: int, micro: int, accum: int, extra: dict) -> str:
        path = config if os.path.isabs(config) else os.path.join(CONFIGS, config)
        cfg = self._cfg("", micro, accum, extra)
        del cfg["output_dir"]
        return json.dumps(["probe_run.py", open(path).read(), world, sorted(cfg.items())], default=str)

    def plan(self, name: str, config: str | None, world: int, micro: int, accum: int, extra: dict,
             copy_from: tuple[str, int] | None = None, recipe: str = "gpt2", probe: bool = True,
             interrupted: Interrupted | None = None, timeout: int | None = None,
             options: dict | None = None, after: str | None = None) -> None:
        """Declare a run that ``get(name, ...)`` will ask for, with the same arguments (``copy_from``: the name of a
        planned run and the step whose checkpoint seeds this one, what ``copy_checkpoint`` does for ``get``).
        ``recipe``: which of recipes/ runs it (gpt2, sft, classify, dpo, grpo); ``probe``: with probe_run.py's
        callbacks (gpt2 only); ``interrupted``: the run resumes an interrupted run of the same fields (``Interrupted``,
        e.g. ``Killed``: SIGKILLed inside a save; ask for it with ``get_planned``); ``timeout``: seconds after which
        the run counts as hung and fails its launch (probe_runs.py's RUN_TIMEOUT_S by default); ``options``:
        probe_runs.py's per-run options (RUN_OPTIONS: the launcher's environment beyond the launch config's, a SIGTERM
        to rank 0 after a step, a watchdog, going on after a run that failed on every rank); a run with options is
        never shared with an equal one. ``after``: the name of a planned run that must have ended before this one
        starts (nothing copied: e.g. a compile cache it fills); this run joins its kind's launch once that run is done,
        as a ``copy_from`` run does."""
        assert not set(options or {}) - set(RUN_OPTIONS), f"{name}: unknown options {options}"
        assert after is None or after in self.planned, f"{name}: plan {after} first"
        assert copy_from is None or copy_from[0] in self.planned, f"{name}: plan {copy_from[0]} first"
        assert probe is False or recipe == "gpt2", f"{name}: the probes are gpt2's"
        config = config or "ddp.yaml"
        out = str(self.tmp / name)
        if interrupted is not None:
            self.interrupted[name] = interrupted
            interrupted.argv = args_from(self._cfg(out, interrupted.micro or micro, interrupted.accum or accum, extra))
            interrupted.recipe, extra = recipe, {**extra, "resume_from_checkpoint": "latest"}
        self.planned[name] = dict(config=config, world=world, micro=micro, accum=accum, extra=extra,
                                  copy_from=copy_from)
        key = None if copy_from or after or interrupted or options or (recipe, probe) != ("gpt2", True) else self._shared_key(
            config, world, micro, accum, extra)
        self.pool.add(out, {"kind": (config, world), "argv": args_from(self._cfg(out, micro, accum, extra)),
                            "recipe": recipe, "probe": probe, "key": key, "before": interrupted, "timeout": timeout,
                            "options": dict(options or {}), "after": after and str(self.tmp / after),
                            "copy_from": copy_from and (str(self.tmp / copy_from[0]), copy_from[1])})

    def get(self, name: str, config: str | None, world: int, micro: int, accum: int, extra: dict, prepare=None) -> str:
        if name in self.planned:
            spec = self.planned[name]
            assert (spec["config"], spec["world"], spec["micro"], spec["accum"], spec["extra"]) == (
                config or "ddp.yaml", world, micro, accum, extra), f"{name}: asked for otherwise than planned"
            if spec["copy_from"]:
                source, step = spec["copy_from"]
                assert isinstance(prepare, CopyCheckpoint) and prepare.step == step, f"{name}: planned otherwise"
                assert prepare.run_dir == self.get_planned(source), f"{name}: planned from another run"
            else:
                assert prepare is None, f"{name}: planned without a checkpoint"
            return self.get_planned(name)
        if name not in self.done:
            config = config or "ddp.yaml"
            key = None if prepare else self._shared_key(config, world, micro, accum, extra)
            if key in self.pool.finished:
                self.done[name] = self.pool.finished[key]
                return self.done[name]
            if key in self.pool.planned_keys:  # planned by a module: its batch launches now, with it
                self.done[name] = self.pool.get(self.pool.planned_keys[key])
                return self.done[name]
            out = str(self.tmp / name)
            if prepare:
                prepare(out)
            launch(args_from(self._cfg(out, micro, accum, extra)), num_processes=world, config=config,
                   script=os.path.join(SCRIPTS, "probe_run.py"))
            self.done[name] = out
            if key is not None:
                self.pool.finished[key] = out
        return self.done[name]

    def get_planned(self, name: str) -> str:
        """The output_dir of a planned run (launched with its whole batch if not done yet)."""
        return self.pool.get(str(self.tmp / name))


# a run's options in probe_runs.py (Runs.plan's options=): env, sigterm_at, watchdog_s, keep_going
RUN_OPTIONS = ("env", "sigterm_at", "watchdog_s", "keep_going")


# Launch configs that differ from another of the same distributed type in accelerate's variables alone (FSDP1's
# version, prefetch and sync flags; ZeRO-3's offload devices): their planned runs join that config's launch with the
# variables that differ set for the run (``variant_env``), as the bf16 runs do (``mixed_precision_env``): a launch
# fewer each. What the run was given is the rank's own record (probe_run.py: the distributed type, FSDP's version,
# DeepSpeed's optimizer): the tests read it, as before.
CONFIG_VARIANTS = {"fsdp1.yaml": "fsdp.yaml", "zero3_offload.yaml": "zero3.yaml"}


def variant_env(config: str, base: str, world: int) -> dict:
    """What a rank launched with ``config`` has that one launched with ``base`` has not (None: to unset), both from
    accelerate's own code (``toolkit.cli.train.launch_env``, as ``toolkit train`` computes a rank's environment)."""
    from toolkit.cli.train import launch_env

    ours, theirs = launch_env(os.path.join(CONFIGS, config), world), launch_env(os.path.join(CONFIGS, base), world)
    return {k: ours.get(k) for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)}


def mixed_precision_env(config: str, world: int) -> dict:
    """What ``accelerate launch --mixed_precision bf16`` gives a rank beyond what the launch config alone gives (from
    accelerate's own code, as ``toolkit train`` computes a rank's environment): set per run in a shared launch."""
    from toolkit.cli.train import launch_env

    if world == 1 and config == "ddp.yaml":
        return {"ACCELERATE_MIXED_PRECISION": "bf16"}
    import tempfile

    import yaml

    with open(os.path.join(CONFIGS, config)) as f:
        data = yaml.safe_load(f)
    data["mixed_precision"] = "bf16"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
    try:
        plain, bf16 = launch_env(os.path.join(CONFIGS, config), world), launch_env(f.name, world)
    finally:
        os.unlink(f.name)
    return {k: v for k, v in bf16.items() if plain.get(k) != v}


def launch_runs(folder, runs: list[dict], num_processes: int = 2, config: str = "ddp.yaml"
                ) -> subprocess.CompletedProcess:
    """One launch of tests/scripts/probe_runs.py running ``runs`` one after another in the same ranks (each a dict with
    ``argv``, the recipe's command line, and optionally ``copy_from``, ``recipe``, ``probe``: what probe_runs.py
    reads); the list is written as a new ``runs-N.json`` in ``folder``."""
    import pathlib

    folder = pathlib.Path(folder)
    path = folder / f"runs-{len(list(folder.glob('runs-*.json')))}.json"
    path.write_text(json.dumps([{"argv": r["argv"], "copy_from": r.get("copy_from"), "recipe": r.get("recipe", "gpt2"),
                                 "probe": r.get("probe", True), "timeout": r.get("timeout"),
                                 **{k: r[k] for k in RUN_OPTIONS if k in r}} for r in runs]))
    return launch([str(path)], num_processes=num_processes, config=config,
                  script=os.path.join(SCRIPTS, "probe_runs.py"), timeout=600 + 300 * len(runs))


class CopyCheckpoint:
    """A ``prepare`` for ``Runs.get``: seed a new output_dir with ``run_dir``'s checkpoint of ``step`` (a resumed run
    then finds it as ``latest``)."""

    def __init__(self, run_dir: str, step: int):
        self.run_dir, self.step = run_dir, step

    def __call__(self, out: str) -> None:
        import shutil

        name = os.path.join("checkpoints", f"step-{self.step}")
        shutil.copytree(os.path.join(self.run_dir, name), os.path.join(out, name))


def copy_checkpoint(run_dir: str, step: int) -> CopyCheckpoint:
    return CopyCheckpoint(run_dir, step)


def tree_hash(folder: str) -> str:
    """One sha256 over every file's relative path and bytes below ``folder``: equal means nothing was changed."""
    import hashlib

    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, folder).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def load_weights(folder: str) -> dict:
    """Weights of a final/ export or a DDP checkpoint folder, as fp64 tensors by name."""
    from safetensors.torch import load_file

    path = os.path.join(folder, "model.safetensors")
    return {k: v.double() for k, v in load_file(path).items()}


def max_abs_diff(a: dict, b: dict) -> float:
    """max |a - b| over every tensor; both sides must hold exactly the same tensors (a missing one is a failure)."""
    assert a and set(a) == set(b), f"weight names differ: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def train_in_process(values: dict, callbacks=None, task=None) -> dict:
    """A recipe's steps (``build``, then ``train``) as one process inside this one, as a notebook kernel runs them:
    for what only an in-process run shows (what ``train`` leaves behind in its process). accelerate's process-wide
    state is reset before and after. ``task``: a ``toolkit.tasks.base.Task`` (a causal LM when None; DPO's reference is
    added as recipes/dpo.py adds it). Returns the run's summary."""
    from accelerate.state import AcceleratorState, GradientState

    from toolkit.config import config_from_dict
    from toolkit.parallel.accelerator import make_accelerator
    from toolkit.training.build import build
    from toolkit.training.loop import train

    cfg = config_from_dict(values)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = make_accelerator(cfg.train)
        parts = build(cfg, accelerator, task=task)
        if hasattr(task, "add_reference"):
            task.add_reference(cfg, accelerator, parts)
        return train(cfg, accelerator, **parts.train_kwargs(), callbacks=callbacks)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


# ------------------------------------------------------------------ the quickstart notebook, executed once
RESULT_TAG = "QUICKSTART_RESULT "


def read_probes(out: str) -> list[dict]:
    """What tests/scripts/probe_run.py recorded on each of a 2-rank run's ranks."""
    return [json.load(open(os.path.join(out, "probe", f"comm_rank{r}.json"))) for r in (0, 1)]


def assert_plan_matches_held_bytes(ranks: list[dict], model: str, strategy_name: str, lora_r: int | None,
                                   lora_target_modules: list[str] | None = None, optim: str = "adamw_torch") -> None:
    """``toolkit plan``'s per-device weights and optimizer state against the bytes each rank held (probe_run.py's
    ``held_bytes``, storage by storage): each within 3%."""
    from toolkit.cli.plan import count_model, model_states_per_device

    states = model_states_per_device(count_model(model, lora_r=lora_r, lora_target_modules=lora_target_modules,
                                                 optim=optim),
                                     strategy_name, devices=2, per_node=2, precision="fp32")
    for rank in ranks:
        for part in ("weights", "optimizer"):
            held = rank["held_bytes"][part]
            assert abs(held - states[part]) <= 0.03 * states[part], (rank["process_index"], part, held, states[part])


def _texts(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o["text"])
            elif "data" in o:
                out.append(o["data"].get("text/plain", ""))
    return "\n".join(out)


# The notebook_launcher cell, run this many times in a row by the session's execution (tests/launch/test_notebook.py):
# twice, so that a second launch from the same kernel is shown to work too. Its hang (docs/pitfalls.md#gloo-teardown-
# deadlock: 2 of 5 executions once) was guarded by 6 launches (all return with probability 0.6^6 = 4.7% without the
# fix); its cause is now checked deterministically in every 2-rank run of the core tests instead
# (test_core.py::test_train_leaves_its_process_group_held_when_it_returns), at no launch of its own.
QUICKSTART_LAUNCHES = 2


def _is_launch_cell(cell) -> bool:
    return cell.cell_type == "code" and "notebook_launcher(train_fn" in cell.source


def execute_quickstart(work, launches: int = 1) -> dict:
    """Run the notebook top to bottom in a fresh kernel, writing everything under ``work``; what it printed and made.

    ``launches``: its ``notebook_launcher`` cell and the cell after it (which reads both ranks' files) run that many
    times in a row, in the same kernel, before the cells that follow (each launch replaces the one before: the
    config has ``overwrite_output_dir``). The wall time of each launch is returned."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = subprocess_env()
    env["TOOLKIT_QUICKSTART_DIR"] = str(work)
    env.pop("OMP_NUM_THREADS", None)  # the kernel run may use both cores; accelerate sets 1 per rank after the fork
    before = sorted(os.listdir(os.path.dirname(NOTEBOOK)))
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(work)}})
    launch_seconds = []
    with client.setup_kernel(env=env):
        index = 0
        while index < len(nb.cells):
            if not _is_launch_cell(nb.cells[index]):
                client.execute_cell(nb.cells[index], index)
                index += 1
                continue
            for _ in range(launches):
                started = time.time()
                client.execute_cell(nb.cells[index], index)
                launch_seconds.append(round(time.time() - started, 1))
                client.execute_cell(nb.cells[index + 1], index + 1)
            index += 2
    text = _texts(nb)
    line = next((s for s in text.splitlines() if s.startswith(RESULT_TAG)), None)
    assert line is not None, f"the notebook printed no {RESULT_TAG.strip()} line; its output:\n{text[-4000:]}"
    return {"work": str(work), "nb": nb, "text": text, "before": before,
            "result": json.loads(line[len(RESULT_TAG):]), "launch_seconds": launch_seconds,
            "kernel_run": str(work / "kernel-1x4x2"), "launch_run": str(work / "launcher-2x4x1")}


# ------------------------------------------------------------------ a job SIGKILLed inside a checkpoint save
def steps_logged(out: str) -> list[int]:
    """The steps whose loss a run logged so far (complete lines of its metrics.jsonl)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n") and '"loss"' in line]


def saving_checkpoints(out) -> list[str]:
    """The ``step-N.tmp`` folders of saves under way (or killed) in ``out``."""
    import re

    root = os.path.join(out, "checkpoints")
    return [n for n in (os.listdir(root) if os.path.isdir(root) else []) if re.fullmatch(r"step-\d+\.tmp", n)]


class Interrupted:
    """``interrupted=`` of ``Runs.plan``: before the planned run's batch launches, ``__call__(output_dir)`` leaves there
    an interrupted 2-rank run of the same fields under ``config`` (its command line ``argv``, from ``micro`` x
    ``accum`` where its split differs from the relaunch's; ``recipe``: both set by ``plan``). The planned run,
    ``resume_from_checkpoint: latest`` added, is its relaunch, in the shared launch of its kind instead of a launch
    of its own. What the interruption showed is kept on the object for the test to read."""

    def __init__(self, config: str = "ddp.yaml", micro: int | None = None, accum: int | None = None):
        self.config, self.micro, self.accum = config, micro, accum
        self.argv: list[str] | None = None
        self.recipe = "gpt2"

    def launcher(self) -> list[str]:
        """The command that starts the run (a new port each time): ``launch_command``'s (``popen`` forks it)."""
        return launch_command(self.argv, config=self.config, script=os.path.join(ROOT, "recipes", f"{self.recipe}.py"))

    @staticmethod
    def env() -> dict:
        """subprocess_env, and tests/scripts, where GRPO's reward module is (probe_runs.py's folder, for the
        relaunch)."""
        env = subprocess_env()
        env["PYTHONPATH"] = os.pathsep.join([SCRIPTS, env["PYTHONPATH"]])
        return env

    def __call__(self, out: str) -> None:
        raise NotImplementedError


class Killed(Interrupted):
    """SIGKILL to the whole job (launcher and ranks) while a checkpoint save is under way, from step 3 on and before
    ``before_step``; the previous checkpoint and ``latest`` stay loadable. ``at``: the last step the killed run
    logged; ``left``: the unfinished save it left."""

    def __init__(self, before_step: int, config: str = "ddp.yaml", micro: int | None = None,
                 accum: int | None = None):
        super().__init__(config, micro, accum)
        self.before_step, self.at, self.left = before_step, None, None

    def __call__(self, out: str) -> None:
        import shutil

        from toolkit import layout

        # A save of this model lasts milliseconds (DDP) to ~0.1 s: a kill aimed at one can land just after it. Each
        # attempt starts afresh and kills at the first save seen from step 3 on. Bounded: 5 attempts.
        for _ in range(5):
            shutil.rmtree(out, ignore_errors=True)
            with LAUNCHING:
                proc = popen(self.launcher(), cwd=ROOT, env=self.env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
                deadline = time.time() + 120
                while (not (len(steps_logged(out)) >= 3 and saving_checkpoints(out)) and time.time() < deadline
                       and proc.poll() is None):
                    time.sleep(0.002)
                assert proc.poll() is None, "the run ended before it could be killed"
                kill_job(proc.pid)  # the launcher and its ranks (each in a session of its own: killpg would miss them)
                proc.wait(timeout=30)
            self.at = max(steps_logged(out))
            assert not os.path.exists(os.path.join(out, "final"))
            if saving_checkpoints(out) and self.at < self.before_step:
                break
        else:
            raise AssertionError(f"no kill out of 5 landed inside a save before step {self.before_step}")
        self.left = saving_checkpoints(out)
        latest = layout.latest_checkpoint(out)
        assert latest and layout.read_checkpoint_state(latest)["loop"]["step"] < int(self.left[0][5:-4])

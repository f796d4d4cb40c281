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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "gpt2.py")
CONFIGS = os.path.join(ROOT, "accelerate_configs")
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
sys.path.insert(0, SCRIPTS)  # the probes (probe_run.PROBE_IDS) are imported by tests


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


def run(cmd: list[str], check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def launch(script_args: list[str], num_processes: int = 2, config: str = "ddp.yaml", script: str = RECIPE,
           check: bool = True, launcher_args: tuple = ()) -> subprocess.CompletedProcess:
    """``accelerate launch``, or plain ``python`` for one process with the DDP config (the user's two ways to run; one
    process under DeepSpeed or FSDP goes through ``accelerate launch --num_processes 1``, as it must).
    ``launcher_args``: more options for ``accelerate launch`` (e.g. ``--mixed_precision bf16``)."""
    if num_processes == 1 and config == "ddp.yaml" and not launcher_args:
        return run([sys.executable, script, *script_args], check=check)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, config),
           "--num_processes", str(num_processes), "--main_process_port", str(free_port()), *launcher_args, script,
           *script_args]
    return run(cmd, check=check)


def args_from(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        out += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out


class Runs:
    """Lazily launched, cached runs of the real recipe (through tests/scripts/probe_run.py), keyed by name, so that
    several tests share one launch (each costs ~10 s of process start)."""

    def __init__(self, tmp, model: str, data: dict, common: dict):
        self.tmp, self.model, self.data, self.common, self.done = tmp, model, data, common, {}

    def get(self, name: str, config: str | None, world: int, micro: int, accum: int, extra: dict, prepare=None) -> str:
        if name not in self.done:
            out = str(self.tmp / name)
            if prepare:
                prepare(out)
            cfg = {**self.common, **self.data, "model_name_or_path": self.model, "output_dir": out,
                   "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum, **extra}
            cfg = {k: v for k, v in cfg.items() if v is not None}  # None: leave the field at its default
            launch(args_from(cfg), num_processes=world, config=config or "ddp.yaml",
                   script=os.path.join(SCRIPTS, "probe_run.py"))
            self.done[name] = out
        return self.done[name]


def copy_checkpoint(run_dir: str, step: int):
    """A ``prepare`` for ``Runs.get``: seed a new output_dir with ``run_dir``'s checkpoint of ``step`` (a resumed run
    then finds it as ``latest``)."""
    import shutil

    def prepare(out: str) -> None:
        name = os.path.join("checkpoints", f"step-{step}")
        shutil.copytree(os.path.join(run_dir, name), os.path.join(out, name))

    return prepare


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


# ------------------------------------------------------------------ the quickstart notebook, executed once
RESULT_TAG = "QUICKSTART_RESULT "


def read_probes(out: str) -> list[dict]:
    """What tests/scripts/probe_run.py recorded on each of a 2-rank run's ranks."""
    return [json.load(open(os.path.join(out, "probe", f"comm_rank{r}.json"))) for r in (0, 1)]


def assert_plan_matches_held_bytes(ranks: list[dict], model: str, strategy_name: str, lora_r: int | None) -> None:
    """``toolkit plan``'s per-device weights and optimizer state against the bytes each rank held (probe_run.py's
    ``held_bytes``, storage by storage): each within 3%."""
    from toolkit.plan import count_model, model_states_per_device

    states = model_states_per_device(count_model(model, lora_r=lora_r), strategy_name, devices=2, per_node=2,
                                     precision="fp32")
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


def execute_quickstart(work) -> dict:
    """Run the notebook top to bottom in a fresh kernel, writing everything under ``work``; what it printed and made."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = subprocess_env()
    env["TOOLKIT_QUICKSTART_DIR"] = str(work)
    env.pop("OMP_NUM_THREADS", None)  # the kernel run may use both cores; accelerate sets 1 per rank after the fork
    before = sorted(os.listdir(os.path.dirname(NOTEBOOK)))
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(work)}})
    client.execute(env=env)
    text = _texts(nb)
    line = next((s for s in text.splitlines() if s.startswith(RESULT_TAG)), None)
    assert line is not None, f"the notebook printed no {RESULT_TAG.strip()} line; its output:\n{text[-4000:]}"
    return {"work": str(work), "nb": nb, "text": text, "before": before,
            "result": json.loads(line[len(RESULT_TAG):]),
            "kernel_run": str(work / "kernel-1x4x2"), "launch_run": str(work / "launcher-2x4x1")}

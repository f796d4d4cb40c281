"""Shared fixtures: a tiny GPT-2 with the real GPT-2 tokenizer saved to disk, padded data, and launch helpers.

Every multi-process test goes through ``accelerate launch`` with real gloo ranks; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "gpt2.py")
CONFIGS = os.path.join(ROOT, "accelerate_configs")
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
sys.path.insert(0, SCRIPTS)


def _env() -> dict:
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


def run(cmd: list[str], check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def launch(script_args: list[str], num_processes: int = 2, config: str = "ddp.yaml", script: str = RECIPE,
           check: bool = True) -> subprocess.CompletedProcess:
    """``accelerate launch`` for N > 1, plain ``python`` for one process (the user's two ways to run)."""
    if num_processes == 1:
        return run([sys.executable, script, *script_args], check=check)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, config),
           "--num_processes", str(num_processes), "--main_process_port", str(free_port()), script, *script_args]
    return run(cmd, check=check)


def args_from(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        out += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer, 32-wide GPT-2 with OpenAI's real BPE, saved and loaded back through from_pretrained."""
    from toolkit.offline import save_tiny_gpt2

    return save_tiny_gpt2(str(tmp_path_factory.mktemp("models") / "tiny-gpt2"), n_layer=2, n_embd=32, n_head=2,
                          n_positions=64, seed=0)


@pytest.fixture(scope="session")
def padded_data(tmp_path_factory) -> dict:
    """jsonl train/validation rows of very different lengths (3 to ~60 tokens), cut from CPython's docs."""
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)[:20]).split()
    rows, pos = [], 0
    for i in range(64):
        n = 2 + (i * 7) % 40  # lengths cycle through 2..41 words
        rows.append({"text": " ".join(words[pos : pos + n])})
        pos += n
    d = tmp_path_factory.mktemp("data")
    train, valid = d / "train.jsonl", d / "valid.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows[:48]) + "\n")
    valid.write_text("\n".join(json.dumps(r) for r in rows[48:]) + "\n")
    return {"train_file": str(train), "validation_file": str(valid)}


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


def load_weights(folder: str) -> dict:
    """Weights of a final/ export or a DDP checkpoint folder, as fp64 tensors by name."""
    from safetensors.torch import load_file

    path = os.path.join(folder, "model.safetensors")
    return {k: v.double() for k, v in load_file(path).items()}


def max_abs_diff(a: dict, b: dict) -> float:
    common = sorted(set(a) & set(b))
    assert len(common) >= len(a) - 1 and common, f"weight names differ: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k] - b[k]).abs().max()) for k in common)

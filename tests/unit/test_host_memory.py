"""CPU ranks keep freed memory for reuse (toolkit/env/host_memory.py): when ``train`` turns it on, and that it gives it
back. The speed effect itself is measured in fresh interpreters: tests/launch/test_host_memory_launch.py.

Here ``train`` runs in this process (one process, a tiny model, one step), as in a notebook kernel, and glibc's
state is read from what it does: a touched block freed is handed back to the kernel (RSS falls by its size) under
glibc's defaults, and stays in the process while freed memory is kept."""

import os

import pytest
import torch
from helpers import train_in_process

from toolkit.env.host_memory import _glibc, keep_freed_memory, memory_kept, restore_freed_memory

BLOCK_MB = 256


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _released_mb() -> float:
    """MB handed back to the kernel when a touched block of BLOCK_MB is freed: all of it under glibc's defaults (a
    block that size is mapped, and unmapped on free), about none while freed memory is kept."""
    block = torch.ones(BLOCK_MB * 2**18)  # fp32: every page written, so resident
    peak = _rss()
    del block
    return (peak - _rss()) / 2**20


def _values(tiny_model, padded_data, out, **fields) -> dict:
    """One step, no evaluation, no export: what is measured happens inside the step's callback and after train()."""
    return {"model_name_or_path": tiny_model, "train_file": padded_data["train_file"], "output_dir": out,
            "block_size": 64, "packing": False, "per_device_train_batch_size": 4, "max_steps": 1,
            "report_to": "none", "save_final_model": False, **fields}


class _Probe:
    """At the first step's end, inside train(): whether freed memory is kept, as the allocator shows it."""

    def __init__(self):
        self.during = None

    def on_step_end(self, accelerator, state, row):
        if self.during is None:
            self.during = (memory_kept(), _released_mb())


@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")
def test_train_keeps_freed_memory_on_a_cpu_while_it_trains_and_restores_glibc_when_it_returns(
        tiny_model, padded_data, tmp_path):
    """Point 7: train() itself, not a helper: it keeps freed memory while it trains on this CPU, and a kernel that
    lives on gets glibc's settings back when train() returns (the issue's forked child kept 311 MB after freeing
    300 MB). A setting the caller made before train() is the caller's, and stays."""
    assert _released_mb() > 0.8 * BLOCK_MB and not memory_kept()  # glibc's defaults in this process

    probe = _Probe()
    train_in_process(_values(tiny_model, padded_data, str(tmp_path / "default")), callbacks=[probe])
    kept, released = probe.during
    assert kept and released < 0.1 * BLOCK_MB, probe.during  # the freed block stayed in the process
    assert _released_mb() > 0.8 * BLOCK_MB and not memory_kept()  # and after train(): glibc's defaults again

    keep_freed_memory()  # the caller's own setting (bench/step_speed.py does this)
    try:
        probe = _Probe()
        train_in_process(_values(tiny_model, padded_data, str(tmp_path / "caller")), callbacks=[probe])
        assert probe.during[0] and memory_kept() and _released_mb() < 0.1 * BLOCK_MB
    finally:
        assert restore_freed_memory()
    assert _released_mb() > 0.8 * BLOCK_MB


def test_memory_reuse_is_on_by_default_on_a_cpu_only_unless_a_memory_switch_asks_for_less_memory():
    """The decision train() makes: never on a GPU device (a CUDA run on a GPU machine, below, shows train() leaving
    glibc alone), and on a CPU unless a memory switch is on."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.config import TrainingArguments
    from toolkit.models.loading import enable_activation_checkpointing
    from toolkit.training.loop import _reuse_cpu_memory

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object: no GPU needed to make one
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    assert _reuse_cpu_memory(TrainingArguments(), model, cpu)
    assert not _reuse_cpu_memory(TrainingArguments(), model, gpu)
    assert not _reuse_cpu_memory(TrainingArguments(cpu_memory_reuse=True), model, gpu)
    assert not _reuse_cpu_memory(TrainingArguments(loss_chunk_size=256), model, cpu)
    assert not _reuse_cpu_memory(TrainingArguments(cpu_memory_reuse=False), model, cpu)
    enable_activation_checkpointing(model)  # also how FSDP's launch-config checkpointing ends up
    assert not _reuse_cpu_memory(TrainingArguments(), model, cpu)
    assert _reuse_cpu_memory(TrainingArguments(cpu_memory_reuse=True, loss_chunk_size=256), model, cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU run (bench/gpu_check.sh runs it on a lent GPU)")
def test_train_on_a_gpu_leaves_glibc_alone(tiny_model, padded_data, tmp_path):
    probe = _Probe()
    train_in_process(_values(tiny_model, padded_data, str(tmp_path / "gpu"), cpu_memory_reuse=True), callbacks=[probe])
    assert probe.during[0] is False and not memory_kept()

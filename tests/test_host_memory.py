"""CPU ranks keep freed memory for reuse (toolkit/host_memory.py). Process-wide and irreversible, so each arm runs in
a fresh interpreter; the effect is read from the kernel's own count of page faults, not from a clock."""

import json
import subprocess
import sys

import pytest

from toolkit.host_memory import _glibc

# The large tensors of a causal LM's loss, as one micro-step makes them: logits (512 x 50257 fp32 = 103 MB),
# log_softmax's output, the gradients of both. Eight warm-up steps (the kept heap grows to its plateau), then the
# page faults of three more.
PROBE = r"""
import json, resource, sys
import torch
from toolkit.host_memory import keep_freed_memory

applied = keep_freed_memory() if sys.argv[1] == "kept" else False
torch.manual_seed(0)
head, hidden = torch.randn(64, 50257, requires_grad=True), torch.randn(512, 64)

def step():
    torch.log_softmax(hidden @ head, -1).sum().backward()

for _ in range(8):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(arm: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, arm], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default, kept = _faults("default"), _faults("kept")
    assert kept["applied"] and not default["applied"]
    # glibc's default maps each logits-sized block afresh: ~100,000 pages faulted in per step (measured 305,000 for
    # three). Kept, once the heap has grown to its plateau: none in 25 of 30 runs, one block's 25,000 at most
    # (bench/step_speed.py measures the step: 2.07 s -> 1.36 s).
    assert default["faults"] > 3 * 75_000, default
    assert kept["faults"] < default["faults"] / 5, (default, kept)


def test_memory_reuse_is_on_by_default_unless_a_memory_switch_asks_for_less_memory():
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.config import TrainingArguments
    from toolkit.loop import _reuse_cpu_memory
    from toolkit.model import enable_activation_checkpointing

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    assert _reuse_cpu_memory(TrainingArguments(), model)
    assert not _reuse_cpu_memory(TrainingArguments(loss_chunk_size=256), model)
    assert not _reuse_cpu_memory(TrainingArguments(cpu_memory_reuse=False), model)
    enable_activation_checkpointing(model)  # also how FSDP's launch-config checkpointing ends up
    assert not _reuse_cpu_memory(TrainingArguments(), model)
    assert _reuse_cpu_memory(TrainingArguments(cpu_memory_reuse=True, loss_chunk_size=256), model)

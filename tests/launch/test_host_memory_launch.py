"""CPU ranks keep freed memory for reuse (toolkit/env/host_memory.py). Process-wide and irreversible, so each arm runs in
a fresh interpreter; the effect is read from the kernel's own count of page faults, not from a clock."""

import json
import subprocess
import sys

import pytest

from toolkit.env.host_memory import _glibc

# The large tensors of a causal LM's loss, as one micro-step makes them: logits (512 x 50257 fp32 = 103 MB),
# log_softmax's output, the gradients of both. Eight warm-up steps (the kept heap grows to its plateau), then the
# page faults of three more.
PROBE = r"""
import json, resource, sys
import torch
from toolkit.env.host_memory import keep_freed_memory

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


def _faults(*arms: str) -> list[dict]:
    """Each arm in a fresh interpreter of its own, all at once (a page fault count is per process: the arms do not
    disturb each other's, and together they take the time of one)."""
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, arm], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for arm in arms]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow  # two processes started and measured: 5.4 s, the quick layer's largest after the config launches
@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default, kept = _faults("default", "kept")
    assert kept["applied"] and not default["applied"]
    # glibc's default maps each logits-sized block afresh: ~100,000 pages faulted in per step (measured 305,000 for
    # three). Kept, once the heap has grown to its plateau: none in 25 of 30 runs, one block's 25,000 at most
    # (bench/step_speed.py measures the step: 2.07 s -> 1.36 s); once, in a full suite on a host reclaiming memory
    # (kdamond), three blocks' 75,386 against the default's 307,861: a quarter is what the claim needs (the default
    # faults every block in again; kept, at most the odd block the host took back).
    assert default["faults"] > 3 * 75_000, default
    assert kept["faults"] < default["faults"] / 3, (default, kept)

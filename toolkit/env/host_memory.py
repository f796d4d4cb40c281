"""Host memory on CPU ranks: keep freed blocks in the process for reuse instead of handing them back to the kernel.

Why. glibc serves every block above its mmap threshold (32 MiB at most) with a fresh ``mmap`` and unmaps it on
``free``. A CPU training step allocates several logits-sized tensors per micro-step (the logits, log_softmax's output,
their gradients: batch x seq x vocab x 4 bytes each), so the kernel maps and zero-fills gigabytes of new pages every
optimizer step: page faults take a large share of the step's wall time (``bench/step_speed.py``; the figures are in
docs/performance.md#where-a-cpu-step-spends-its-time and docs/pitfalls.md#glibc-mmap). It is also why two identical
steps in one process can differ by 10% or more: which tensors land on fresh pages decides it.

How. ``mallopt(M_MMAP_MAX, 0)`` serves large blocks from the heap too, and ``mallopt(M_TRIM_THRESHOLD, 2 GiB)`` keeps
freed memory at the heap's top instead of returning it. Both act inside the running process (no launcher and no
environment variable set before start), which is what torch's own CPU launcher gets by preloading tcmalloc or
jemalloc (``python -m torch.backends.xeon.run_cpu --enable_tcmalloc``). The cost: the process keeps its peak heap
until it exits, like CUDA's caching allocator, and that heap fragments (torch asks for 64-byte aligned blocks, which a
freed block of the same size cannot serve): peak RSS grows (docs/performance.md), so ``toolkit.training.loop`` leaves it off for runs
that turn on a memory switch. GPU ranks never call this (their large tensors are on the device, in torch's caching
allocator); nor do allocators other than glibc's (musl, macOS), where it returns False.

Undone. ``toolkit.training.loop.train`` calls ``restore_freed_memory`` when it returns, if that call of ``train`` made the
setting: a notebook kernel lives on after the run, and whatever it forks later (``notebook_launcher``'s ranks,
DataLoader workers) would inherit a heap that never shrinks. glibc has no call that reads a setting back, so
"restore" means the values the process started with: glibc's defaults, or those its environment gave it
(``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``); then ``malloc_trim`` hands the kept heap back.
One thing stays: any ``mallopt`` of these turns off glibc's dynamic mmap threshold for good, so the threshold stays
where it was (128 KiB, or up to 32 MiB if the process had already freed such a mapped block); a block above it is
mapped and unmapped as by default (docs/pitfalls.md#glibc-restore).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_BYTES = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can be given (2 GiB)
# glibc's defaults (malloc.c: DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD), and where a process's environment sets them
START = {M_MMAP_MAX: (65536, "MALLOC_MMAP_MAX_", "glibc.malloc.mmap_max"),
         M_TRIM_THRESHOLD: (128 * 1024, "MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold")}

_applied = False


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    # gnu_get_libc_version exists in glibc only: musl's mallopt accepts the call and does nothing.
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """Make this process's glibc keep freed large blocks for reuse (process-wide, until ``restore_freed_memory``).
    True when it is in effect; False where the C library is not glibc."""
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    _applied = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    return _applied


def memory_kept() -> bool:
    """Whether ``keep_freed_memory`` is in effect in this process."""
    return _applied


def restore_freed_memory() -> bool:
    """Undo ``keep_freed_memory``: glibc's settings as this process started with them, and the kept heap handed back
    to the kernel (``malloc_trim``). True when it restored them; False when nothing was kept."""
    global _applied
    if not _applied:
        return False
    libc = _glibc()
    _applied = not all(libc.mallopt(param, _start_value(param)) == 1 for param in START)
    libc.malloc_trim(0)
    return not _applied


def _start_value(param: int) -> int:
    """The value glibc gave ``param`` at this process's start: ``GLIBC_TUNABLES``, the older variable, its default."""
    default, variable, tunable = START[param]
    tunables = dict(item.split("=", 1) for item in os.environ.get("GLIBC_TUNABLES", "").split(":") if "=" in item)
    value = tunables.get(tunable, os.environ.get(variable))
    try:
        return int(value, 0) if value else default
    except ValueError:  # glibc ignores a value it cannot parse
        return default

"""What ``accelerate launch`` asked of this process, read from the environment it sets (the strategy, the world size,
the parallelism sizes), before any Accelerator exists: what a model, a task or ``toolkit train`` may check early."""

from __future__ import annotations

import os


def has_accelerator() -> bool:
    import torch

    try:
        return bool(torch.accelerator.is_available())
    except AttributeError:  # torch < 2.6
        return torch.cuda.is_available()


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def launched_strategy() -> str:
    """What ``accelerate launch`` asked for, from the environment it sets: 'deepspeed', 'fsdp' or 'ddp'."""
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _env_true("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return "ddp"


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_parallel_sizes() -> dict:
    """The ``ParallelismConfig`` sizes ``accelerate launch`` set (its ``parallelism_config`` section), or {}."""
    if not _env_true("ACCELERATE_USE_PARALLELISM_CONFIG"):
        return {}
    return {name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
            for name in ("dp_replicate", "dp_shard", "tp", "cp")}


def launched_strategy_name() -> str:
    """``strategy_name`` of the launch this process is in, from the environment ``accelerate launch`` sets, before any
    Accelerator exists (``toolkit train`` checks a run with it before it launches)."""
    if launched_parallel_sizes().get("tp", 1) > 1:
        return "tp"
    strategy = launched_strategy()
    if strategy == "deepspeed":
        return f"deepspeed-zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}"
    if strategy == "fsdp":
        return "fsdp2" if os.environ.get("FSDP_VERSION", "1") == "2" else "fsdp1"
    return "ddp" if launched_world_size() > 1 else "single"


def launched_data_parallel_size(pipeline_parallel_size: int = 1) -> int:
    """``data_parallel_size`` of the launch this process is in, from its environment, before any Accelerator: the
    ranks that take different rows, the launched world over its tensor- and context-parallel groups and its pipeline
    stages (``toolkit train`` checks one global batch with it before it launches)."""
    sizes = launched_parallel_sizes()
    return max(1, launched_world_size() // (sizes.get("tp", 1) * sizes.get("cp", 1) * pipeline_parallel_size))

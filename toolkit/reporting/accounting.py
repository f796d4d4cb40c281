"""What a run costs: FLOPs per token, model FLOP utilisation (MFU) and peak memory per rank.

MFU = achieved model FLOP/s per device / the device's peak FLOP/s. The model FLOPs per trained token are the usual
estimate (Kaplan et al. 2020; PaLM, appendix B; nanoGPT's ``estimate_mfu``):

    6 N            forward (2N) + backward (4N) of every weight matrix, N = parameters (tied ones once, the
                   position-embedding table excluded: a lookup, no matmul)
  + 12 L d T       attention scores and their weighted sum, forward + backward, L layers of width d over T positions

Recomputation (gradient checkpointing) is not counted: MFU measures useful work, so checkpointing lowers it. The
peak is the ``peak_flops`` field when set, else a datasheet value for the device and precision (dense, no sparsity)
when the device is in ``PEAK_FLOPS``, else unknown (a CPU): MFU is then not reported.
"""

from __future__ import annotations

import resource

import torch

# Dense peak FLOP/s per device from the vendors' datasheets, by a substring of torch.cuda.get_device_name().
# "fp32" is plain fp32 (torch's default matmul precision), not TF32.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM; the PCIe card is lower: set peak_flops
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}


def count_parameters(model: torch.nn.Module) -> int:
    """N of the 6N estimate: every parameter once (tied ones once; ZeRO-3's partitioned ones at their full size),
    without a position-embedding table (GPT-2's ``wpe``)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or name.endswith("wpe.weight"):
            continue
        seen.add(id(p))
        total += getattr(p, "ds_numel", None) or p.numel()
    return total


def flops_per_token(n_params: int, n_layers: int, width: int, seq_len: float) -> float:
    return 6 * n_params + 12 * n_layers * width * seq_len


def mfu(flops_per_token: float, tokens_per_s: float, devices: int, peak: float | None) -> float | None:
    """Model FLOP utilisation: the model FLOP/s each device achieved over its peak (None when the peak is unknown)."""
    return flops_per_token * tokens_per_s / devices / peak if peak else None


def model_shape(config) -> tuple[int, int]:
    """(layers, width) of a transformers config, under either naming (GPT-2's n_layer / n_embd or the usual)."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    width = getattr(config, "hidden_size", None) or config.n_embd
    return layers, width


def weights_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype that holds most of the model's parameter elements (a LoRA adapter's fp32 weights on a bf16 base
    count for little), or None for a model without parameters."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + (getattr(p, "ds_numel", None) or p.numel())
    return max(sizes, key=sizes.get) if sizes else None


def compute_precision(mixed_precision: str, param_dtype: torch.dtype | None = None) -> str:
    """The key of ``PEAK_FLOPS`` the matmuls run at: accelerate's mixed precision when on (autocast), else the
    weights' own dtype: weights trained in bf16 or fp16 through ``torch_dtype`` (no mixed precision) run their
    matmuls at that precision's peak, not fp32's (~15x lower on an H100, which made MFU ~15x too high)."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(param_dtype, "fp32")


def peak_flops(device: torch.device, mixed_precision: str, override: float | None,
               param_dtype: torch.dtype | None = None) -> float | None:
    """Peak FLOP/s of one device at the run's precision (``compute_precision``), or None when unknown."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    precision = compute_precision(mixed_precision, param_dtype)
    for key, table in PEAK_FLOPS.items():
        if key in name:
            return table.get(precision)
    return None


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory so far, in GB (10^9 bytes, the unit of ``toolkit plan`` and of device datasheets):
    allocated device memory on a GPU, resident set size (RSS) on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux

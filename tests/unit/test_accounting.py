"""The arithmetic behind MFU and the memory figures (``toolkit.reporting.accounting``), on configs on the meta device."""

import pytest
import torch

from toolkit.reporting.accounting import (
    PEAK_FLOPS,
    compute_precision,
    count_parameters,
    flops_per_token,
    model_shape,
    peak_flops,
    peak_memory_gb,
    weights_dtype,
)


def _gpt2_124m():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config())


def test_gpt2_124m_flops_per_token():
    """GPT-2 small: 124,439,808 parameters (lm_head tied to wte, counted once), 786,432 of them in wpe (a lookup):
    N = 123,653,376; 6N + 12 * 12 layers * 768 * 1024 positions = 855.1 MFLOPs per token (nanoGPT's estimate_mfu)."""
    model = _gpt2_124m()
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    n = count_parameters(model)
    assert n == 124_439_808 - 1024 * 768
    layers, width = model_shape(model.config)
    assert (layers, width) == (12, 768)
    assert flops_per_token(n, layers, width, 1024) == 6 * n + 12 * 12 * 768 * 1024 == pytest.approx(855.1e6, rel=1e-4)


def test_peak_flops_and_memory():
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "no", None) is None  # no datasheet for a CPU: MFU is not reported
    assert peak_flops(cpu, "bf16", 2.5e12) == 2.5e12  # the peak_flops field wins
    assert PEAK_FLOPS["H100"]["bf16"] == 989e12 and PEAK_FLOPS["A100"]["fp32"] == 19.5e12
    assert 0.01 < peak_memory_gb(cpu) < 64


def test_weights_trained_in_16_bit_use_the_16_bit_peak(monkeypatch):
    """torch_dtype: bfloat16 without mixed precision runs its matmuls in bf16: the bf16 peak, not fp32's (which made
    MFU ~15x too high on an H100). Mixed precision, when on, is what autocast computes in."""
    assert compute_precision("no", torch.bfloat16) == "bf16"
    assert compute_precision("no", torch.float16) == "fp16"
    assert compute_precision("no", torch.float32) == "fp32" and compute_precision("no") == "fp32"
    assert compute_precision("bf16", torch.float32) == "bf16" and compute_precision("fp16", None) == "fp16"
    model = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16), torch.nn.Linear(64, 2))  # a LoRA-like
    assert weights_dtype(model) == torch.bfloat16  # most elements decide
    assert weights_dtype(torch.nn.ReLU()) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert peak_flops(gpu, "no", None, torch.bfloat16) == 989e12
    assert peak_flops(gpu, "no", None, torch.float32) == peak_flops(gpu, "no", None) == 67e12
    assert peak_flops(gpu, "bf16", None, torch.float32) == 989e12

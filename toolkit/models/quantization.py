"""A frozen base in 4 or 8 bits (bitsandbytes: QLoRA's ``load_in_4bit``, LLM.int8's ``load_in_8bit``), and
bitsandbytes' 8-bit AdamW.

The base loads quantized through transformers (``BitsAndBytesConfig`` into ``from_pretrained``) on the rank's own
device; only LoRA adapters (and ``lora_modules_to_save``, a classifier's head) train, in ``torch_dtype``, on top.

- The 4-bit storage dtype (``bnb_4bit_quant_storage``) is the compute dtype, not bitsandbytes' uint8 default: the
  packed bytes are the same, but FSDP2 shards only floating parameters, and accelerate leaves uint8 ones out of the
  sharding (every rank then holds the whole base; FSDP1 fails to flatten them): docs/pitfalls.md#qlora-fsdp-storage.
- ``prepare_model_for_kbit_training`` (peft) is not called: of what it does, the freezing is peft's wrapping's own,
  the upcast of bf16/fp16 non-quantized weights to fp32 would override ``torch_dtype`` (and the dtype FSDP2 shards
  in), and its gradient checkpointing (reentrant, input gradients forced on) would bypass the run's own
  ``gradient_checkpointing`` (non-reentrant, or FSDP's ``activation_checkpointing``). ``torch_dtype: float32`` (the
  default) keeps the norms and the head in fp32, which is what its upcast is for.
- bitsandbytes' CPU inference repack is off: at the first eval-mode forward on a CPU with AVX512-BF16, a 4-bit layer
  rewrites its weight in place into another layout (and fails on a layer narrower than a quantization block); the
  weights a checkpoint or FSDP shards hold must stay what they were.
"""

from __future__ import annotations

import torch

from toolkit.config import ModelArguments, RunConfig
from toolkit.errors import ConfigError

QLORA_INSTALL = "pip install '.[qlora]'"
# Strategies (toolkit.parallel.accelerator.strategy_name) where training on a quantized base was checked equal to one process
PROVEN = {"load_in_4bit": ("single", "ddp", "deepspeed-zero2", "fsdp2"), "load_in_8bit": ("single",)}
# Where bitsandbytes' 8-bit AdamW was checked (a resume bit for bit). Under FSDP2 (and tensor parallelism) its update
# kernel is handed DTensors, which it has no rule for: the first step fails.
PROVEN_8BIT_OPTIM = ("single", "ddp", "deepspeed-zero2")


def quiet_cpu_kernel_notice() -> None:
    """bitsandbytes 0.50, imported on a CPU with AVX512-BF16 (as peft imports it whenever it is installed), logs a
    warning that an optional kernel package for its CPU inference repack is missing: in every LoRA run, quantized or
    not, though that repack is off here (``no_cpu_repack``). Dropped before bitsandbytes is imported."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: "gemm_4bit_forward from kernels-community" not in record.getMessage())


def quantized_field(args: ModelArguments) -> str | None:
    """'load_in_4bit', 'load_in_8bit' or None."""
    return "load_in_4bit" if args.load_in_4bit else "load_in_8bit" if args.load_in_8bit else None


def layout_name(cfg: RunConfig, strategy: str) -> str:
    """``strategy`` (``toolkit.parallel.accelerator.strategy_name``), or the layout on top of it that it does not name:
    'pipeline parallelism' (on ddp.yaml or fsdp.yaml), 'hsdp' (FSDP2 over a replicate x shard mesh)."""
    from toolkit.env.launcher import launched_parallel_sizes

    if cfg.train.pipeline_parallel_size > 1:
        return "pipeline parallelism"
    if strategy == "fsdp2" and launched_parallel_sizes().get("dp_replicate", 1) > 1:
        return "hsdp"
    return strategy


def check_run(cfg: RunConfig, strategy: str) -> None:
    """Refuse, before the weights load, what a quantized base or 8-bit AdamW was not checked with here."""
    strategy = layout_name(cfg, strategy)
    check_optimizer(cfg, strategy)
    name = quantized_field(cfg.model)
    if name is None:
        return
    if strategy not in PROVEN[name]:
        raise ConfigError(name, f"a {name[8:]} base is not supported under {strategy} (checked: "
                                f"{', '.join(PROVEN[name])}); use another launch config, or a full-precision base")
    if cfg.train.async_save:
        # DCP's get_state_dict (the asynchronous writer's stager) walks the state dict's keys as attributes: an 8-bit
        # base's Linear8bitLt has no attribute SCB (AttributeError at the first save), and a 4-bit base's quant-state
        # keys make its strict set_state_dict refuse the resume; the synchronous path handles both
        raise ConfigError("async_save", f"with a quantized base ({name}) is not supported (DCP's state dict of the "
                                        "bitsandbytes layers); set async_save: false")
    if cfg.data.streaming:
        raise ConfigError(name, "a quantized base on a stream (streaming: true) is not checked here; set streaming: "
                                "false")
    _check_bf16_sharded(name, strategy)
    if cfg.train.loss_chunk_size:
        raise ConfigError(name, "loss_chunk_size with a quantized base is not checked here; set loss_chunk_size: 0")
    if cfg.model.ref_model_name_or_path or cfg.train.precompute_ref_log_probs:
        field = "ref_model_name_or_path" if cfg.model.ref_model_name_or_path else "precompute_ref_log_probs"
        raise ConfigError(field, f"DPO on a quantized base ({name}) takes the base with its adapter disabled as the "
                                 "reference (no copy, no precomputed pass); unset it")


def _check_bf16_sharded(name: str, strategy: str) -> None:
    # Found by the capability matrix (tests/matrix, cells lm-zero2-qlora4-...-bf16 and its FSDP2 twin): on CPU ranks,
    # bf16 autocast with the 4-bit base sharded by ZeRO-2 or FSDP2 fails in bitsandbytes' CPU 4-bit kernel at the
    # first forward ("shape '[96, 16]' is invalid for input of size 768"); one process and DDP run (checked).
    import os

    from toolkit.env.launcher import has_accelerator

    bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"
    if bf16 and strategy not in ("single", "ddp") and not has_accelerator():
        raise ConfigError(name, f"a {name[8:]} base with mixed_precision bf16 under {strategy} fails on CPU ranks "
                                "(bitsandbytes' CPU kernel): use mixed_precision no there, or ddp.yaml / one process")


# The fields that decide how the frozen base is quantized: a checkpoint holds the adapters and their optimizer state,
# and a resumed run loads the base again from model_name_or_path, so it must quantize it as before
BASE_FIELDS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "torch_dtype")


def base_record(args: ModelArguments) -> dict | None:
    """How the base is quantized (``BASE_FIELDS`` that apply), or None for a full-precision base: written into every
    checkpoint (``toolkit.checkpointing.resume``)."""
    name = quantized_field(args)
    if name is None:
        return None
    fields = BASE_FIELDS if name == "load_in_4bit" else ("load_in_4bit", "load_in_8bit", "torch_dtype")
    return {f: getattr(args, f) for f in fields}


def check_same_base(checkpoint: str, saved: dict | None, now: dict | None) -> None:
    """Refuse a resume whose base is quantized otherwise than the checkpoint's (``base_record``s). The adapters would
    train on another function of the base: a 4-bit layout of the other quant type is read as this one's codes
    (silently), a double-quantized scale differs, and the full-precision, 8-bit or other-dtype layouts do not fit the
    checkpoint's tensors at all (after the weights loaded)."""
    plain = {"load_in_4bit": False, "load_in_8bit": False}
    old, new = saved or plain, now or plain
    for field in BASE_FIELDS:
        if old.get(field) != new.get(field):
            raise ConfigError(field, f"cannot resume from {checkpoint}: its base was loaded with {field} "
                                     f"{old.get(field)!r}, now {new.get(field)!r}; the frozen base is loaded again on "
                                     "resume and must be quantized as before: resume with the checkpoint's value, or "
                                     "start a new output_dir")


def check_optimizer(cfg: RunConfig, strategy: str) -> None:
    """bitsandbytes' 8-bit AdamW (``optim: adamw_bnb_8bit`` / ``paged_adamw_8bit``) only where it was checked
    (``strategy``: ``layout_name``'s)."""
    optim = cfg.train.optim
    if optim.endswith("_8bit") and strategy not in PROVEN_8BIT_OPTIM:
        raise ConfigError("optim", f"{optim} (bitsandbytes' 8-bit AdamW) is not supported under {strategy} (checked: "
                                   f"{', '.join(PROVEN_8BIT_OPTIM)}); use optim: adamw_torch, or another launch config")


def compute_dtype(args: ModelArguments, config) -> torch.dtype:
    """``torch_dtype``, 'auto' being the checkpoint's (float32 if it names none)."""
    if args.torch_dtype != "auto":
        return getattr(torch, args.torch_dtype)
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def bnb_config(args: ModelArguments, config):
    """transformers' ``BitsAndBytesConfig`` of the fields. transformers keeps the output head (a causal LM's, a
    classifier's new one: the last module) in full precision by itself."""
    from transformers import BitsAndBytesConfig

    dtype = compute_dtype(args, config)
    if args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.bnb_4bit_quant_type,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=args.use_bnb_nested_quant,
                              bnb_4bit_quant_storage=dtype)


def no_cpu_repack(model) -> None:
    """Turn off bitsandbytes' in-place CPU inference repack on every 4-bit layer (the module's docstring)."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def quantized_bytes(model) -> dict:
    """Measured storage of the quantized layers: {"weights": packed weight bytes, "constants": quantization
    constants (absmax, and with double quantization its own absmax and code), "params": the weights' element count}."""
    import bitsandbytes as bnb

    out = {"weights": 0, "constants": 0, "params": 0}
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            out["weights"] += w.numel() * w.element_size()
            out["params"] += module.in_features * module.out_features
            state = w.quant_state
            tensors = [state.absmax]
            if state.nested:
                tensors += [state.state2.absmax, state.state2.code, state.offset]
            out["constants"] += sum(t.numel() * t.element_size() for t in tensors)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            w = module.weight
            out["weights"] += w.numel() * w.element_size()
            out["params"] += w.numel()
            scb = getattr(w, "SCB", None)
            out["constants"] += scb.numel() * scb.element_size() if scb is not None else 0
    return out


def eight_bit_adamw(groups, args, paged: bool):
    """bitsandbytes' 8-bit AdamW (``optim: adamw_bnb_8bit`` / ``paged_adamw_8bit``: blockwise-quantized moments,
    2 bytes a parameter instead of 8; paged: the state in memory the driver can move to the host under pressure)."""
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    return cls(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)


BLOCK = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
NESTED_BLOCK = 256  # double quantization: the absmax values quantized to 8 bits in blocks of 256
CODE_BYTES = 256 * 4 + 4  # double quantization's per-layer code book (256 fp32 values) and offset (one fp32)


def layer_bytes(numel: int, bits: int, nested: bool = False, rows: int = 0) -> int:
    """Bytes one quantized linear layer of ``numel`` weights holds: 4 bits: the packed weights (0.5 byte each) and
    one absmax per block of 64 (fp32: 0.0625 byte a weight; nested: one byte per block, plus one fp32 per 256 blocks
    and the code book); 8 bits: one byte each and one fp32 scale per output row (``rows``)."""
    if bits == 8:
        return numel + 4 * rows
    blocks = -(-numel // BLOCK)
    constants = blocks + 4 * -(-blocks // NESTED_BLOCK) + CODE_BYTES if nested else 4 * blocks
    return -(-numel // 2) + constants


def quantized_layers(net) -> list[tuple[int, int]]:
    """(weights, output rows) of each linear layer transformers quantizes in ``net`` (any device, meta included):
    every ``nn.Linear`` and GPT-2 ``Conv1D`` but the output head, tied weights and the last module
    (transformers' ``get_keys_to_not_convert``, which its bitsandbytes loader applies)."""
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert

    skip = get_keys_to_not_convert(net)
    out = []
    for name, module in net.named_modules():
        if (type(module) is torch.nn.Linear or isinstance(module, Conv1D)) and not any(
                name == k or name.endswith("." + k) for k in skip):
            w = module.weight
            out.append((w.numel(), w.shape[0] if type(module) is torch.nn.Linear else w.shape[1]))
    return out


def optimizer_state_bytes(optimizer, params=None) -> int:
    """Bytes of an optimizer's state tensors for ``params`` (all when None), each storage once (torch's AdamW:
    exp_avg and exp_avg_sq, 8 bytes a parameter in fp32; bitsandbytes' 8-bit AdamW: state1 and state2 in uint8, an
    fp32 absmax per block of 256 each, and its two 256-value maps shared by every parameter)."""
    seen, total = set(), 0
    for p in params if params is not None else optimizer.state:
        for v in optimizer.state[p].values():
            if torch.is_tensor(v) and v.dim() > 0 and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total

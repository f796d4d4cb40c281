"""LoRA adapters through peft: wrap the model, export the adapter, merge it into full weights.

Only the adapters (and ``lora_modules_to_save``) get gradients, so the optimizer (``toolkit.training.loop.build_optimizer``
takes the parameters that require grad) holds their state only; the base weights are frozen and come out of training
unchanged, bit for bit. Every strategy works through the same code (measured: the adapters trained under DDP,
ZeRO-2, ZeRO-3 and FSDP2 are identical: docs/strategies.md#lora-under-every-strategy):

- the export gathers the full state dict like any other (``checkpoint.full_state_dict``: ZeRO-3 through
  ``stage3_gather_16bit_weights_on_model_save``; on other ranks it is None under ZeRO-3 and ``{}`` under FSDP2) and
  peft's ``save_pretrained(state_dict=...)`` keeps the adapter's tensors of it: ``adapter_model.safetensors`` +
  ``adapter_config.json``, loadable with ``PeftModel.from_pretrained(base, folder)``;
- the merge (``merge_lora``) runs on the main process on a fresh CPU copy built from that state dict: under ZeRO-3
  and FSDP the trained model's own parameters are shards, and peft's in-place merge would need them whole.
"""

from __future__ import annotations

import os

from toolkit.config import ModelArguments
from toolkit.errors import ConfigError

MERGED = "merged"  # final/merged/: base + adapter as one plain model (merge_lora)


def check_available() -> None:
    from toolkit.models.quantization import quiet_cpu_kernel_notice

    quiet_cpu_kernel_notice()  # peft imports bitsandbytes where it is installed
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError("use_peft", "LoRA needs peft: pip install 'peft>=0.17' (or set use_peft: false)") from None


def target_modules(args: ModelArguments):
    """peft's ``target_modules``: None (peft's default for the model type), 'all-linear', or the list."""
    names = args.lora_target_modules
    if not names:
        return None
    if names == ["all-linear"]:
        return "all-linear"
    if "all-linear" in names:
        raise ConfigError("lora_target_modules", f"all-linear stands alone; got {names}")
    return list(names)


def lora_config(args: ModelArguments, task_type: str):
    """peft's ``LoraConfig`` from the recipe's LoRA fields (``toolkit plan --lora-r`` counts the adapters from it)."""
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=target_modules(args), modules_to_save=args.lora_modules_to_save,
                      task_type=task_type)


def wrap(model, config):
    """``peft.get_peft_model``, without the FutureWarning peft 0.21 triggers by calling transformers 5's deprecated
    ``is_gradient_checkpointing`` (once per wrapped model: nothing a user can change)."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def apply_lora(model, args: ModelArguments, task_type: str, log=print):
    """``model`` wrapped by peft with the recipe's LoRA fields. The base weights stay in the model (frozen)."""
    config = lora_config(args, task_type)
    targets = target_modules(args)
    if targets not in (None, "all-linear"):
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [t for t in targets if t not in present]
        if missing:
            raise ConfigError("lora_target_modules", f"no module named {missing} in this {model.config.model_type} "
                                                     f"model; its linear layers include "
                                                     f"{sorted(_linear_names(model))[:12]}, or use all-linear")
    try:
        peft_model = wrap(model, config)
    except ValueError as e:  # e.g. no default target modules for this model type
        raise ConfigError("lora_target_modules", f"peft cannot place LoRA on this model: {e}") from None
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log(f"LoRA r={args.lora_r} alpha={args.lora_alpha} on {sorted(peft_model.peft_config['default'].target_modules)}"
        f": {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)")
    return peft_model


def _linear_names(model) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def save_adapter(unwrapped, state_dict: dict, path: str) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` from the gathered full state dict (main process), and
    the base model's config as trained (``config.json``: a classifier's labels, dropout as set) for ``load_exported``."""
    unwrapped.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    config = unwrapped.get_base_model().config
    quantized = getattr(config, "quantization_config", None)
    if quantized is not None:  # the base's own config: load_exported quantizes it again as the run's fields say
        del config.quantization_config
    try:
        config.save_pretrained(path)
    finally:
        if quantized is not None:
            config.quantization_config = quantized


def save_merged(unwrapped, state_dict: dict, path: str) -> None:
    """Base + adapter as one plain model, written with ``save_pretrained`` (main process): a fresh CPU copy of the
    architecture takes the gathered weights, peft merges (W + B A x alpha / r) and unloads the adapter layers."""
    import copy

    import torch

    base = unwrapped.get_base_model()
    if getattr(base, "hf_quantizer", None) is not None:
        fresh = wrap(_dequantized_copy(base), copy.deepcopy(unwrapped.peft_config["default"]))
        adapter = {k: v for k, v in state_dict.items() if "lora_" in k or "modules_to_save" in k}
        missing, unexpected = fresh.load_state_dict(adapter, strict=False)
        missing = [k for k in missing if "lora_" in k or "modules_to_save" in k]
    else:
        with torch.device("cpu"):
            fresh = type(base)._from_config(copy.deepcopy(base.config), dtype=next(iter(state_dict.values())).dtype)
        fresh = wrap(fresh, copy.deepcopy(unwrapped.peft_config["default"]))
        missing, unexpected = fresh.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not _is_tied_alias(fresh, k)]
    if missing or unexpected:
        raise RuntimeError(f"merging LoRA: the gathered weights do not fit the model (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    merged = fresh.merge_and_unload()
    os.makedirs(path, exist_ok=True)
    merged.save_pretrained(path, safe_serialization=True)


def _dequantized_copy(base):
    """A quantized base loaded again from its own folder on the CPU (the same deterministic quantization as the
    frozen base trained on) and dequantized (transformers' ``dequantize``: every quantized layer back to a plain
    ``nn.Linear``) in the dtype of its unquantized weights (the compute dtype): what adapters merge into."""
    import copy

    config = copy.deepcopy(base.config)
    del config.quantization_config
    dtype = base.get_input_embeddings().weight.dtype
    fresh = type(base).from_pretrained(base.name_or_path, config=config, dtype=dtype, device_map={"": "cpu"},
                                       quantization_config=copy.deepcopy(base.hf_quantizer.quantization_config))
    return fresh.dequantize(dtype=dtype)


def _is_tied_alias(model, name: str) -> bool:
    """A name that shares its tensor with another (GPT-2's lm_head.weight is wte.weight): absent from a state dict
    that writes tied weights once."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unique = dict(model.named_parameters())
    return name in params and name not in unique


def load_exported(folder: str, args: ModelArguments):
    """A model exported by a run, for inference in this process: the full weights, or the base model
    (``model_name_or_path``) with the adapter from ``folder`` (``PeftModel.from_pretrained``)."""
    import transformers

    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        config = transformers.AutoConfig.from_pretrained(folder)
        auto = "AutoModelForSequenceClassification" if _is_classifier(config) else "AutoModelForCausalLM"
        return getattr(transformers, auto).from_pretrained(folder)
    from peft import PeftConfig, PeftModel

    from toolkit.models.loading import load_model

    peft_config = PeftConfig.from_pretrained(folder)
    auto = "AutoModelForSequenceClassification" if peft_config.task_type == "SEQ_CLS" else "AutoModelForCausalLM"
    config = transformers.AutoConfig.from_pretrained(folder)  # the base's config as trained (a classifier's labels)
    return PeftModel.from_pretrained(load_model(args, config=config, auto_class=auto), folder)


def _is_classifier(config) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))

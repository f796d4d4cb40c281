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
from contextlib import contextmanager

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


# The fields that shape the adapters a checkpoint holds, recorded in it (``toolkit.checkpointing.resume``): another
# lora_r, target modules or modules to save load the saved tensors into other shapes or layers (a size-mismatch
# traceback after the data and the weights loaded; on a quantized base, whose load is not strict, other target modules
# silently: the saved adapters skipped, new ones from zero), another use_peft a full model's weights into adapters or
# the reverse, and another lora_alpha scales the same adapters by another alpha / r: another function, silently.
# lora_dropout is not one of them: a regulariser of the training to come (every saved tensor means what it meant, and
# evaluation and the export never drop), so it may change on resume as a learning rate may.
ADAPTER_FIELDS = ("use_peft", "lora_r", "lora_alpha", "lora_target_modules", "lora_modules_to_save")


def adapter_record(args: ModelArguments) -> dict:
    """The ``ADAPTER_FIELDS`` of a run (``use_peft`` alone without LoRA), written into every checkpoint."""
    return {f: getattr(args, f) for f in ADAPTER_FIELDS} if args.use_peft else {"use_peft": False}


def check_same_adapters(checkpoint: str, saved: dict, now: dict) -> None:
    """Refuse a resume whose LoRA layout or scaling differs from the checkpoint's (``adapter_record``s), before the
    weights load."""
    for field in ADAPTER_FIELDS:
        if saved.get(field) != now.get(field):
            why = ("its adapters would be scaled by another alpha / r: another function" if field == "lora_alpha"
                   else "its weights fit only the model they were trained as (use_peft, lora_r, lora_target_modules "
                        "and lora_modules_to_save make its LoRA layout)")
            raise ConfigError(field, f"cannot resume from {checkpoint}: it was trained with {field} "
                                     f"{saved.get(field)!r}, now {now.get(field)!r}; {why}: resume with the "
                                     "checkpoint's value, or start a new output_dir")


def lora_config(args: ModelArguments, task_type: str):
    """peft's ``LoraConfig`` from the recipe's LoRA fields (``toolkit plan --lora-r`` counts the adapters from it)."""
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=target_modules(args), modules_to_save=args.lora_modules_to_save,
                      task_type=task_type)


@contextmanager
def _quiet_peft():
    """Without the FutureWarning peft 0.21 triggers by calling transformers 5's deprecated
    ``is_gradient_checkpointing`` (once per wrapped or loaded model: nothing a user can change)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        yield


def wrap(model, config):
    """``peft.get_peft_model``, quietly (``_quiet_peft``), with adapters of the whole layer's widths on a model split
    by tensor parallelism (``_whole_widths``)."""
    from peft import get_peft_model

    with _quiet_peft(), _whole_widths():
        return get_peft_model(model, config)


@contextmanager
def _whole_widths():
    """peft's LoRA layers sized by the base layer's whole widths (``in_features``, ``out_features``) where its weight is
    a tensor-parallel DTensor. peft 0.21 sizes them by the rank's shard (``to_local().shape``) and keeps that width in
    the shard's ``nn.Linear`` (lora_A's ``in_features`` under a rowwise layer, lora_B's ``out_features`` under a
    colwise one), while transformers 5's TP hooks read the module's ``in_features`` / ``out_features`` as the whole
    width: the first forward failed ("shape '[384, 8]' is invalid", docs/pitfalls.md#peft-tp-lora-widths). Whole-width
    adapters are also initialised as one process initialises them (the same draws of the same seed), and peft then
    shards them itself (``add_lora_tp_hooks_dtensor``: each rank keeps its slice of the same tensor)."""
    import torch
    from peft.tuners.lora.layer import LoraLayer

    sharded = LoraLayer._get_in_out_features

    def whole(self, module):
        from torch.distributed.tensor import DTensor

        if isinstance(module, torch.nn.Linear) and isinstance(module.weight, DTensor):
            return module.in_features, module.out_features
        return sharded(self, module)

    LoraLayer._get_in_out_features = whole
    try:
        yield
    finally:
        LoraLayer._get_in_out_features = sharded


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


FSDP1_WRAPPER = "_fsdp_wrapped_module."  # in the module names of a model FSDP1 wrapped, above each unit it wraps


def peft_names(unwrapped):
    """The model whose module names peft reads the adapter's keys from (``save_pretrained`` keeps the state dict's
    entries under its LoRA layers' names): ``unwrapped`` itself, or under FSDP1 a copy of its architecture on the meta
    device wrapped by its LoRA config. FSDP1 puts ``_fsdp_wrapped_module.`` inside the names of the modules below each
    unit it wraps (every transformer block), where its gathered state dict has none; peft 0.21 strips only a leading
    one, so it found none of the adapter's keys and wrote an adapter with no tensor (docs/pitfalls.md#peft-fsdp1-names).
    The copy has the names the state dict has, and costs no memory."""
    import copy

    import torch

    if not any(FSDP1_WRAPPER in name for name, _ in unwrapped.named_modules()):
        return unwrapped
    base = unwrapped.get_base_model()
    with torch.device("meta"):
        fresh = type(base)._from_config(copy.deepcopy(base.config))
    fresh.name_or_path = base.name_or_path  # what adapter_config.json names as the base
    with torch.device("meta"):
        return wrap(fresh, copy.deepcopy(unwrapped.peft_config["default"]))


def save_adapter(unwrapped, state_dict: dict, path: str) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` from the gathered full state dict (main process), and
    the base model's config as trained (``config.json``: a classifier's labels, dropout as set) for ``load_exported``."""
    peft_names(unwrapped).save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    config = unwrapped.get_base_model().config
    quantized = getattr(config, "quantization_config", None)
    if quantized is not None:  # the base's own config: load_exported quantizes it again as the run's fields say
        del config.quantization_config
    try:
        config.save_pretrained(path)
    finally:
        if quantized is not None:
            config.quantization_config = quantized


BASE = "base"  # final/base/: a classifier adapter's base as the classifier it trained (save_classifier_base)


def save_classifier_base(unwrapped, path: str, final: str) -> None:
    """A classifier's adapter (peft's SEQ_CLS) in ``path``, to be moved to ``final``, made to load alone with
    ``AutoPeftModelForSequenceClassification.from_pretrained(final)``: peft loads the base named in
    adapter_config.json with that base's own config, whose head (2 labels by default) does not fit the trained head
    (a size mismatch: docs/pitfalls.md#peft-auto-classifier). So ``final/base/`` holds the base as the classifier it
    trained: its config as trained (labels, pad token) beside the base's own weight files, hard links where the file
    system allows (no space), copies otherwise, and the adapter names it. Nothing when the base's weights are no
    files of one folder (a base that was itself an adapter folder: the toolkit's loaders read the run's config.yaml
    either way)."""
    import json
    import shutil

    from transformers.utils import cached_file

    base = unwrapped.get_base_model()
    try:
        # the files it loaded from (a Hub model's are in the cache): no request
        source = os.path.dirname(cached_file(base.name_or_path, "config.json", local_files_only=True))
    except OSError:
        return
    weights = [f for f in sorted(os.listdir(source)) if f.endswith((".safetensors", ".bin", ".index.json"))
               and not f.startswith("adapter_")]
    if not weights:
        return
    folder = os.path.join(path, BASE)
    os.makedirs(folder, exist_ok=True)
    for name in weights:
        try:
            os.link(os.path.realpath(os.path.join(source, name)), os.path.join(folder, name))
        except OSError:  # another file system: a copy
            shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))
    shutil.copyfile(os.path.join(path, "config.json"), os.path.join(folder, "config.json"))  # save_adapter's
    adapter_config = os.path.join(path, "adapter_config.json")
    with open(adapter_config) as f:
        values = json.load(f)
    values["base_model_name_or_path"] = os.path.join(os.path.abspath(final), BASE)
    with open(adapter_config, "w") as f:
        json.dump(values, f, indent=2, sort_keys=True)


def save_merged(unwrapped, state_dict: dict, path: str) -> None:
    """Base + adapter as one plain model, written with ``save_pretrained`` (main process): a fresh CPU copy of the
    architecture takes the gathered weights, peft merges (W + B A x alpha / r) and unloads the adapter layers."""
    import copy

    import torch

    from toolkit.models.loading import restore_conv1d_layers

    base = unwrapped.get_base_model()
    if getattr(base, "hf_quantizer", None) is not None:
        fresh = wrap(_dequantized_copy(base), copy.deepcopy(unwrapped.peft_config["default"]))
        adapter = {k: v for k, v in state_dict.items() if "lora_" in k or "modules_to_save" in k}
        missing, unexpected = fresh.load_state_dict(adapter, strict=False)
        missing = [k for k in missing if "lora_" in k or "modules_to_save" in k]
    else:
        config = copy.deepcopy(base.config)
        # a tensor-parallel base's config carries transformers' distributed_config: the copy's save_pretrained, on
        # this process alone, would wait in a barrier for the other ranks (which the export's own barrier then met:
        # a hang one collective later). The copy is one plain model.
        if getattr(config, "distributed_config", None) is not None:
            config.distributed_config = None
        with torch.device("cpu"):
            fresh = type(base)._from_config(config, dtype=next(iter(state_dict.values())).dtype)
        fresh = wrap(fresh, copy.deepcopy(unwrapped.peft_config["default"]))
        missing, unexpected = fresh.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not _is_tied_alias(fresh, k)]
    if missing or unexpected:
        raise RuntimeError(f"merging LoRA: the gathered weights do not fit the model (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    merged = fresh.merge_and_unload()
    restore_conv1d_layers(merged)
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


def adapter_tensors(folder: str):
    """What an adapter export in ``folder`` must hold: ([[name] of each adapter tensor], {name: shape} of those and of
    the embedding layers peft may write beside them), from its base's architecture (config.json, on the meta device)
    wrapped by its adapter_config.json; None for an architecture transformers does not ship
    (``toolkit.checkpointing.checkpoint.check_export``)."""
    import warnings

    import torch
    import transformers
    from peft import PeftConfig, get_peft_model_state_dict

    from toolkit.models.loading import empty_model

    peft_config = PeftConfig.from_pretrained(folder)
    auto = "AutoModelForSequenceClassification" if peft_config.task_type == "SEQ_CLS" else "AutoModelForCausalLM"
    base = empty_model(transformers.AutoConfig.from_pretrained(folder), auto)
    if base is None:
        return None
    base.name_or_path = peft_config.base_model_name_or_path  # as it was trained: peft warns of a renamed base
    with torch.device("meta"), warnings.catch_warnings():
        # a GPT-2 adapter trained on 4-bit layers (fan_in_fan_out false) meets the Conv1D layers it merges into:
        # peft warns and transposes its update, which leaves the adapter's own shapes as they are
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
        model = wrap(base, peft_config)
    # save_embedding_layers given: peft's "auto" would ask the Hub for the base's config
    required = get_peft_model_state_dict(model, save_embedding_layers=False)
    allowed = get_peft_model_state_dict(model, save_embedding_layers=True)
    return [[name] for name in required], {name: list(t.shape) for name, t in {**allowed, **required}.items()}


def load_exported(folder: str, args: ModelArguments):
    """A model exported by a run, for inference in this process: the full weights, or the base model
    (``model_name_or_path``) with the adapter from ``folder`` (``PeftModel.from_pretrained``)."""
    import transformers

    from toolkit.models.loading import is_adapter_folder
    from toolkit.models.quantization import quiet_cpu_kernel_notice

    quiet_cpu_kernel_notice()  # peft, and transformers' loading, import bitsandbytes where it is installed
    if not is_adapter_folder(folder):
        config = transformers.AutoConfig.from_pretrained(folder)
        auto = "AutoModelForSequenceClassification" if _is_classifier(config) else "AutoModelForCausalLM"
        return getattr(transformers, auto).from_pretrained(folder)
    from peft import PeftConfig, PeftModel

    from toolkit.models.loading import load_model

    peft_config = PeftConfig.from_pretrained(folder)
    auto = "AutoModelForSequenceClassification" if peft_config.task_type == "SEQ_CLS" else "AutoModelForCausalLM"
    config = transformers.AutoConfig.from_pretrained(folder)  # the base's config as trained (a classifier's labels)
    base = load_model(args, config=config, auto_class=auto)
    with _quiet_peft():
        return PeftModel.from_pretrained(base, folder)


def _is_classifier(config) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))

"""The DPO reference model: what the policy's log-ratios are taken against, kept frozen for the whole run.

Three kinds, TRL's (``precompute_ref_log_probs``, ``ref_model``, peft's adapter):

- ``live`` (the default): a frozen copy (``requires_grad`` off, eval mode, no optimizer state) of the starting weights
  or of ``ref_model_name_or_path``, loaded after the policy is prepared and sharded as the policy is: under ZeRO-3 a
  DeepSpeed engine of its own with the run's stage-3 config (TRL's ``prepare_deepspeed``: no optimizer; stage 0 under
  ZeRO-1/2), under FSDP2 accelerate's ``fsdp2_prepare_model`` (the policy's wrap policy, per transformer block);
  otherwise whole on the device. It is never registered with the Accelerator, so checkpoints hold the policy alone.
- ``adapter``: with ``use_peft`` and no ``ref_model_name_or_path``, the policy with its LoRA adapter disabled
  (peft's ``disable_adapter``): the frozen base is the starting weights, and no copy is loaded.
- ``precomputed`` (``precompute_ref_log_probs: true``): ``toolkit.preference.DPO.add_reference`` evaluates a whole copy
  once before training and frees it; the values travel with the rows.

``fingerprint`` hashes the frozen weights a rank holds (its shard under ZeRO-3 and FSDP2), so a run can show that its
reference never changed (``summary.json``'s ``reference``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import torch

from toolkit.config import ModelArguments
from toolkit.distributed import launched_parallel_sizes, launched_strategy, plain_loading
from toolkit.errors import ConfigError
from toolkit.model import enable_chunked_loss, load_model


def reference_kind(cfg) -> str:
    """'precomputed', 'adapter' or 'live' (module docstring)."""
    if cfg.train.precompute_ref_log_probs:
        return "precomputed"
    if cfg.model.use_peft and not cfg.model.ref_model_name_or_path:
        return "adapter"
    return "live"


def check_reference(cfg) -> None:
    """Refuse, before any work, what cannot give a reference: no starting weights to copy, or a launch under which a
    live copy is not sharded here (FSDP1, tensor parallelism)."""
    if not (cfg.model.model_name_or_path or cfg.model.ref_model_name_or_path):
        raise ConfigError("model_name_or_path", "DPO's reference is the starting weights: set model_name_or_path "
                                                "(or ref_model_name_or_path), not a model built from a config")
    if reference_kind(cfg) != "live":
        return
    fsdp1 = launched_strategy() == "fsdp" and os.environ.get("FSDP_VERSION", "1") == "1"
    if fsdp1 or launched_parallel_sizes().get("tp", 1) > 1:
        raise ConfigError("precompute_ref_log_probs", f"a live reference copy is not sharded under "
                                                      f"{'FSDP1' if fsdp1 else 'tensor parallelism'} here; set "
                                                      "precompute_ref_log_probs: true (one pass before training), "
                                                      "or launch with fsdp.yaml (FSDP2) or a ZeRO config")


def reference_arguments(cfg) -> ModelArguments:
    """The reference's model fields: the policy's without LoRA, from ``ref_model_name_or_path`` when set."""
    path = cfg.model.ref_model_name_or_path
    if not path:
        return dataclasses.replace(cfg.model, use_peft=False)
    return dataclasses.replace(cfg.model, model_name_or_path=path, config_name=None, config_overrides=None,
                               gguf_file=None, use_peft=False)


def load_whole(cfg, accelerator):
    """The reference's weights loaded whole in this process (outside ZeRO-3's partitioning), in eval mode."""
    with plain_loading(accelerator):
        model = load_model(reference_arguments(cfg))
    return model.eval()


def load_live(cfg, accelerator, block_size: int):
    """The live reference copy, frozen and prepared for the run's strategy (module docstring)."""
    model = load_model(reference_arguments(cfg))  # under ZeRO-3 with zero3_init_flag: partitioned as it loads
    model.requires_grad_(False)
    model.eval()
    if cfg.train.loss_chunk_size:  # as the policy: its evaluation never holds a whole micro-batch's logits
        rows = 2 * max(cfg.train.per_device_train_batch_size, cfg.train.per_device_eval_batch_size) * block_size
        enable_chunked_loss(model, cfg.train.loss_chunk_size, max_positions=rows, max_eval_positions=rows)
    kind = accelerator.distributed_type.value
    if kind == "DEEPSPEED":
        return _deepspeed(model, accelerator)
    if kind == "FSDP" and accelerator.is_fsdp2:
        from accelerate.utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, model).eval()
    return model.to(accelerator.device)


def _deepspeed(model, accelerator):
    """TRL's ``prepare_deepspeed``: an engine of the run's config without optimizer or scheduler; ZeRO-3 shards the
    reference as it shards the policy, ZeRO-1/2 (which shard no weights) become stage 0, the copy whole per rank."""
    import copy

    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config["zero_optimization"].pop("offload_optimizer", None)
    if config["zero_optimization"].get("stage") != 3:
        config["zero_optimization"]["stage"] = 0
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def reshard(model) -> None:
    """Shard an FSDP2 reference again after its forward: FSDP2 keeps the root's and the output head's parameters
    gathered after a forward for the backward that follows, and a reference has no backward (measured: the tiny
    GPT-2's tied embedding stayed whole on both ranks after the first forward). A no-op for any other model."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def frozen_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The frozen parameters this rank holds, by name: the local shard of a ZeRO-3 (``ds_tensor``) or FSDP2 (a
    DTensor's local part) parameter."""
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        local = getattr(p, "ds_tensor", None)
        if local is None:
            local = p.to_local() if hasattr(p, "to_local") else p
        out.append((name, local.detach()))
    return out


def fingerprint(model) -> dict:
    """sha256 of this rank's frozen weights (names and bytes) and how many elements it holds."""
    h, numel = hashlib.sha256(), 0
    for name, tensor in frozen_tensors(model):
        h.update(name.encode())
        h.update(tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes())
        numel += tensor.numel()
    return {"sha256": h.hexdigest(), "numel": numel}

"""The DPO reference model: what the policy's log-ratios are taken against, kept frozen for the whole run.

Three kinds, TRL's (``precompute_ref_log_probs``, ``ref_model``, peft's adapter):

- ``live`` (the default): a frozen copy (``requires_grad`` off, eval mode, no optimizer state) of the starting weights
  or of ``ref_model_name_or_path``, loaded after the policy is prepared and sharded as the policy is: under ZeRO-3 a
  DeepSpeed engine of its own with the run's stage-3 config (TRL's ``prepare_deepspeed``: no optimizer; stage 0 under
  ZeRO-1/2), under FSDP2 accelerate's ``fsdp2_prepare_model`` (the policy's wrap policy, per transformer block);
  otherwise whole on the device. It is never registered with the Accelerator, so checkpoints hold the policy alone.
- ``adapter``: with ``use_peft`` and no ``ref_model_name_or_path``, the policy with its LoRA adapter disabled
  (peft's ``disable_adapter``): the frozen base is the starting weights, and no copy is loaded.
- ``precomputed`` (``precompute_ref_log_probs: true``): ``toolkit.tasks.dpo.DPO.add_reference`` evaluates a whole copy
  on the device once before training, each rank its share of the pairs under the run's precision, and frees it; the
  values travel with the rows. They are kept in the run folder (``layout.reference_logps_file``) under a key of the
  reference's fingerprint, the pairs and the precision (``precomputed_key``), so a resume or a restart reads them
  back, and a changed reference or data computes them again.

``fingerprint`` hashes the frozen weights a rank holds (its shard under ZeRO-3 and FSDP2), so a run can show that its
reference never changed (``summary.json``'s ``reference``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch

from toolkit import layout
from toolkit.config import ModelArguments
from toolkit.env.launcher import launched_parallel_sizes, launched_strategy
from toolkit.errors import ConfigError
from toolkit.models.loading import enable_chunked_loss, load_model, plain_loading


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


def load_whole(cfg, accelerator, block_size: int):
    """The reference's weights loaded whole in this process (outside ZeRO-3's partitioning), frozen, in eval mode,
    its loss chunked as the live copy's, on the accelerator's device."""
    with plain_loading(accelerator):
        model = load_model(reference_arguments(cfg))
    _freeze(model, cfg, block_size)
    return model.to(accelerator.device, dtype=_deepspeed_dtype(accelerator))


def _deepspeed_dtype(accelerator) -> torch.dtype | None:
    """The dtype DeepSpeed runs weights in under mixed precision: its engine casts the model (the live reference's
    and the policy's) to bf16/fp16 instead of autocasting (accelerate's autocast is off under DeepSpeed), so a
    precomputed pass gives the live reference's values only in that dtype. None: keep the loaded dtype."""
    if accelerator.distributed_type.value != "DEEPSPEED":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)


def _freeze(model, cfg, block_size: int) -> None:
    """No gradients, eval mode, and with ``loss_chunk_size`` the chunked loss, as the policy's: its evaluation never
    holds a whole micro-batch's logits."""
    model.requires_grad_(False)
    model.eval()
    if cfg.train.loss_chunk_size:
        rows = 2 * max(cfg.train.per_device_train_batch_size, cfg.train.per_device_eval_batch_size) * block_size
        enable_chunked_loss(model, cfg.train.loss_chunk_size, max_positions=rows, max_eval_positions=rows)


def load_live(cfg, accelerator, block_size: int):
    """The live reference copy, frozen and prepared for the run's strategy (module docstring)."""
    model = load_model(reference_arguments(cfg))  # under ZeRO-3 with zero3_init_flag: partitioned as it loads
    _freeze(model, cfg, block_size)
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


def precomputed_key(model, data: dict[str, str], accelerator, cfg) -> str:
    """What precomputed log-probabilities depend on, hashed: the reference's weights (``fingerprint`` of the whole
    copy), each split's pairs (``data``: name -> hash), and how they were computed (mixed precision, device type,
    chunked loss). The world size is not in it: the pairs are evaluated in the same chunks on any."""
    record = {"reference": fingerprint(model)["sha256"], "data": data, "mixed_precision": accelerator.mixed_precision,
              "device": accelerator.device.type, "loss_chunk_size": cfg.train.loss_chunk_size}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]


def write_precomputed(path: str, values: dict[str, dict[str, torch.Tensor]]) -> None:
    """``values`` ({split: {column: tensor}}) written to ``path`` atomically (a temporary file, flushed, then
    renamed: a run killed while writing leaves no file a restart would trust), and the folder's files of other keys
    (another reference or data) removed. Main process only."""
    from safetensors.torch import save_file

    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = path + layout.TMP_SUFFIX
    save_file({f"{split}/{column}": t.contiguous() for split, columns in values.items() for column, t in columns.items()},
              tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    layout.fsync_dir(folder)
    for name in os.listdir(folder):
        if os.path.join(folder, name) != path:
            os.remove(os.path.join(folder, name))


def read_precomputed(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """What ``write_precomputed`` wrote: {split: {column: tensor}}."""
    from safetensors.torch import load_file

    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(path).items():
        split, column = key.split("/")
        out.setdefault(split, {})[column] = tensor
    return out

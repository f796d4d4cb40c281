"""A checkpoint written in a format this launch cannot load as is, converted into one it can, beside the original.

``toolkit.checkpointing.resume.load_plan`` decides (before the weights load) whether a checkpoint loads as written
or needs one of these; the original is never modified, the converted copy is written to
``<checkpoint>.<kind>.tmp``, flushed, and renamed to ``<checkpoint>.<kind>`` (``toolkit.layout.converted_dir``), so an
interrupted conversion never leaves a folder that looks complete, and a second resume reuses the finished one. The
copy records the fingerprint of the original it came from (``layout.fingerprint``, in ``converted_from.json``): when
``step-N`` was saved again since (a rolled-back run), the copy is stale and the conversion is redone. Conversions run
on the main process; every rank waits for it (collective).

- ``universal``: a DeepSpeed ZeRO checkpoint for another data-parallel world size. DeepSpeed refuses that
  (``ZeRORuntimeException ... DP world size of 2 but the current world size is 1``); its own universal format,
  written by ``deepspeed.checkpoint.ds_to_universal`` and loaded with ``"checkpoint": {"load_universal": true}``,
  restores the weights, the AdamW moments and the step count on any world size
  (docs/strategies.md#checkpoints-across-world-sizes-and-strategies).
- ``plain``: an FSDP2 checkpoint (torch.distributed.checkpoint folders, any world size) for a plain process or DDP.
  DCP reads without a process group; the weights become ``model.safetensors`` and the FQN-keyed optimizer state
  becomes torch's index-keyed ``optimizer.bin``, the files accelerate's ``load_state`` reads outside FSDP.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from toolkit import layout

UNIVERSAL = "universal"
PLAIN = "plain"
DEEPSPEED_MODEL_FOLDER = "pytorch_model"  # accelerate's tag for the engine's own checkpoint inside save_state's folder
FSDP_MODEL_FOLDER, FSDP_OPTIMIZER_FOLDER = "pytorch_model_fsdp_0", "optimizer_0"  # accelerate's DCP folders


def convert(accelerator, checkpoint: str, kind: str, model, log=print) -> str:
    """Collective: the folder to load instead of ``checkpoint`` (converted once by the main process). ``model``: the
    model about to be prepared (its tied parameters decide which names a plain checkpoint holds)."""
    target = layout.converted_dir(checkpoint, kind)
    if accelerator.is_main_process:
        source = layout.fingerprint(checkpoint)
        if is_current(target, source):
            log(f"resume: using {target}, converted from {checkpoint} earlier")
        else:
            stale = " (the copy there was converted from an earlier save of it: redone)" if os.path.isdir(target) else ""
            log(f"resume: converting {checkpoint} into {target} ({kind}), so that this launch can load it; the "
                f"original stays as it is{stale}")
            _write_atomically(target, lambda tmp: _CONVERTERS[kind](checkpoint, tmp, model), source)
    accelerator.wait_for_everyone()
    return target


def is_current(target: str, source: str) -> bool:
    """``target`` is a finished conversion of the checkpoint whose ``layout.fingerprint`` is ``source``: not of an
    earlier write of the same ``step-N`` (a copy without the record, from an older toolkit, counts as stale)."""
    try:
        with open(os.path.join(target, layout.CONVERTED_FROM)) as f:
            return json.load(f).get("fingerprint") == source
    except (OSError, ValueError, AttributeError):
        return False


def _write_atomically(target: str, write, source: str) -> None:
    """``write(tmp)`` into ``target.tmp``, record ``source`` (the original's fingerprint) in it, flush, and rename it
    over ``target`` (a stale copy is replaced the way a re-saved checkpoint is: ``layout.replace_dir``)."""
    tmp = target + layout.TMP_SUFFIX
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier conversion that was killed
    os.makedirs(tmp)
    write(tmp)
    with open(os.path.join(tmp, layout.CONVERTED_FROM), "w") as f:
        json.dump({"fingerprint": source}, f)
    layout.fsync_tree(tmp)
    layout.replace_dir(tmp, target)


def _copy_run_files(checkpoint: str, tmp: str) -> None:
    """accelerate's own files (scheduler, RNG states, sampler states) are format-independent: copied as they are.
    Not the toolkit's record: a converted folder is an internal copy, never resumed from by name."""
    for name in os.listdir(checkpoint):
        src = os.path.join(checkpoint, name)
        if name == layout.CHECKPOINT_STATE or not os.path.isfile(src):
            continue
        shutil.copy2(src, os.path.join(tmp, name))


def _to_universal(checkpoint: str, tmp: str, model) -> None:
    _copy_run_files(checkpoint, tmp)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", os.path.join(checkpoint, DEEPSPEED_MODEL_FOLDER),
           "--output_folder", os.path.join(tmp, DEEPSPEED_MODEL_FOLDER),
           # one worker each: the conversion is I/O on a handful of files; pools of many only cost memory
           "--num_extract_workers", "1", "--num_merge_workers", "1",
           # ZeRO-1/2 checkpoints carry no universal_checkpoint_info unless the client (Megatron) wrote one; for a
           # model without tensor or pipeline parallelism the injected default is the right one (ZeRO-3 ignores it)
           "--inject_missing_state"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"DeepSpeed's universal-checkpoint conversion of {checkpoint} failed "
                           f"({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _to_plain(checkpoint: str, tmp: str, model) -> None:
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def read_dcp(folder: str) -> dict:
        single = os.path.join(tmp, "dcp.pt")
        dcp_to_torch_save(os.path.join(checkpoint, folder), single)  # no process group needed
        try:
            return torch.load(single, map_location="cpu", weights_only=True)
        finally:
            os.remove(single)

    _copy_run_files(checkpoint, tmp)
    weights = read_dcp(FSDP_MODEL_FOLDER)["model"]
    aliases = _tied_aliases(model)
    save_file({name: tensor.contiguous() for name, tensor in weights.items() if name not in aliases},
              os.path.join(tmp, "model.safetensors"))
    del weights
    optim = read_dcp(FSDP_OPTIMIZER_FOLDER)["optimizer"]
    # torch numbers a plain optimizer's parameters in param-group order; DCP lists the same order by name (a tied
    # parameter once, as the optimizer holds it once).
    index = {fqn: i for i, fqn in enumerate(fqn for group in optim["param_groups"] for fqn in group["params"])}
    torch.save({"state": {index[fqn]: state for fqn, state in optim["state"].items()},
                "param_groups": [{**group, "params": [index[fqn] for fqn in group["params"]]}
                                 for group in optim["param_groups"]]},
               os.path.join(tmp, "optimizer.bin"))


def _tied_aliases(model) -> set:
    """The names a plain checkpoint leaves out: every tied parameter but its first name in state_dict order (GPT-2's
    lm_head.weight, which is transformer.wte.weight). accelerate writes them so, and safetensors' ``load_model``
    rejects a file holding both names as an unexpected key."""
    order = {name: i for i, name in enumerate(model.state_dict())}
    names_by_param = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    return {alias for names in names_by_param.values() for alias in sorted(names, key=order.get)[1:]}


_CONVERTERS = {UNIVERSAL: _to_universal, PLAIN: _to_plain}

"""Checkpoints (``accelerator.save_state`` into ``output_dir/checkpoints/step-N``) and the final export.

A checkpoint is written into ``step-N.tmp`` by every rank, flushed to disk (fsync) and renamed to ``step-N`` by the
main process only after all ranks finished, then the ``latest`` pointer is rewritten (write + fsync + rename). A run
killed mid-save therefore never leaves a half-written ``step-N``, and ``latest`` always names a complete one; the
``.tmp`` leftovers are removed when the next run starts. ``final/`` is written the same way (``final.tmp`` + rename),
so a killed export never leaves a ``final/`` that reads as a finished run. The loop's own state (step, epoch,
position in the epoch, token counters) and what the sample order depends on are written beside accelerate's files as
``toolkit_state.json``: JSON, because accelerate unpickles the objects given to ``register_for_checkpointing``
(``weights_only=False``), so a checkpoint folder from elsewhere could run code.

Under tensor parallelism the weights and the optimizer state are written with ``torch.distributed.checkpoint``
instead (``TP_MODEL_FOLDER``, ``TP_OPTIMIZER_FOLDER``; see ``_save_tensor_parallel``); everything else is still
``save_state``'s. A pipeline's stages (never prepared by accelerate) are written by ``toolkit.checkpointing.staged``
in the one-process layout, beside ``save_state``'s RNG files.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager

from accelerate import Accelerator
from accelerate.utils import DistributedType

from toolkit import layout
from toolkit.checkpointing import staged
from toolkit.env.launcher import has_accelerator
from toolkit.parallel.accelerator import deepspeed_out_of_sight

# torch.distributed.checkpoint folders of a tensor-parallel checkpoint, laid out as accelerate's FSDP ones
# ({"model": ...} and {"optimizer": ...}, FQN-keyed)
TP_MODEL_FOLDER, TP_OPTIMIZER_FOLDER = "pytorch_model_tp", "optimizer_tp"


def save_checkpoint(accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None,
                    record: dict, protect: str | None = None, pipeline: tuple | None = None) -> str:
    """Collective: call on every rank. ``record``: the JSON-able ``toolkit_state.json``. ``pipeline``: (model,
    optimizer, scheduler) of a pipeline run, which accelerate did not prepare. Returns the folder."""
    tmp = _begin(accelerator, output_dir, step)
    if _is_tensor_parallel(accelerator):
        _save_tensor_parallel(accelerator, tmp)
    else:
        accelerator.save_state(tmp)  # under a pipeline: the RNG states only (nothing of it prepared)
    if pipeline is not None:
        staged.save(*pipeline, tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _complete(output_dir, step, record, save_total_limit, protect)
    accelerator.wait_for_everyone()
    return layout.step_dir(output_dir, step)


# async_save's folder in a checkpoint: the weights and the optimizer state, one DCP checkpoint ({"model", "optimizer"},
# keyed by get_state_dict's names); accelerate's save_state writes the rest beside it, synchronously
ASYNC_FOLDER = "model_optimizer_dcp"


class AsyncSaves:
    """``async_save: true``: checkpoints written while training goes on, one at a time (torchtitan's async mode).

    ``start`` (collective) writes what is small synchronously (accelerate's ``save_state`` without the model and the
    optimizer: RNG states, scheduler, sampler), then hands the weights and the optimizer state to
    ``torch.distributed.checkpoint.async_save``: it copies them into host memory before it returns (a step that
    changes the weights right after does not reach the checkpoint) and writes the copy from a background thread,
    on a gloo process group of its own (its collectives never meet the training's). The main process's future
    completes once every rank's files and DCP's metadata are written (DCP's coordinator gathers every rank's write
    results first); only then does ``poll`` / ``wait`` complete the save as a synchronous one is (``_complete``: the
    record, fsync, ``step-N.tmp`` -> ``step-N``, then ``latest``). A kill during the write leaves ``step-N.tmp`` and
    the previous ``latest``; the next run removes the leftover. ``stalls``: seconds the loop waited per save.
    """

    def __init__(self):
        self.pending = None  # (future, output_dir, step, record, save_total_limit, protect, state)
        self.group = None  # DCP's writes (from its background thread)
        self.flags = None  # poll's answer, on a group of its own: never beside a collective of the writer thread
        self.stalls: list[float] = []
        self.staged_bytes = 0
        self.completed: list[tuple[object, str]] = []  # (state as saved, step-N) per write completed, for on_save
        # One stager for the run: it keeps its host copies and refills them at the next save (each save starts once
        # the previous write is complete), where dcp.async_save's own stager, made per call, allocates them afresh
        # every time (fresh pages, zero-filled by the kernel: docs/pitfalls.md#dcp-stager-per-call)
        self.stager = None

    def start(self, accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None,
              record: dict, protect: str | None = None, state=None) -> None:
        """Collective. Returns once the copy is staged; a previous write still under way is waited for first.
        ``state``: what ``completed`` hands back with the folder once the write is complete."""
        import time

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        started = time.perf_counter()
        self.wait(accelerator)
        if self.group is None and dist.is_initialized():  # collective: every rank saves at the same steps
            self.group, self.flags = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        tmp = _begin(accelerator, output_dir, step)
        with _without_model_and_optimizer(accelerator, trained=True) as (model, optimizer):
            weights, optim = get_state_dict(model, optimizer)
            accelerator.save_state(tmp)  # the scheduler, the samplers, the RNG states: small, now
        staged = {"model": weights, "optimizer": optim}
        self.staged_bytes = _tensor_bytes(staged)
        if self.stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # no pinned or shared memory, staged before async_save returns: what async_save's own stager does
            self.stager = DefaultStager(StagingOptions(False, False, False, False))
        future = dcp.async_save(staged, checkpoint_id=os.path.join(tmp, ASYNC_FOLDER), process_group=self.group,
                                async_stager=self.stager)
        self.pending = (future, output_dir, step, record, save_total_limit, protect, state)
        self.stalls.append(time.perf_counter() - started)

    def poll(self, accelerator: Accelerator) -> int | None:
        """Collective while a write is under way: complete it on every rank once it is finished. The main process's
        future completes last (DCP's coordinator gathers every rank's results first), so its answer, broadcast, is
        every rank's: all of them complete the same write at the same step (``completed``: the loop's ``on_save``
        on every rank, which Ray's report needs). Returns its step, or None."""
        import torch
        import torch.distributed as dist

        if self.pending is None:
            return None
        done = torch.tensor([int(self.pending[0].done())])
        if self.flags is not None:
            dist.broadcast(done, group=self.flags, group_src=0)
        return self._complete(accelerator) if done.item() else None

    def wait(self, accelerator: Accelerator) -> int | None:
        """Not collective: wait for the write under way and complete it. Returns its step, or None."""
        if self.pending is None:
            return None
        self.pending[0].result()
        return self._complete(accelerator)

    def close(self, accelerator: Accelerator) -> None:
        """Once the run saves no more: the write under way completes, and the stager's host copies are let go."""
        self.wait(accelerator)
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _complete(self, accelerator: Accelerator) -> int:
        future, output_dir, step, record, save_total_limit, protect, state = self.pending
        self.pending = None
        future.result()  # a write that failed raises here, and latest stays where it was
        if accelerator.is_main_process:
            _complete(output_dir, step, record, save_total_limit, protect)
        self.completed.append((state, layout.step_dir(output_dir, step)))
        return step


def _tensor_bytes(tree, seen: set | None = None) -> int:
    """Bytes of the tensors in ``tree``, each storage once (DCP's stager copies a tied weight, GPT-2's ``lm_head``
    and ``wte``, once)."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v, seen) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree  # an FSDP2 shard: this rank's part
        key = (local.data_ptr(), local.numel(), local.dtype)
        if key in seen:
            return 0
        seen.add(key)
        return local.numel() * local.element_size()
    return 0


def _begin(accelerator: Accelerator, output_dir: str, step: int) -> str:
    """Collective: the ``step-N.tmp`` folder a save writes into, emptied of a killed save's leftovers."""
    tmp = layout.step_dir(output_dir, step) + layout.TMP_SUFFIX
    if accelerator.is_main_process:
        os.makedirs(layout.checkpoints_dir(output_dir), exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
    accelerator.wait_for_everyone()
    return tmp


def _complete(output_dir: str, step: int, record: dict, save_total_limit: int | None, protect: str | None) -> None:
    """Main process, once every rank's files are in ``step-N.tmp``: the record, fsync, the rename to ``step-N``,
    then ``latest`` (write + fsync + rename), then the rotation. A kill before the rename leaves ``latest`` as it was."""
    root, final = layout.checkpoints_dir(output_dir), layout.step_dir(output_dir, step)
    tmp = final + layout.TMP_SUFFIX
    with open(os.path.join(tmp, layout.CHECKPOINT_STATE), "w") as f:
        json.dump(record, f, indent=2)
    layout.fsync_tree(tmp)
    for copy in layout.converted_copies(final):  # converted from the step-N this save replaces
        shutil.rmtree(copy, ignore_errors=True)
    layout.replace_dir(tmp, final)
    pointer_tmp = os.path.join(root, layout.LATEST + layout.TMP_SUFFIX)
    with open(pointer_tmp, "w") as f:
        f.write(os.path.basename(final))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, os.path.join(root, layout.LATEST))
    layout.fsync_dir(root)
    rotate_checkpoints(output_dir, save_total_limit, keep={final, protect})


def rotate_checkpoints(output_dir: str, limit: int | None, keep: set) -> None:
    """Delete the oldest complete checkpoints until ``limit`` remain, never one in ``keep`` (the one just written, and
    the one this run resumed from: if the new ones turned out bad, the user can still go back to it)."""
    if not limit:
        return
    found = layout.list_checkpoints(output_dir)
    excess = len(found) - limit
    for _, path in found:
        if excess <= 0:
            break
        if os.path.abspath(path) in {os.path.abspath(k) for k in keep if k}:
            continue
        for copy in layout.converted_copies(path):  # step-N.universal goes with step-N
            shutil.rmtree(copy, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
        excess -= 1


def _quantized_base_kwargs(accelerator: Accelerator) -> dict:
    """A quantized base (load_in_4bit/8bit) writes its quantization constants beside its packed weights
    (bitsandbytes' ``_save_to_state_dict``) but does not read them back as keys of its own: non-strict. The base is
    frozen and the run loads it again, quantized the same way, from model_name_or_path; the adapters and their
    optimizer state load as always (tests/launch/test_qlora.py: a resume ends bit for bit as the straight run)."""
    quantized = any(type(p).__name__ in ("Params4bit", "Int8Params") for m in accelerator._models
                    for p in m.parameters())
    if not quantized or accelerator.distributed_type == DistributedType.FSDP:  # FSDP2: DCP, by its own keys
        return {}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return {"load_module_strict": False}
    return {"strict": False}


def load_checkpoint(accelerator: Accelerator, path: str, optimizer, scheduler=None, universal: bool = False,
                    pipeline_model=None) -> None:
    """``accelerator.load_state`` (collective), made exact under FSDP1 and for ZeRO-3 universal checkpoints; under
    tensor parallelism the weights and optimizer state come from DCP instead (``_load_tensor_parallel``).

    accelerate loads an FSDP1 sharded optimizer checkpoint *into the shape of the current optimizer state*
    (``FSDP.optim_state_dict`` as the DCP template). A freshly built AdamW has no state until its first step, so the
    template is empty and the saved moments are silently skipped (docs/pitfalls.md#fsdp1-optimizer-load; FSDP2 and
    DeepSpeed are exact). Materialising the state first, as torch's own DCP helpers do, fixes it.

    ``universal``: ``path`` is a DeepSpeed universal checkpoint (``toolkit.checkpointing.convert``). DeepSpeed's
    ZeRO-3 loader copies the hyperparameters of the *first* param group into every group (stage3.py,
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``; stage 1/2 match them group by group): the no-decay group
    (biases, LayerNorm) then decays at the first group's weight_decay (docs/pitfalls.md#zero3-universal-groups). The
    groups' own values, which the recipe fixes, are put back, and each group's learning rate is the one the
    restored ``scheduler`` gives it.

    ``pipeline_model``: a pipeline's stages (``toolkit.parallel.pipeline``), which read their tensors from the one-process
    layout by name (``toolkit.checkpointing.staged``); accelerate's load then restores the RNG states only.
    """
    if pipeline_model is not None:
        staged.load(pipeline_model, optimizer, scheduler, path)
        accelerator.load_state(path)
        return
    if _is_tensor_parallel(accelerator):
        _load_tensor_parallel(accelerator, path)
        return
    if os.path.isdir(os.path.join(path, ASYNC_FOLDER)):
        _load_async(accelerator, path)
        return
    if _is_fsdp1(accelerator):
        _materialise_optimizer_state(getattr(optimizer, "optimizer", optimizer))
    own = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
    accelerator.load_state(path, **_quantized_base_kwargs(accelerator))
    if universal:
        for group, values, lr in zip(optimizer.param_groups, own, scheduler.get_last_lr(), strict=True):
            group.update(values)
            group["lr"] = lr
        _unshare_step_counters(optimizer)


@contextmanager
def _without_model_and_optimizer(accelerator: Accelerator, trained: bool = False):
    """``save_state`` / ``load_state`` of everything but the model and the optimizer: the scheduler, the samplers,
    each rank's RNG states and accelerate's step counter, in accelerate's own files. Yields the prepared model and
    optimizer (accelerate takes them from these two lists; there is no option to leave them out). ``trained``: the
    first model and optimizer prepared are the run's (``prepare_run``); others (DPO's live reference) stay in the
    lists and in accelerate's files, as in a synchronous checkpoint."""
    models, optimizers = accelerator._models, accelerator._optimizers
    if not trained and (len(models) != 1 or len(optimizers) != 1):
        raise RuntimeError(f"a tensor-parallel checkpoint holds one model and one optimizer; accelerate prepared "
                           f"{len(models)} and {len(optimizers)}")
    accelerator._models, accelerator._optimizers = models[1:], optimizers[1:]
    try:
        yield models[0], torch_optimizer(optimizers[0])
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def _save_tensor_parallel(accelerator: Accelerator, folder: str) -> None:
    """A tensor-parallel run's checkpoint (collective). accelerate 1.16's ``save_state`` fails on the TP shards:
    outside FSDP and DeepSpeed it writes ``model.safetensors`` from the main process, and
    ``clean_state_dict_for_safetensors`` asks every tensor for its storage's data pointer, which a DTensor does not
    have ("Attempted to access the data pointer on an invalid python storage", measured). Its other parts work,
    but ``optimizer.bin`` would hold the main process's shards only (the other ranks' moments lost, silently), as a
    torch-format ``pytorch_model.bin`` would. So the weights and the optimizer state go through
    torch.distributed.checkpoint (every rank writes its shards; ``get_state_dict`` keys them by name and handles
    DTensors), and ``save_state`` writes the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with _without_model_and_optimizer(accelerator) as (model, optimizer):
        weights, optim = get_state_dict(model, optimizer)
        dcp.save({"model": weights}, checkpoint_id=os.path.join(folder, TP_MODEL_FOLDER))
        dcp.save({"optimizer": optim}, checkpoint_id=os.path.join(folder, TP_OPTIMIZER_FOLDER))
        accelerator.save_state(folder)


def _load_tensor_parallel(accelerator: Accelerator, folder: str) -> None:
    """Load what ``_save_tensor_parallel`` wrote (collective), into the same TP layout
    (``toolkit.checkpointing.resume`` refuses another). ``get_state_dict`` gives the template DCP reads into, and creates a fresh optimizer's state first (a
    step at lr 0), so that the saved moments have somewhere to go (see ``load_checkpoint`` on FSDP1)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with _without_model_and_optimizer(accelerator) as (model, optimizer):
        weights, optim = get_state_dict(model, optimizer)
        dcp.load({"model": weights}, checkpoint_id=os.path.join(folder, TP_MODEL_FOLDER))
        dcp.load({"optimizer": optim}, checkpoint_id=os.path.join(folder, TP_OPTIMIZER_FOLDER))
        set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim)
        accelerator.load_state(folder)


def _load_async(accelerator: Accelerator, folder: str) -> None:
    """Load what ``AsyncSaves.start`` wrote (collective), as ``_load_tensor_parallel`` loads its folders: DCP reads
    into ``get_state_dict``'s template (a fresh optimizer's state created first), accelerate's files the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with _without_model_and_optimizer(accelerator, trained=True) as (model, optimizer):
        weights, optim = get_state_dict(model, optimizer)
        state = {"model": weights, "optimizer": optim}
        dcp.load(state, checkpoint_id=os.path.join(folder, ASYNC_FOLDER))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        accelerator.load_state(folder)


def torch_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper (and, under DeepSpeed, inside its ZeRO optimizer)."""
    inner = optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


def _unshare_step_counters(optimizer) -> None:
    """Give every parameter's AdamW ``step`` its own tensor. DeepSpeed's ZeRO-3 universal loader stores one tensor
    object as the step of every group; torch's AdamW increments it in place once per group and step, so the second
    group's bias correction runs ahead (docs/pitfalls.md#zero3-universal-groups)."""
    import torch

    inner = torch_optimizer(optimizer)
    seen = set()
    for state in inner.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def _is_fsdp1(accelerator: Accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2


def _materialise_optimizer_state(optimizer) -> None:
    """Create the optimizer's state with a step of zero gradients at lr 0 (moves no weight); the load overwrites it."""
    import torch

    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def full_state_dict(accelerator: Accelerator, model):
    """The full, unsharded weights on the main process (other ranks may get None or {}). Collective: call everywhere.

    ZeRO-3 gathers through ``stage3_gather_16bit_weights_on_model_save`` (``zero3_save_16bit_model: true`` in our
    config; the dtype stays the training dtype), FSDP2 through DCP's full state dict, broadcast to rank 0. FSDP1 on a
    CPU-only host is the exception: accelerate asks FSDP1 for ``offload_to_cpu=True``, which segfaults when the
    weights already live on the CPU (measured, torch 2.13); DCP's full state dict without the offload gathers the
    same weights (diff 0 to the unsharded model) on every rank.
    """
    if hasattr(model, "gather_state_dict"):  # a pipeline's stages (toolkit.parallel.pipeline), gathered on the first rank
        return model.gather_state_dict()
    if _is_fsdp1(accelerator) and not has_accelerator():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    if _is_tensor_parallel(accelerator):
        # accelerate returns the model's own state dict, TP shards (DTensors) as they are; gathering one is
        # collective, so every rank gathers every tensor (save_pretrained on the main process alone would hang).
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return accelerator.get_state_dict(model)


def _is_tensor_parallel(accelerator: Accelerator) -> bool:
    config = getattr(accelerator, "parallelism_config", None)
    return config is not None and config.tp_size > 1


def _realias_tied(state_dict: dict, model) -> dict:
    """Make tied weights (GPT-2's lm_head / wte) one tensor again, so that save_pretrained writes them once.

    A gathered state dict (ZeRO, FSDP) holds a separate copy per name; transformers only recognises ties by shared
    storage, and would write both (29 tensors instead of 28 here).
    """
    from collections import defaultdict

    from toolkit.models.lora import FSDP1_WRAPPER

    names_by_param = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param[id(param)].append(name.replace(FSDP1_WRAPPER, ""))
    state_dict = dict(state_dict)
    for names in names_by_param.values():
        present = [n for n in names if n in state_dict]
        for alias in present[1:]:
            state_dict[alias] = state_dict[present[0]]
    return state_dict


def written_shapes(folder: str, stem: str) -> dict[str, list[int]]:
    """{name: shape} of the tensors in ``folder``'s ``stem``.safetensors (or the shards its index lists), read from the
    files' headers: no tensor data is read."""
    from safetensors import safe_open

    index = os.path.join(folder, f"{stem}.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [f"{stem}.safetensors"]
    shapes = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            shapes.update({key: list(f.get_slice(key).get_shape()) for key in f.keys()})
    return shapes


def check_export(folder: str) -> None:
    """An export (``save_final``'s: full weights, a LoRA adapter, ``merged/``) against the architecture its config.json
    names, built on the meta device (``toolkit.models.loading.empty_model``; an adapter: wrapped by its adapter_config.json):
    every tensor written under a name the architecture has, in its shape, and every tensor it needs written (one name
    of tied ones). Names and shapes only, from the files' headers: milliseconds. Raises RuntimeError naming what
    differs, so that a run never reports an export that does not load, or that loads wrong (a square weight
    transposed: docs/pitfalls.md#dequantized-conv1d)."""
    from toolkit.models import lora
    from toolkit.models.loading import is_adapter_folder

    adapter = is_adapter_folder(folder)
    written = written_shapes(folder, "adapter_model" if adapter else "model")
    expected = lora.adapter_tensors(folder) if adapter else _model_tensors(folder)
    if expected is None:  # an architecture transformers does not ship (remote code): nothing to build it from
        return
    required, allowed = expected
    missing = [names[0] for names in required if not any(n in written for n in names)]
    unexpected = [n for n in written if n not in allowed]
    wrong = [f"{n} {written[n]} (the architecture's {allowed[n]})" for n in written
             if n in allowed and written[n] != allowed[n]]
    if missing or unexpected or wrong:
        raise RuntimeError(f"the export in {folder} does not fit the architecture its config names: "
                           + "; ".join(f"{what}: {', '.join(items[:4])}{', ...' if len(items) > 4 else ''}"
                                       for what, items in
                                       (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                                       if items))


def _model_tensors(folder: str):
    """([names of one tensor: tied ones together], {name: shape}) of the architecture of ``folder``'s config.json, or
    None (``toolkit.models.loading.empty_model``)."""
    from collections import defaultdict

    import transformers

    from toolkit.models.loading import empty_model

    model = empty_model(transformers.AutoConfig.from_pretrained(folder))
    if model is None:
        return None
    names = defaultdict(list)
    state = model.state_dict(keep_vars=True)  # tied weights: one Parameter under several names
    for name, tensor in state.items():
        names[id(tensor)].append(name)
    return list(names.values()), {name: list(tensor.shape) for name, tensor in state.items()}


def save_final(accelerator: Accelerator, model, tokenizer, path: str, merge_lora: bool = False) -> None:
    """Full (unsharded) weights via ``save_pretrained``, loadable by ``AutoModelFor*.from_pretrained``; for a LoRA
    model the adapter alone (``PeftModel.from_pretrained``), and with ``merge_lora`` the merged full weights in
    ``final/merged/`` too (``toolkit.models.lora``).

    Gathering is collective (ZeRO-3 / FSDP shards), so every rank calls it; only the main process writes.
    """
    accelerator.wait_for_everyone()
    with deepspeed_out_of_sight(accelerator):
        _save_final(accelerator, model, tokenizer, path, merge_lora)


def _save_final(accelerator: Accelerator, model, tokenizer, path: str, merge_lora: bool) -> None:
    from toolkit.models import lora

    state_dict = full_state_dict(accelerator, model)
    unwrapped = getattr(model, "whole_model", None) or accelerator.unwrap_model(model)  # a pipeline's: the model's
    if accelerator.is_main_process:
        if not state_dict:
            raise RuntimeError("the final export gathered no weights on the main process; nothing written")
        tmp = path + layout.TMP_SUFFIX
        shutil.rmtree(tmp, ignore_errors=True)
        if lora.is_peft_model(unwrapped):
            lora.save_adapter(unwrapped, state_dict, tmp)
            if unwrapped.peft_config["default"].task_type == "SEQ_CLS":  # its head is new: AutoPeft needs its shape
                lora.save_classifier_base(unwrapped, tmp, path)
            if merge_lora:
                lora.save_merged(unwrapped, state_dict, os.path.join(tmp, lora.MERGED))
                if tokenizer is not None:
                    tokenizer.save_pretrained(os.path.join(tmp, lora.MERGED))
        else:
            # A tensor-parallel model's config carries transformers' distributed_config: save_pretrained would then
            # wait in a barrier for the other ranks (only this one saves: hang), and from_pretrained of the export
            # would try to split it again. The weights are gathered already; the export is a plain model.
            distributed, unwrapped.config.distributed_config = getattr(unwrapped.config, "distributed_config", None), None
            try:
                unwrapped.save_pretrained(tmp, state_dict=_realias_tied(state_dict, unwrapped), safe_serialization=True)
            finally:
                unwrapped.config.distributed_config = distributed
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for folder in (tmp, os.path.join(tmp, lora.MERGED)):  # before the run reports it: one that loads as trained
            if os.path.isdir(folder):
                check_export(folder)
        layout.fsync_tree(tmp)
        # a resumed run that had finished before: its newer export replaces the old one, the way a re-saved step-N
        # replaces its checkpoint (never a moment without either)
        layout.replace_dir(tmp, path)
    accelerator.wait_for_everyone()

"""What a checkpoint needs in order to continue exactly, and the checks that refuse a resume that would not.

A checkpoint continues the same run only if the sample order is the same: step s of epoch e covers rows
[s*B, (s+1)*B) of a permutation that depends on the seed, the shuffle switch and the training rows (their number and
content, which depend on the data, block_size and packing). All of that is recorded in the checkpoint's
``toolkit_state.json`` (``toolkit.layout``) and compared before the weights load; each difference is refused with the
field that caused it. The world size, micro batch and accumulation may change, as long as their product, the global
batch B, does not; and the checkpoint's format must be one this launch can load, as written or converted (``load_plan``).
"""

from __future__ import annotations

import hashlib
import os

from toolkit import layout
from toolkit.checkpointing import convert
from toolkit.data.stream import TrainStream
from toolkit.env.launcher import launched_strategy_name
from toolkit.errors import ConfigError
from toolkit.models import lora, quantization
from toolkit.parallel.accelerator import data_parallel_size, strategy_name

# order key -> the config field a user changes to change it
ORDER_FIELDS = {
    "seed": "seed",
    "shuffle": "shuffle",
    "packing": "packing",
    "packing_strategy": "packing_strategy",
    "block_size": "block_size",
    "train_rows": "train_file",
    "train_data_sha": "train_file",
    "shuffle_buffer_size": "shuffle_buffer_size",
    "repeats": "num_generations",
}


def data_fingerprint(dataset, samples: int = 64) -> str:
    """A cheap, deterministic hash of the tokenized training set: its size and ``samples`` rows spread across it.

    (``datasets``' own ``_fingerprint`` is random for in-memory datasets, so it cannot be compared across runs.)
    """
    h = hashlib.sha256(str(len(dataset)).encode())
    n = len(dataset)
    for i in sorted({(j * (n - 1)) // max(samples - 1, 1) for j in range(samples)} if n else ()):
        h.update(str(dataset[i]["input_ids"]).encode())
    return h.hexdigest()[:16]


def order_record(cfg, train_dataset, repeats: int = 1) -> dict:
    """What the sample order depends on, as stored in a checkpoint (block_size as configured; a resolved default
    that changed would change the rows, which the data hash sees). A stream (``toolkit.data.stream``) has no row count:
    its files and window size stand for the rows. ``repeats``: each row listed that many times in a row (GRPO's
    num_generations; None when 1, as in the checkpoints written before it was recorded)."""
    stream = isinstance(train_dataset, TrainStream)
    return {
        "seed": cfg.train.seed,
        "shuffle": cfg.train.shuffle,
        "packing": cfg.data.packing,
        # recorded for bfd and bfd_split only: None for wrapped, as in the checkpoints written before it existed
        "packing_strategy": cfg.data.packing_strategy if cfg.data.padding_free else None,
        "block_size": cfg.data.block_size,
        "train_rows": "stream" if stream else len(train_dataset),
        "train_data_sha": train_dataset.spec.fingerprint() if stream else data_fingerprint(train_dataset),
        "shuffle_buffer_size": train_dataset.spec.window if stream else None,
        "repeats": repeats if repeats > 1 else None,
        **({"stream_files": train_dataset.spec.file_fingerprints()} if stream else {}),
        # not the order: how the frozen base is quantized, which a resume must repeat (toolkit.models.quantization)
        "quantized_base": quantization.base_record(cfg.model),
        # nor this: the LoRA layout and scaling the checkpoint's weights were trained in (toolkit.models.lora)
        "adapters": lora.adapter_record(cfg.model),
        # not the order either: optim muon's state (momentum buffers, in its own groups) is not AdamW's; None for the
        # others, as in the checkpoints written before it was recorded
        "optimizer": "muon" if cfg.train.optim == "muon" else None,
    }


def check_stream_files(checkpoint: str, saved: list | None, now: list | None) -> None:
    """A stream resumes at a row index of its files: refuse, naming the file, a resume whose files changed (a
    checkpoint written before files were fingerprinted has only the names and sizes, checked with the order)."""
    if saved is None or now is None:
        return
    for (old, old_sha), (new, new_sha) in zip(saved, now):
        if os.path.basename(old) != os.path.basename(new):  # a corpus moved elsewhere is the same corpus
            what = f"the file read at this place in the stream was {old}, now {new}"
        elif old_sha != new_sha:
            what = f"{new} changed since the checkpoint was written (its content fingerprint {old_sha} is now {new_sha})"
        else:
            continue
        raise ConfigError("train_file", f"cannot resume from {checkpoint}: {what}, so the stream would continue at its "
                                        "saved row index in other rows; put back the files the run trained on, or "
                                        "start a new output_dir")
    if len(saved) != len(now):
        raise ConfigError("train_file", f"cannot resume from {checkpoint}: the stream had {len(saved)} file(s), now "
                                        f"{len(now)}; put back the files the run trained on, or start a new output_dir")


# How each strategy's checkpoint is relaunched, and which loads are known to work (tested; the figures are in
# docs/strategies.md#checkpoints-across-world-sizes-and-strategies): plain weights + optimizer files load under
# single/ddp on any world size; FSDP2's DCP checkpoint reshards onto any world size under FSDP2; a DeepSpeed
# checkpoint loads on its own world size as written and on any other through DeepSpeed's universal format
# (toolkit.checkpointing.convert); FSDP2's converts to the plain files for single/ddp (toolkit.checkpointing.convert);
# FSDP1's loads on the same world only; a tensor-parallel one (DCP folders of its TP shards,
# toolkit.checkpointing.checkpoint) under TP with the same tp_size (its world size: TP runs alone here) only: another
# tp_size is untested, and refused. A pipeline's (any degree, replicated or FSDP2-sharded stages) is written in the
# single/ddp layout (toolkit.checkpointing.staged): the three load each other's as written; FSDP2's converts for a
# pipeline as for single/ddp.
LAUNCH_CONFIG = {"single": "ddp.yaml", "ddp": "ddp.yaml", "fsdp1": "fsdp1.yaml", "fsdp2": "fsdp.yaml",
                 "deepspeed-zero2": "zero2.yaml", "deepspeed-zero3": "zero3.yaml", "tp": "tp.yaml",
                 "pipeline": "ddp.yaml"}
PLAIN_LAYOUT = {"single", "ddp", "pipeline"}
PORTABLE = {"single": PLAIN_LAYOUT, "ddp": PLAIN_LAYOUT, "pipeline": PLAIN_LAYOUT, "fsdp2": {"fsdp2"}}
ANY_WORLD_VIA_UNIVERSAL = {"deepspeed-zero2", "deepspeed-zero3"}
# async_save's checkpoints (toolkit.checkpointing.checkpoint.AsyncSaves: the weights and optimizer state as one DCP
# folder by name, accelerate's files beside it): loaded by DCP on any world size, within the kind that wrote them
ASYNC_LOADS = {"single": {"single", "ddp"}, "ddp": {"single", "ddp"}, "fsdp2": {"fsdp2"}}


def checkpoint_format(accelerator) -> str:
    """The layout a run's checkpoints are written in: ``distributed.strategy_name``'s, or 'pipeline' under pipeline
    parallelism (whichever launch config: ``toolkit.checkpointing.staged`` writes the one-process layout)."""
    return "pipeline" if getattr(accelerator, "pipeline_parallel_size", 1) > 1 else strategy_name(accelerator)


def load_plan(checkpoint: str, saved: dict, strategy: str, num_processes: int) -> str | None:
    """How this launch loads ``checkpoint``: None (as written) or the kind of ``toolkit.checkpointing.convert``
    conversion it needs.
    Refuses, before the weights load, a checkpoint no conversion makes loadable (once: a FileNotFoundError traceback
    after the weights loaded), naming how it was written and how to relaunch it."""
    wrote, world = saved["strategy"], saved["loop"]["world_size"]
    if saved.get("layout"):  # async_save's: DCP by name, which reshards onto any world size of the same kind
        if strategy in ASYNC_LOADS.get(wrote, set()):
            return None
        raise ConfigError("resume_from_checkpoint", f"{checkpoint} was written with async_save under {wrote}, which "
                                                    f"loads under {' or '.join(sorted(ASYNC_LOADS[wrote]))} only (this "
                                                    f"launch: {strategy}); relaunch with --config_file "
                                                    f"accelerate_configs/{LAUNCH_CONFIG[wrote]}")
    if strategy in PORTABLE.get(wrote, set()) or (strategy == wrote and num_processes == world):
        return None
    if strategy == wrote and wrote in ANY_WORLD_VIA_UNIVERSAL:
        return convert.UNIVERSAL
    if wrote == "fsdp2" and strategy in PLAIN_LAYOUT:
        return convert.PLAIN
    config = LAUNCH_CONFIG.get(wrote, "<its launch config>")
    same_world = "" if wrote in PORTABLE or wrote in ANY_WORLD_VIA_UNIVERSAL else f" --num_processes {world}"
    field_name = "resume_from_checkpoint"
    if wrote == "tp":
        same_world += f" --parallelism_config_tp_size {world}"
        if strategy == "tp":  # tensor parallel again, on another tp_size
            field_name = "parallelism_config_tp_size"
    raise ConfigError(
        field_name,
        f"{checkpoint} was written by {world} rank(s) under {wrote}{_tp_size(wrote, world)}; this launch is "
        f"{strategy} with {num_processes} rank(s){_tp_size(strategy, num_processes)}, which cannot load that format. "
        "Resume it as it was written: accelerate launch "
        f"--config_file accelerate_configs/{config}{same_world} <recipe> ... --resume_from_checkpoint {checkpoint}",
    )


def _tp_size(strategy: str, world: int) -> str:
    return f" (tp_size {world})" if strategy == "tp" else ""


def check_resume(checkpoint: str, cfg, order: dict, accelerator) -> tuple[dict, str | None]:
    """Refuse, before the weights load, a resume that would not continue the same sample order (``order``: this
    run's ``order_record``) or that this launch cannot load; returns the checkpoint's state and its ``load_plan``."""
    return check_resume_of(checkpoint, cfg, order, checkpoint_format(accelerator), accelerator.num_processes,
                           data_parallel_size(accelerator))


def launched_format(cfg) -> str:
    """``checkpoint_format`` of the launch this process is in, from the environment ``accelerate launch`` sets, before
    any Accelerator (``toolkit train``'s check)."""
    return "pipeline" if cfg.train.pipeline_parallel_size > 1 else launched_strategy_name()


def check_resume_of(checkpoint: str, cfg, order: dict, strategy: str, num_processes: int,
                    ranks: int) -> tuple[dict, str | None]:
    """``check_resume`` from the files alone (the checkpoint's ``toolkit_state.json``): ``strategy`` its
    ``checkpoint_format``, ``ranks`` the data-parallel ranks. ``toolkit train`` runs it before it launches (no
    Accelerator there), each rank again as it builds (for ``accelerate launch`` alone)."""
    saved = layout.read_checkpoint_state(checkpoint)
    if saved is None:  # RunConfig checks it for a named folder; 'latest' is resolved only here
        raise ConfigError("resume_from_checkpoint", f"{checkpoint} holds no {layout.CHECKPOINT_STATE}: not a "
                                                    "checkpoint of this toolkit (or one older than 0.2)")
    check_stream_files(checkpoint, saved["order"].get("stream_files"), order.get("stream_files"))
    if "quantized_base" in saved["order"]:  # recorded since QLoRA's resume checks; not by earlier checkpoints
        quantization.check_same_base(checkpoint, saved["order"]["quantized_base"], order["quantized_base"])
    if "adapters" in saved["order"]:  # recorded since LoRA's resume checks (issue 46); not by earlier checkpoints
        lora.check_same_adapters(checkpoint, saved["order"]["adapters"], order["adapters"])
    if saved["order"].get("optimizer") != order["optimizer"]:  # torch's load would fail after the weights loaded
        was, now = (value or "not muon" for value in (saved["order"].get("optimizer"), order["optimizer"]))
        raise ConfigError("optim", f"cannot resume from {checkpoint}: it was written with optim {was}, this run's is "
                                   f"{now}; one optimizer's state does not continue the other's: resume with the "
                                   "checkpoint's optim, or start a new output_dir")
    for key, field_name in ORDER_FIELDS.items():
        if saved["order"].get(key) != order[key]:
            what = ("the training data changed" if key in ("train_rows", "train_data_sha")
                    else f"{key} was {saved['order'].get(key)!r}, now {order[key]!r}")
            if field_name == "train_file" and not cfg.data.train_file:
                field_name = "dataset_name"  # the data came from there
            raise ConfigError(
                field_name,
                f"cannot resume from {checkpoint}: {what}, so the sample order would differ and the run would "
                f"silently train on other rows; resume with the checkpoint's values, or start a new output_dir",
            )
    plan = load_plan(checkpoint, saved, strategy, num_processes)
    micro, accumulation = cfg.train.per_device_train_batch_size, cfg.train.gradient_accumulation_steps
    global_batch = ranks * micro * accumulation
    saved_batch = saved["loop"]["global_batch_size"]
    if saved_batch != global_batch:
        # Step s covers rows [s*B, (s+1)*B) of the epoch's order: another B would skip or repeat rows.
        raise ConfigError(
            "per_device_train_batch_size",
            f"the checkpoint {checkpoint} was written with a global batch of {saved_batch} rows, "
            f"this run has {global_batch} ({ranks} ranks x {micro} x {accumulation} accumulation); keep "
            "ranks x per_device_train_batch_size x gradient_accumulation_steps equal to resume",
        )
    rows = order["train_rows"] * (order.get("repeats") or 1) if isinstance(order["train_rows"], int) else None
    _check_not_past_the_end(checkpoint, saved["loop"]["step"], cfg.train, rows, global_batch)
    return saved, plan


def _check_not_past_the_end(checkpoint: str, step: int, args, train_rows, global_batch: int) -> None:
    """A checkpoint past this run's last step would end the run at once and export its weights as the result of a
    shorter run. One exactly at the end is a finished run (it exports again: its final/ may have been lost).
    ``train_rows``: the rows of the order (each repeated row counted as often as it is listed); None for a stream."""
    import math

    by_epochs = args.max_steps <= 0 and isinstance(train_rows, int)
    total = math.ceil(args.num_train_epochs * (train_rows // global_batch)) if by_epochs else args.max_steps
    if step > total:
        field_name = "num_train_epochs" if by_epochs else "max_steps"
        raise ConfigError(field_name, f"the checkpoint {checkpoint} is at step {step}, past this run's {total} "
                                      f"steps; raise {field_name} to continue it, or resume an earlier checkpoint")

"""Everything a run trains on, built from a ``RunConfig``: tokenizer, model, tokenized datasets, collator.

One function so that ``recipes/gpt2.py``, the quickstart notebook's in-kernel run and its ``notebook_launcher``
ranks build the model and the data the same way, step for step:

    accelerator = make_accelerator(cfg.train)
    parts = build(cfg, accelerator)
    train(cfg, accelerator, **parts.train_kwargs())

The order matters and is the recipe's: seed first (a model built from a config is initialised from it), the
tokenizer and the raw data (cheap checks of files and columns) before the weights load, and tokenization inside
``main_process_first`` so that for file-backed datasets rank 0 fills the ``datasets`` cache and the others read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.checkpointing import ResumePlan, plan_resume
from toolkit.config import RunConfig
from toolkit.config.help import unused_field
from toolkit.data import loading as data
from toolkit.data.order import require_one_global_batch
from toolkit.data.packing import PACKING_REPORT, cut_report
from toolkit.data.stream import StreamSpec, TrainStream, eval_rows, no_first_step, open_source, shard_order, source_rows
from toolkit.errors import ConfigError
from toolkit.models import lora, quantization
from toolkit.models.loading import (
    check_adapter_model,
    check_chunked_loss,
    check_tensor_parallel,
    compile_blocks,
    disable_dropout,
    enable_activation_checkpointing,
    enable_chunked_loss,
    load_config,
    load_model,
    load_tokenizer,
    max_positions,
    parameter_dtypes,
)
from toolkit.parallel import pipeline, sequence
from toolkit.parallel.accelerator import (
    data_parallel_rank,
    data_parallel_size,
    resolve_activation_checkpointing,
    strategy_name,
    tensor_parallel_size,
)
from toolkit.tasks.base import Task
from toolkit.tasks.lm import CausalLM

STREAM_CUT_SAMPLE = 4_096  # the stream's first documents that the cut report counts (tokenized once more)
STREAM_HEAD_ROWS = 64  # a stream's first rows, read by check_inputs (in toolkit train's launching process too)


@dataclass
class Parts:
    tokenizer: Any
    model: Any
    train_dataset: Any
    eval_dataset: Any  # None when the data has no validation split
    collator: Any  # pads a micro-batch (the task's)
    block_size: int
    task: Task | None = None  # what a row's loss and the evaluation are (a toolkit.tasks.base.Task)
    resume: ResumePlan | None = None  # planned before the weights loaded (None without an accelerator)

    def train_kwargs(self) -> dict:
        """The keyword arguments of ``toolkit.training.loop.train`` after ``cfg`` and ``accelerator``."""
        return dict(model=self.model, tokenizer=self.tokenizer, train_dataset=self.train_dataset,
                    eval_dataset=self.eval_dataset, collator=self.collator, task=self.task, resume=self.resume)


def build(cfg: RunConfig, accelerator=None, log=None, task: Task | None = None) -> Parts:
    """Seed, then load the tokenizer, the data (tokenized, then packed or padded) and the model, for ``task``
    (a ``toolkit.tasks.base.Task``; a causal LM on text by default).

    ``accelerator`` may be None outside a run (e.g. to look at the data in a notebook before any Accelerator
    exists, which ``notebook_launcher`` requires): then tokenization runs in this process without coordination.
    """
    task = task or CausalLM()
    if log is None:
        log = accelerator.print if accelerator is not None else print
    launched = accelerator is not None
    tp_size = tensor_parallel_size(accelerator) if launched else 1
    tokenizer, model_config, lm, block_size = build_data(
        cfg, task, log, accelerator, strategy=strategy_name(accelerator) if launched else "single", tp_size=tp_size,
        data_parallel=data_parallel_size(accelerator) if launched else None,
        rank=data_parallel_rank(accelerator) if launched else 0)
    checkpointing, resume = cfg.train.gradient_checkpointing, None
    if launched:  # checked here so that a run that cannot go on stops before the weights load
        checkpointing = resolve_activation_checkpointing(accelerator, checkpointing)  # or FSDP's, from the launch config
        resume = plan_resume(cfg, accelerator, lm["train"], task.sample_repeats(cfg))  # refuses a resume that cannot go on
    model = load_model(cfg.model, model_config, auto_class=task.auto_class, tp_size=tp_size,
                       device=accelerator.device if launched else None)
    log(f"weights train in {parameter_dtypes(model)} (torch_dtype: {cfg.model.torch_dtype}; mixed precision: "
        f"{accelerator.mixed_precision if accelerator is not None else 'no'})")
    # The model's own forward and layers first (the chunked loss replaces the HF model's forward; checkpointing
    # wraps its layers), then LoRA around them, then dropout off everywhere, LoRA's dropout included.
    if cfg.train.loss_chunk_size:
        rows = task.sequences_per_row  # a DPO row is a pair: two sequences in the micro-batch
        enable_chunked_loss(model, cfg.train.loss_chunk_size,
                            max_positions=cfg.train.per_device_train_batch_size * rows * block_size,
                            max_eval_positions=cfg.train.per_device_eval_batch_size * rows * block_size)
        log(f"loss_chunk_size: the training and evaluation losses are computed {cfg.train.loss_chunk_size} "
            "positions at a time")
    if checkpointing:
        enable_activation_checkpointing(model)
        log("activation checkpointing: each layer's activations are recomputed in the backward pass")
    if cfg.train.torch_compile:
        fsdp2 = accelerator is not None and getattr(accelerator, "is_fsdp2", False)  # dynamic shapes: slower there
        blocks = compile_blocks(model, cfg.train.torch_compile_backend, cfg.train.torch_compile_mode,
                                cfg.train.torch_compile_cache_dir, dynamic=not fsdp2)
        log(f"torch_compile: {blocks} decoder blocks compiled (backend {cfg.train.torch_compile_backend or 'inductor'}"
            f", mode {cfg.train.torch_compile_mode or 'default'}) at their first step")
    if cfg.model.use_peft:
        model = lora.apply_lora(model, cfg.model, task.peft_task_type, log=log)
    if cfg.train.disable_dropout:
        disable_dropout(model)
        log("disable_dropout: every dropout probability of the model is 0")
    return Parts(tokenizer=tokenizer, model=model, train_dataset=lm["train"], eval_dataset=lm.get("validation"),
                 collator=task.collator(tokenizer), block_size=block_size, task=task, resume=resume)


def build_data(cfg: RunConfig, task: Task, log, accelerator=None, *, strategy: str, tp_size: int = 1,
               data_parallel: int | None = None, rank: int = 0) -> tuple:
    """Everything a rank does before its weights load, and the one place it is done: ``build`` runs it in every rank,
    ``toolkit train`` (``toolkit.cli.train.check``) in the launching process, so that what only the data shows once
    tokenized (a training set smaller than one global batch, chats with nothing to learn within block_size, GRPO's
    conversational prompts without a chat template or a prompt and its completion past the model's positions) is one
    line there too, not a refusal in the ranks under a launcher's traceback. The quantized base against
    ``strategy``, ``check_inputs``, the tokenization (``main_process_first`` under an ``accelerator``: rank 0 fills the
    ``datasets`` cache, the others read it; the launching process fills it first, so the ranks read it too), and one
    global batch of ``data_parallel`` ranks (None: not known, a notebook's ``build`` before any Accelerator; ``train``
    checks it). A stream is opened, its first window read and its validation rows tokenized (``stream_data``: rank
    ``rank`` of ``data_parallel``). Returns (tokenizer, model config, {"train", "validation"?}, block size). Seeds
    first (a model built from a config is initialised from it, after)."""
    from accelerate.utils import set_seed

    set_seed(cfg.train.seed)
    quantization.check_run(cfg, strategy)  # a quantized base under a strategy it was not checked with: fields only
    tokenizer, model_config, raw, block_size = check_inputs(cfg, task, log, tp_size)
    if cfg.data.streaming:  # nothing tokenized ahead: the first rows are read (and checked) here
        lm = stream_data(cfg, task, tokenizer, block_size, log, data_parallel or 1, rank)
    elif accelerator is not None:
        with accelerator.main_process_first():  # rank 0 tokenizes and fills the cache, the others read it
            lm = task.tokenize(raw, tokenizer, cfg.data, block_size)
    else:
        lm = task.tokenize(raw, tokenizer, cfg.data, block_size)
    if getattr(lm, PACKING_REPORT, None):
        log(getattr(lm, PACKING_REPORT))  # what block_size cut (bfd) or split (bfd_split)
    if data_parallel is not None and not cfg.data.streaming:  # a stream's first global batch: stream_data
        require_one_global_batch(len(lm["train"]) * task.sample_repeats(cfg), cfg.train.per_device_train_batch_size,
                                 data_parallel, cfg.train.gradient_accumulation_steps)
    return tokenizer, model_config, lm, block_size


def check_inputs(cfg: RunConfig, task: Task, log=print, tp_size: int = 1):
    """Everything about a run that can be checked before the weights load: the task's fields, the tokenizer (a chat
    template), the model's config, the raw data's files and columns (not a stream's rows: ``stream_data`` reads its
    first ones), the block size, and a tensor-parallel split of the model. Returns (tokenizer, model config, raw
    splits or None for a stream, block size). ``build`` starts with it; ``toolkit train`` runs it in the launching
    process (``toolkit.cli.train``), so that a mistake is one line there instead of one under a launcher's traceback."""
    unused = unused_field((cfg.model, cfg.data, cfg.train), task.name)  # a config parsed without a recipe (a notebook)
    if unused:
        raise ConfigError(*unused)
    if cfg.data.streaming and task.stream_refusal:
        raise ConfigError("streaming", f"the {task.name} task cannot train on a stream: {task.stream_refusal}; set "
                                       "streaming: false")
    task.check(cfg)
    task.log = log  # for what a task says while it loads (rows dropped)
    task.apply_defaults(cfg)  # e.g. disable_dropout, unset: DPO's true, the others' false
    if cfg.model.use_peft:
        lora.check_available()
    tokenizer = load_tokenizer(cfg.model, log=log)
    task.prepare_tokenizer(tokenizer, cfg)  # e.g. SFT's chat template: checked before the weights load
    model_config = load_config(cfg.model, disable_dropout=cfg.train.disable_dropout)
    adapter = check_adapter_model(cfg.model, tp_size)  # a LoRA run's final/ as the model: merged into its base
    if adapter:
        log(adapter)
    pipeline.check_run(cfg, task, model_config)  # LoRA, the task, the architecture: one line before any work
    sequence.check_run(cfg, task, model_config)  # the task, packing, the heads
    if cfg.train.loss_chunk_size:
        check_chunked_loss(model_config)
    if cfg.train.torch_compile and cfg.model.use_peft:
        raise ConfigError("torch_compile", "with LoRA is not proven here; set torch_compile: false or use_peft: false")
    if tp_size > 1:
        check_tensor_parallel(cfg.model, model_config, tp_size)
    raw = None if cfg.data.streaming else task.load_raw(cfg.data)  # checks files and columns before the weights load
    task.configure_model(model_config, tokenizer)  # e.g. a classifier's labels
    block_size = data.resolve_block_size(cfg.data, tokenizer, max_positions(model_config))
    if cfg.data.streaming:
        check_stream_head(cfg, task, tokenizer, block_size)
    return tokenizer, model_config, raw, block_size


def stream_head(cfg: RunConfig, task: Task, field: str = "train_file") -> tuple[list[dict], list[str], str]:
    """The first rows (``STREAM_HEAD_ROWS``) of the stream of ``field``'s files, in the order it reads them (the
    training files permuted by the seed, the validation files as given: ``stream.eval_rows``), their columns, and
    their format (``formats.detect``, as a loaded split's from its columns: naming the columns and the formats)."""
    from itertools import islice

    from toolkit.data.formats import detect

    train = field == "train_file"
    seed, shuffle = (cfg.train.seed, cfg.train.shuffle) if train else (0, False)
    files = shard_order(cfg.data.data_files(field), seed, shuffle)
    rows = list(islice(source_rows(open_source(files, seed, shuffle), files, field), STREAM_HEAD_ROWS))
    if not rows:
        raise ConfigError(field, f"the stream of {files} has no row; give files with rows")
    columns = sorted({column for row in rows for column in row})
    where = f"the stream (its first {len(rows)} rows, from {files[0]})"
    try:
        return rows, columns, detect(columns, task.stream_schema, cfg.data, where)
    except ConfigError as e:
        if train:
            raise
        raise ConfigError(field, f"{cfg.data.validation_file}: {e.message}") from None


def check_stream_head(cfg: RunConfig, task: Task, tokenizer, block_size: int) -> None:
    """A stream's first rows, as a loaded set's are checked: a line that is not JSON, columns that fit none of the
    task's formats (``stream_head``), a row of another format than the first rows' (``keep`` refuses it), and a
    stream that ends within them with no row to train on (naming its columns). Rows further on are the run's to drop
    and count (``keep``). The stream's format is the task's ``stream_format`` from here on."""
    rows, columns, task.stream_format = stream_head(cfg, task)
    keep = task.stream_rows(tokenizer, cfg.data, block_size, task.stream_format)[0]
    kept = [keep(row) for row in rows]
    if len(rows) < STREAM_HEAD_ROWS and not any(kept):
        raise ConfigError("train_file", f"the stream's {len(rows)} rows (columns {columns}) have none to train on: "
                                        f"{getattr(keep, 'drops', 'rows the task cannot use')}; give rows with data")


def stream_data(cfg: RunConfig, task: Task, tokenizer, block_size: int, log, dp: int = 1, rank: int = 0) -> dict:
    """``streaming: true``: {"train": data-parallel rank ``rank`` of ``dp``'s ``TrainStream``, "validation": the
    first ``max_eval_samples`` rows of ``validation_file`` tokenized, or no key without one}. The first training row
    is read and checked here, and a stream without one global batch refused."""
    keep, encode = task.stream_rows(tokenizer, cfg.data, block_size, task.stream_format)
    spec = StreamSpec(cfg.data.data_files("train_file"), cfg.data.shuffle_buffer_size, cfg.train.seed,
                      cfg.train.shuffle)
    bfd = block_size if cfg.data.padding_free else None
    dropped = task.data_record.setdefault("dropped_rows", {})  # summary.json's, as the map-style path counts them
    train = TrainStream(spec, keep=keep, encode=encode, collate=task.collator(tokenizer),
                        micro=cfg.train.per_device_train_batch_size, accumulation=cfg.train.gradient_accumulation_steps,
                        data_parallel_size=dp, rank=rank, bfd_block_size=bfd, max_steps=cfg.train.max_steps,
                        log=log, record=dropped)
    if not train.head(1):
        raise ConfigError("train_file", f"the stream of {spec.files[0]}... has no training row (its columns: "
                                        f"{train.head_columns}; {getattr(keep, 'drops', 'rows the task drops')} are "
                                        "dropped); give rows with data")
    if not train.holds_one_step:  # before the weights load (the loop would meet it at its first step)
        raise no_first_step(train.global_batch_size)
    if bfd:  # what block_size cuts or splits, as seen in the stream's first documents (the rest is cut alike)
        _, whole = task.stream_rows(tokenizer, cfg.data, None, task.stream_format)
        lengths = [len(r["input_ids"]) for r in whole(train.first_window[:STREAM_CUT_SAMPLE])]
        log(cut_report(lengths, block_size, cfg.data.packing_strategy == "bfd_split", "first documents of the stream"))
    lm = {"train": train}
    if cfg.data.validation_file:  # in its own format, as a loaded validation split may be
        eval_keep, eval_encode = task.stream_rows(tokenizer, cfg.data, block_size,
                                                  stream_head(cfg, task, "validation_file")[2])
        lm["validation"] = eval_rows(cfg.data.data_files("validation_file"), eval_keep, eval_encode,
                                     cfg.data.max_eval_samples, bfd, log, record=dropped)
    else:
        log("streaming: no validation_file, so no evaluation (a stream has no held-out part)")
    log(f"streaming {len(spec.files)} file(s) in windows of {spec.window} rows (shuffle_buffer_size), "
        f"{dp} data-parallel rank(s) each tokenizing its own rows")
    return lm

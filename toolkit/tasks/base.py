"""What a recipe trains: the ``Task`` interface (its data, its model class, the loss of one row, its evaluation
metrics) and the plain causal language model.

Everything else (sample order, accumulation, the loss normalisation over the global batch, checkpoints, resume,
export) is the core's, the same for every task. A task answers, for ``toolkit.training.build`` and ``toolkit.training.loop``:

    check(cfg)                          fields the task cannot honour, refused before any work
    load_raw(data_args)                 the raw splits, columns checked (before any weights load)
    prepare_tokenizer(tokenizer, cfg)   e.g. the chat template (checked before the weights load)
    configure_model(config, tokenizer)  e.g. the labels, set on the config before the weights load
    tokenize(raw, tokenizer, data_args, block_size)   rows the collator takes
    collator(tokenizer)                 pads a micro-batch and counts its targets on the CPU (``num_targets``)
    count_targets(batch)                the targets of a micro-batch, as a tensor (the loop's per_micro_batch mode)
    row_losses(model, batch, chunked)   per-row *summed* loss: the loop divides by the global batch's targets
    eval_rows(model, batch, chunked)    per-row tensors for ``gather_for_metrics``; ``eval_metrics`` reduces them
    prepared(accelerator, model)        after the strategy prepared the model (DPO: its live reference, sharded alike);
                                        ``total_steps`` and ``steps_per_epoch`` are set by then
    sample_repeats(cfg)                 each row listed this many times in a row in the sample order (GRPO's groups)
    step_batches(accelerator, model, micro_batches, step)   before each step: the micro-batches it trains on
    log_metrics()                       at each logged step: the task's own metrics (GRPO: rewards, lengths, KL)
    summary(accelerator, model)         collective, at the end: entries the task adds to summary.json
    checkpoint_state(step)              collective, at each checkpoint: the task's JSON-able state (GRPO: a reused batch)
    load_checkpoint_state(saved)        a resume: what checkpoint_state wrote (None if nothing)

and names ``name``, ``auto_class`` (the transformers Auto class of its model), ``peft_task_type`` (LoRA's),
``sequences_per_row`` (the model's rows per dataset row: 1, or 2 for a preference pair), ``best_metric`` (the
eval metric whose best value the summary reports, and which is best), ``row_unit`` (what one dataset row is, in the
run's printed batch sizes: sequences, examples, pairs) and ``loss_unit`` (what the logged loss is a mean of, on the
loss plot's axis: nats/token, nats/example, per pair). The tasks live beside their
data: ``CausalLM`` here, ``ChatSFT`` in ``toolkit.data.chat``, ``SequenceClassification`` in ``toolkit.tasks.classification``;
a new task is a module with a ``Task`` subclass, and the recipe that passes it to ``build``.

A "target" is what the loss averages over: a next-token prediction for a language model (the prompt's tokens are
not targets in SFT), an example for a classifier. Dividing the summed loss of every micro-batch by the targets of
the whole global batch is what makes N ranks x micro-batch b x accumulation k train like one process with N*b*k.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from toolkit.data.packing import packed_inputs
from toolkit.errors import ConfigError


def model_inputs(batch: dict) -> dict:
    """A causal LM's forward arguments: a padded micro-batch's ids and mask, or a packed one's ids and per-document
    positions (``toolkit.data.packing.packed_inputs``: no mask, or the documents would attend to each other)."""
    if "position_ids" in batch:
        return packed_inputs(batch)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}


class Task(ABC):
    """The interface a task implements (see the module docstring); the hooks most tasks leave alone do nothing."""

    name: str
    auto_class: str  # e.g. "AutoModelForCausalLM"
    peft_task_type: str  # peft's TaskType name, e.g. "CAUSAL_LM"
    best_metric: tuple[str, Callable]  # e.g. ("perplexity", min)
    sequences_per_row: int = 1  # sequences a dataset row puts in a micro-batch (a preference pair: 2)
    row_unit: str = "rows"  # what a dataset row is, plural ("global batch 8 pairs")
    loss_unit: str = "per target"  # what the logged loss is a mean of (metrics.jsonl's loss_unit, loss.png's axis)
    # why the task cannot train on a stream (streaming: true), or None when it can (it implements stream_rows)
    stream_refusal: str | None = "it reads the whole training set before step 1"
    log: Callable[[str], None] = print  # where the task says what it did to the data (build sets the run's log)
    # the run's optimizer steps and steps per epoch (None for a stream), set by the loop before ``prepared``
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    stream_format: str | None = None  # a stream's format, from its first rows (build.check_stream_head)

    # The value an unset (None) training field takes for this task: the fields stay listed once, in toolkit.config,
    # and a recipe that needs another default says so here (DPO: disable_dropout true, TRL's default).
    defaults: dict = {"disable_dropout": False}

    def check(self, cfg) -> None:  # noqa: B027 (a hook that does nothing unless a task needs it)
        """Fields that this task cannot honour, refused before any work."""

    def apply_defaults(self, cfg) -> None:
        """Give each training field this task has a default for (``defaults``) that value, where the config left it
        unset."""
        for name, value in self.defaults.items():
            if getattr(cfg.train, name) is None:
                setattr(cfg.train, name, value)

    @abstractmethod
    def load_raw(self, args):
        """The raw splits (a ``DatasetDict`` with train and maybe validation), columns checked."""

    def prepare_tokenizer(self, tokenizer, cfg) -> None:  # noqa: B027 (a hook that does nothing unless a task needs it)
        """Set up or check the tokenizer before the weights load."""

    def configure_model(self, config, tokenizer) -> None:  # noqa: B027 (a hook that does nothing unless a task needs it)
        """Change the model config before the weights load."""

    @abstractmethod
    def tokenize(self, raw, tokenizer, args, block_size: int):
        """The raw splits as rows the collator takes."""

    def stream_rows(self, tokenizer, args, block_size: int, fmt: str | None = None) -> tuple[Callable, Callable]:
        """For ``streaming: true`` (``toolkit.data.stream``): ``keep(row) -> bool``, run on every source row on every
        rank (cheap checks; False skips the row before it gets a global index), and ``encode(rows) -> rows``, the
        rows this rank keeps tokenized as ``tokenize`` would (truncated to ``block_size``). ``fmt``: the stream's
        format (``toolkit.data.formats``), detected from its first rows (``build.stream_head``)."""
        raise NotImplementedError

    @abstractmethod
    def collator(self, tokenizer):
        """Pads a list of rows into a micro-batch with ``num_targets`` and ``num_tokens`` counted on the CPU."""

    @abstractmethod
    def count_targets(self, batch: dict) -> torch.Tensor:
        """The targets of a micro-batch, as a tensor."""

    @abstractmethod
    def row_losses(self, model, batch: dict, chunked: bool = False) -> torch.Tensor:
        """Per-row *summed* loss; ``chunked``: the model's forward computes it (``loss_chunk_size``)."""

    @abstractmethod
    def eval_rows(self, model, batch: dict, chunked: bool = False) -> tuple[torch.Tensor, ...]:
        """Per-row tensors of one eval batch, gathered across ranks and handed to ``eval_metrics``; ``chunked`` as
        for ``row_losses``."""

    @abstractmethod
    def eval_metrics(self, rows: list[tuple[torch.Tensor, ...]]) -> dict:
        """The eval metrics from every batch's gathered ``eval_rows``."""

    def prepared(self, accelerator, model) -> None:  # noqa: B027 (a hook that does nothing unless a task needs it)
        """Called on every rank once the strategy has prepared ``model``, before any step."""

    def sample_repeats(self, cfg) -> int:
        """How many times in a row the sample order lists each dataset row (GRPO: num_generations, a group)."""
        return 1

    def step_batches(self, accelerator, model, micro_batches: list[dict], step: int) -> list[dict]:
        """Collective, every rank, before each optimizer step: the micro-batches the step trains on, made from the
        ones the order gave (GRPO: prompts -> sampled completions). ``step``: optimizer steps done before it."""
        return micro_batches

    def log_metrics(self) -> dict:
        """Collective, at each logged step: the task's metrics since the last log (GRPO: rewards, lengths, KL)."""
        return {}

    def summary(self, accelerator, model) -> dict:
        """Collective (every rank calls it, before the process group ends): entries for the run's summary (by
        default ``data_record``'s)."""
        return dict(self.data_record)

    def checkpoint_state(self, step: int) -> dict | None:
        """Collective, every rank, at each checkpoint after ``step`` steps: what a resume needs of the task beyond the
        weights and the order, JSON-able (``toolkit_state.json``'s ``task``), or None."""
        return None

    def load_checkpoint_state(self, saved: dict | None) -> None:  # noqa: B027 (a hook that does nothing by default)
        """On a resume, every rank, after the checkpoint loaded: what ``checkpoint_state`` wrote (None without it)."""

    @property
    def data_record(self) -> dict:
        """What ``load_raw`` found worth recording in summary.json (a mixture's rows per set), filled by it."""
        if "_data_record" not in vars(self):
            self._data_record = {}
        return self._data_record


def check_stream_packing(args) -> None:
    """On a stream, packing is ``bfd`` over each micro-batch (``toolkit.data.stream``); ``wrapped`` is refused."""
    if args.packing_strategy == "wrapped":
        raise ConfigError("packing_strategy", "wrapped packing mixes neighbouring documents into rows, so on a stream "
                                              "the rows would depend on which documents each rank holds and the order "
                                              "on the world size; use packing_strategy: bfd (whole documents per row, "
                                              "the default with streaming) or packing: false")
    if args.packing and args.packing_strategy != "bfd_split":
        args.packing_strategy = "bfd"


def stream_limit(args, block_size: int) -> int | None:
    """Where a stream's ``encode`` cuts a document: ``block_size``; not at all under bfd_split, whose packing splits
    it (``toolkit.data.packing.pack_rows``)."""
    return None if args.packing and args.packing_strategy == "bfd_split" else block_size

"""Chat SFT: the task (``ChatSFT``) the SFT recipe trains, a causal LM on chats whose loss is on the assistant's
turns only (the label mask: ``toolkit.data.chat``).

One chat per row, truncated to ``block_size``; or, with ``packing: true`` (``packing_strategy: bfd``), several whole
chats per row, each attending only to itself (``toolkit.data.packing``; ``wrapped`` is refused: it would let a chat
attend to the one before it and cut chats across rows); ``bfd_split`` splits a chat longer than ``block_size`` into
pieces packed on their own instead of cutting it. A chat whose assistant tokens all fall beyond ``block_size`` has
nothing to learn and is dropped (not under ``bfd_split``, which keeps them).
"""

from __future__ import annotations

from datasets import DatasetDict

from toolkit.config import DataArguments
from toolkit.data import loading as data
from toolkit.data.chat import check_messages, set_chat_template, tokenize_row
from toolkit.data.formats import CHAT_COLUMNS, convert_row, row_format
from toolkit.data.mixture import load_task_splits
from toolkit.data.packing import pack_splits
from toolkit.data.stream import UnreadableLine
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX
from toolkit.tasks.base import stream_limit
from toolkit.tasks.lm import CausalLM

PYDOC_CHATS = "pydoc-chats"  # the built-in offline set (toolkit.data.builtin.pydoc_chats)


def load_raw_chats(args: DataArguments, record: dict | None = None) -> DatasetDict:
    """The splits in the chat schema (``toolkit.data.formats``: messages, sharegpt, prompt_completion or alpaca rows
    converted), one dataset or a mixture; a mixture's rows per set go into ``record["dataset_mixture"]``."""
    from toolkit.data.builtin import pydoc_chats

    raw, mixture = load_task_splits(args, "chat", {PYDOC_CHATS: pydoc_chats})
    if record is not None and mixture is not None:
        record["dataset_mixture"] = mixture
    return raw


def tokenize_chats(raw: DatasetDict, tokenizer, args: DataArguments, block_size: int, log=print,
                   record: dict | None = None) -> DatasetDict:
    """Every row of the chat schema tokenized with its label mask, truncated to ``block_size`` (packed: by the
    packing, which says how much it cut, or splits it under bfd_split); rows left without a target within block_size
    dropped, counted in one line of ``log`` and per split in ``record["dropped_rows"]`` (summary.json)."""
    cut = None if args.padding_free else block_size  # the packing cuts (pack_splits)
    within = None if args.packing_strategy == "bfd_split" and args.padding_free else block_size

    def tokenize(batch, indices):
        out = {"input_ids": [], "labels": []}
        for row in zip(*(batch[k] for k in CHAT_COLUMNS), indices):
            ids, labels = tokenize_row(tokenizer, *row[:4], f"row {row[4]}")
            out["input_ids"].append(ids[:cut])
            out["labels"].append(labels[:cut])
        return out

    kwargs = {"num_proc": args.preprocessing_num_workers, "load_from_cache_file": not args.overwrite_cache}
    tokenized = data.map_with_tokenizer(raw, tokenize, tokenizer, ("chat", cut), batched=True,
                                        with_indices=True, desc="render chats, mask prompts", **kwargs)
    # position i predicts label i+1, so a row needs a target after its first token
    kept = tokenized.filter(lambda b: [any(x != IGNORE_INDEX for x in labels[1:within]) for labels in b["labels"]],
                            batched=True, desc="drop chats with no assistant token within block_size")
    dropped = {name: len(tokenized[name]) - len(split) for name, split in kept.items()}
    if record is not None:
        record["dropped_rows"] = dropped
    if any(dropped.values()):
        log(f"dropped the chats with no assistant token within block_size {block_size}: " + ", ".join(
            f"{n} of {len(tokenized[name])} in the {name} split" for name, n in dropped.items() if n)
            + " (summary.json's dropped_rows)")
    if len(kept["train"]) == 0:
        raise ConfigError("block_size", f"no training chat has an assistant token within block_size {block_size}; "
                                        "raise block_size")
    if "validation" in kept and len(kept["validation"]) == 0:
        raise ConfigError("block_size", "no validation chat has an assistant token within block_size; raise "
                                         "block_size, or validation_split_percentage: 0 to train without evaluation")
    if args.padding_free:  # whole chats, several per row, each with its own label mask
        return pack_splits(kept, block_size, kwargs, split=args.packing_strategy == "bfd_split")
    return kept


def other_format(row: dict, fmt: str | None, args: DataArguments) -> None:
    """A stream's row in another chat format than the stream's (``fmt``, its first rows'; a file of ``messages``
    rows that goes on in Alpaca rows) stops the stream, on every rank at the same row (``UnreadableLine``: the step
    before it logged and saved). A loaded set of those rows is refused before any work: its columns name one format
    (the first of the task's they fit) and the other format's rows hold nulls there. It was dropped as a row that
    fits no chat format, every one of them, and the run ended with ``data_ran_out``."""
    other = row_format(row, "chat", args)
    if fmt is None or other in (None, fmt):
        return
    given = {column: value for column, value in row.items() if value is not None}
    raise UnreadableLine("dataset_format", f"the stream's rows are in the {fmt} format (its first rows'), but a row "
                                           f"further on is in the {other} format ({given!r:.120}); a stream holds "
                                           "rows of one format, as a loaded set's split does (a loaded set of these "
                                           f"rows is refused too): convert those rows to {fmt}, or train on them "
                                           "apart")


class ChatSFT(CausalLM):
    """Supervised fine-tuning on chats (``messages``): the loss is on the assistant's turns only, one chat per row,
    or whole chats packed best-fit decreasing (``packing: true``: each chat attends only to itself). The label mask
    is built above (``tokenize_chats``); the loss, the collator and the metrics are the causal LM's."""

    name = "chat-sft"
    stream_schema = "chat"  # a stream's columns fit one of the chat formats (build.check_stream_head)

    def check(self, cfg) -> None:
        if cfg.data.packing_strategy == "wrapped":
            raise ConfigError("packing_strategy", "chat SFT packs whole chats only (wrapped would let a chat attend "
                                                  "to the one before it and cut chats across rows); use "
                                                  "packing_strategy: bfd, or packing: false")
        if cfg.data.packing is None:  # unset: one chat per row, unless packing_strategy: bfd asks for packing
            cfg.data.packing = cfg.data.packing_strategy is not None
        if cfg.data.packing and cfg.data.packing_strategy != "bfd_split":
            cfg.data.packing_strategy = "bfd"

    def load_raw(self, args):
        return load_raw_chats(args, self.data_record)

    def stream_rows(self, tokenizer, args, block_size: int, fmt: str | None = None):
        """Each row of the stream converted from the stream's format ``fmt`` (its first rows', as a loaded split's
        is its columns'), then tokenized as ``tokenize_chats`` tokenizes a row of a loaded set."""

        def chat_row(row) -> dict:
            return convert_row(row, "chat", args, f"a row of the stream (columns {sorted(row)})", fmt)

        def keep(row) -> bool | None:
            # Mid-run, a row that fits no chat format is dropped and counted (None), as a text stream drops a null
            # text: stopping there would end the run without its summary, evaluation or export, and a resume would
            # stop at the same row again. (A loaded set refuses such a row before any work, naming it.) A row of
            # another format stops the stream, as a loaded set refuses it (other_format).
            try:
                converted = chat_row(row)
                if converted["prompt"] is None and not converted["prompt_turns"]:
                    check_messages(converted["messages"], f"a row of the stream (columns {sorted(row)})")
            except ConfigError:
                other_format(row, fmt, args)
                return None
            return True  # a chat with no assistant token within block_size stays: a row without targets

        keep.drops = "rows that fit no chat format (null or malformed messages, prompt or completion)"

        limit = stream_limit(args, block_size)

        def encode(rows):
            out = []
            for row in rows:
                converted = chat_row(row)
                ids, labels = tokenize_row(tokenizer, *(converted[k] for k in CHAT_COLUMNS), "a row of the stream")
                out.append({"input_ids": ids[:limit], "labels": labels[:limit]})
            return out

        return keep, encode

    def prepare_tokenizer(self, tokenizer, cfg) -> None:
        set_chat_template(tokenizer, cfg.data.chat_template)

    def tokenize(self, raw, tokenizer, args, block_size: int):
        return tokenize_chats(raw, tokenizer, args, block_size, self.log, self.data_record)

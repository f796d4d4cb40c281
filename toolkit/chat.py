"""Chat data for supervised fine-tuning: load ``messages`` rows, render them with the chat template, and label only
what the assistant says.

A row is ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` (the conversational format of
TRL and the Hub's chat datasets); ShareGPT, Alpaca and prompt-completion rows are converted to it first
(``toolkit.formats``: a prompt-completion row keeps its completion as the only target, a standard one is plain text
labelled by the completion's characters, ``tokenize_completion``). The loss is on the assistant's turns only: every prompt token (system, user, the
template's markers) is labelled -100; each assistant turn *and its end-of-turn token* are targets, so the model learns
to stop. In a multi-turn chat every assistant turn is a target.

How the turns are found, for any template: the chat is rendered as text once, and for each assistant turn i the
template renders the conversation before it with the generation prompt (``messages[:i]``, what a user's inference
call would send) and the conversation up to it (``messages[:i+1]``). Both must be prefixes of the whole rendering
(templates that rewrite earlier turns, e.g. ones that drop past reasoning, are refused with the reason). A turn ends
at the template's end-of-turn token (the tokenizer's EOS, e.g. ``<|im_end|>``); what the template writes after it (a
newline) is formatting, not a target. The whole rendering is then tokenized once, so the training ids are exactly
``tokenizer.apply_chat_template(messages)``'s, and a token is a target by where its characters lie (its offsets).
Tokenizing the prompt and each answer separately would not give those ids: a SentencePiece (Metaspace) tokenizer
starts every piece with a ``▁`` (docs/pitfalls.md#metaspace-pieces). ``tokenize_chat`` states what a token that
straddles a prompt/answer boundary becomes.

One chat per row, truncated to ``block_size``; or, with ``packing: true`` (``packing_strategy: bfd``), several whole
chats per row, each attending only to itself (``toolkit.packing``; ``wrapped`` is refused: it would let a chat attend
to the one before it and cut chats across rows); ``bfd_split`` splits a chat longer than ``block_size`` into pieces
packed on their own instead of cutting it. A chat whose assistant tokens all fall beyond ``block_size`` has nothing
to learn and is dropped (not under ``bfd_split``, which keeps them).

``ChatSFT``, at the end, is the task (``toolkit.tasks.Task``) that the SFT recipe trains: a causal LM on these rows.
"""

from __future__ import annotations

import os

from datasets import DatasetDict

from toolkit import data
from toolkit.config import DataArguments
from toolkit.errors import ConfigError
from toolkit.formats import CHAT_COLUMNS, convert_row, row_format
from toolkit.loss import IGNORE_INDEX
from toolkit.mixture import load_task_splits
from toolkit.packing import pack_splits
from toolkit.stream import UnreadableLine
from toolkit.tasks import CausalLM, stream_limit

ROLES = ("system", "user", "assistant")
PYDOC_CHATS = "pydoc-chats"  # the built-in offline set (toolkit.builtin_data.pydoc_chats)


def set_chat_template(tokenizer, chat_template: str | None) -> None:
    """The ``chat_template`` field (a Jinja string, or a file holding one) overrides the tokenizer's; a tokenizer
    with neither is refused (before any weights load)."""
    if chat_template:
        if os.path.isfile(chat_template):
            with open(chat_template) as f:
                chat_template = f.read()
        elif "{%" not in chat_template and "{{" not in chat_template:
            raise ConfigError("chat_template", f"{chat_template!r} is neither a file nor a Jinja template")
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("chat_template", f"the tokenizer {tokenizer.name_or_path!r} has no chat template; set "
                                           "chat_template to a Jinja template (or a file holding one), e.g. the "
                                           "ChatML template of an instruct model of the same family")


def load_raw_chats(args: DataArguments, record: dict | None = None) -> DatasetDict:
    """The splits in the chat schema (``toolkit.formats``: messages, sharegpt, prompt_completion or alpaca rows
    converted), one dataset or a mixture; a mixture's rows per set go into ``record["dataset_mixture"]``."""
    from toolkit.builtin_data import pydoc_chats

    raw, mixture = load_task_splits(args, "chat", {PYDOC_CHATS: pydoc_chats})
    if record is not None and mixture is not None:
        record["dataset_mixture"] = mixture
    return raw


def _looks_like_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)


def check_messages(messages, where: str) -> None:
    """Roles known, contents text, no assistant turn without a prompt before it, at least one assistant turn."""
    if not _looks_like_messages(messages):
        raise ConfigError("text_column_name", f"{where}: expected a list of {{role, content}}, got {messages!r:.200}")
    for m in messages:
        if m["role"] not in ROLES:
            raise ConfigError("text_column_name", f"{where}: unknown role {m['role']!r}; use {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ConfigError("text_column_name", f"{where}: a {m['role']} message has no text content")
    if messages and messages[0]["role"] == "assistant":
        raise ConfigError("text_column_name", f"{where}: the chat starts with an assistant turn; nothing prompts it")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError("text_column_name", f"{where}: no assistant turn, so nothing to learn; remove the row")


def _render(tokenizer, messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans [start, end) of each assistant turn (its end-of-turn included)."""
    full = _render(tokenizer, messages)
    eos = tokenizer.eos_token
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1])
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise ConfigError("chat_template", "the chat template renders earlier turns differently once later ones "
                                               "follow, so the assistant's tokens cannot be told from the prompt's; "
                                               "use a template whose rendering of a chat starts with the rendering "
                                               "of each of its beginnings")
        end = len(upto)
        if eos:
            stop = upto.rfind(eos, len(prompt))
            if stop >= 0:
                end = stop + len(eos)
        spans.append((len(prompt), end))
    return full, spans


def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """``input_ids`` and ``labels`` of one chat: the ids ``tokenizer.apply_chat_template(messages)`` gives (the whole
    rendering tokenized once, without adding special tokens: a BOS the template writes is in the text), and as labels
    the ids of the tokens on assistant turns, -100 elsewhere.

    A token whose characters straddle a prompt/answer boundary (``'ĠSure'`` after a generation prompt that ends with
    a space) is a target when at least half of its characters are assistant text: the answer's first word is learned,
    a template marker that merely touches the answer is not. A token with no characters (offsets ``(i, i)``) is a
    target when ``i`` lies inside an assistant turn. A tokenizer without character offsets (no fast version) is cut
    at the turn boundaries instead, and refused where that changes the ids."""
    full, spans = assistant_spans(tokenizer, messages)
    return tokenize_spans(tokenizer, full, spans)


def tokenize_spans(tokenizer, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """``full`` tokenized once (no special tokens added), labelled by ``spans`` (``tokenize_chat``'s policy); the
    preference task labels a text completion with it too."""
    if not getattr(tokenizer, "is_fast", False):  # a Python tokenizer: no character offsets
        return _tokenize_in_pieces(tokenizer, full, spans)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    return ids, [i if _is_target(start, end, spans) else IGNORE_INDEX for i, (start, end) in
                 zip(ids, enc["offset_mapping"])]


def _is_target(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """The boundary policy (``tokenize_chat``): at least half of the token's characters lie in assistant spans."""
    if end <= start:
        return any(a <= start < b for a, b in spans)
    inside = sum(max(0, min(end, b) - max(start, a)) for a, b in spans)
    return 2 * inside >= end - start


def _tokenize_in_pieces(tokenizer, full: str, spans) -> tuple[list[int], list[int]]:
    """Without offsets: the prompt and answer pieces tokenized one by one, accepted only if they give the whole
    rendering's ids (a SentencePiece tokenizer adds a '▁' at each piece's start: refused)."""
    ids, labels, at = [], [], 0
    for start, end in [*spans, (len(full), len(full))]:
        for piece, target in ((full[at:start], False), (full[start:end], True)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += piece_ids
                labels += piece_ids if target else [IGNORE_INDEX] * len(piece_ids)
        at = end
    if ids != tokenizer(full, add_special_tokens=False)["input_ids"]:
        raise ConfigError("tokenizer_name", f"{tokenizer.name_or_path!r} gives no character offsets (not a fast "
                                            "tokenizer), and tokenizing the chat turn by turn changes its ids, so "
                                            "the assistant's tokens cannot be found; use the fast tokenizer "
                                            "(tokenizer.json) of this model")
    return ids, labels


def tokenize_completion(tokenizer, prompt, completion, where: str) -> tuple[list[int], list[int]]:
    """``input_ids`` and ``labels`` of prompt + completion, tokenized as one text; the completion's tokens are the
    targets: conversational (lists of messages), its assistant turns with their end-of-turn tokens, as a chat's are
    labelled; standard (strings), prompt + completion + EOS as plain text (no chat template; EOS appended unless the
    completion ends with it, as TRL does), the completion and its EOS labelled by their characters."""
    if isinstance(prompt, list):
        if not any(m.get("role") == "assistant" and str(m.get("content", "")).strip() for m in completion):
            raise ConfigError("train_file", f"{where}: the completion has no assistant text; remove the row")
        messages = prompt + completion
        check_messages(messages, where)
        full, spans = assistant_spans(tokenizer, messages)
        start = len(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
        return tokenize_spans(tokenizer, full, [s for s in spans if s[0] >= start])
    if not isinstance(completion, str) or not completion.strip():
        raise ConfigError("train_file", f"{where}: the completion is empty; remove the row")
    eos = tokenizer.eos_token or ""
    full = prompt + completion + ("" if completion.endswith(eos) else eos)  # TRL appends EOS to text completions
    return tokenize_spans(tokenizer, full, [(len(prompt), len(full))])


def tokenize_row(tokenizer, messages, prompt_turns: int, prompt, completion, where: str):
    """One row of the chat schema (``toolkit.formats``): a chat (every assistant turn a target), a conversational
    prompt-completion (the turns after the first ``prompt_turns``) or a standard one (``prompt``/``completion``)."""
    if prompt is not None:
        return tokenize_completion(tokenizer, prompt, completion, where)
    if prompt_turns:
        return tokenize_completion(tokenizer, messages[:prompt_turns], messages[prompt_turns:], where)
    check_messages(messages, where)
    return tokenize_chat(tokenizer, messages)


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

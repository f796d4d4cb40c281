"""Datasets for causal-LM training: load (Hub, local files, or the embedded ``pydoc`` text), tokenize, pack or pad.

Tokenization and packing run through ``datasets.map(batched=True)`` so results are cached on disk for file-backed
datasets; the recipe wraps the calls in ``accelerator.main_process_first()`` so rank 0 fills the cache and the
others read it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from datasets import Dataset, DatasetDict, Value, load_dataset

from toolkit.config import DATA_EXTENSIONS, DataArguments
from toolkit.data.packing import SEQ_LENGTHS, collate_packed, document_lengths, pack_splits
from toolkit.env import hub
from toolkit.errors import ConfigError
from toolkit.loss import count_targets

PYDOC = "pydoc"


def pydoc_dataset() -> DatasetDict:
    """CPython's reference documentation (``pydoc_data.topics``), shipped with every Python: no download.

    One row per paragraph. The split is by topic (every 10th topic, in sorted order, is validation) so no
    validation paragraph shares a topic with training: a fixed split, the same on every machine.
    """
    from pydoc_data.topics import topics

    train, valid, seen = [], [], set()
    for i, name in enumerate(sorted(topics)):
        for p in topics[name].split("\n\n"):
            p = p.strip()
            if p and p not in seen:  # some sections are repeated under several topics: keep the first only
                seen.add(p)
                (valid if i % 10 == 0 else train).append(p)
    return DatasetDict({"train": Dataset.from_dict({"text": train}), "validation": Dataset.from_dict({"text": valid})})


def load_raw_datasets(args: DataArguments, log=print) -> DatasetDict:
    """A DatasetDict with 'train' and (unless there is none) 'validation', and the text column checked; rows with no
    text (null, empty or not a string) dropped and counted in one line of ``log``, as a stream drops them
    (``CausalLM.stream_rows``)."""
    return drop_null_texts(load_splits(args, {PYDOC: pydoc_dataset}), text_column(args), log)


def has_text(value) -> bool:
    """Whether a text column's value is something to train on: a string with a character (null, "" and a value of
    another type are not: dropped and counted on both paths, the map-style one here and a stream's ``keep``)."""
    return isinstance(value, str) and value != ""


def drop_null_texts(raw: DatasetDict, column: str, log=print, record: dict | None = None) -> DatasetDict:
    """The text column checked (present, text) and its rows with no text (null, empty, or a value that is not a
    string in a column of mixed types) dropped, counted in one line; the counts per split go into
    ``record["dropped_rows"]`` (summary.json)."""
    check_text_column(raw, column, nulls=False, mixed=True)
    out, counts = {}, {}
    for name, split in raw.items():
        if not _mixed(split, column) and not _no_text_count(split, column):
            out[name], counts[name] = split, 0  # nothing to drop: no pass over the split
            continue
        kept = split.filter(lambda texts: [has_text(t) for t in texts], input_columns=column, batched=True,
                            desc="drop rows with no text")
        counts[name] = len(split) - len(kept)
        if _mixed(kept, column):  # a column of mixed types (read as JSON) is text once the other values are gone
            features = kept.features.copy()
            features[column] = Value("string")
            kept = kept.map(lambda texts: {column: texts}, input_columns=column, batched=True, features=features,
                            desc="texts as strings")
        out[name] = kept
    if any(counts.values()):
        log("dropped the rows with no text (null, empty or not a string) in column {!r}: {}".format(column, ", ".join(
            f"{n} of {len(raw[name])} in the {name} split" for name, n in counts.items() if n)))
    if record is not None:
        record["dropped_rows"] = counts
    return DatasetDict(out)


def _is_text(feature) -> bool:
    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def _mixed(split, column: str) -> bool:
    """A column of values of several types, which datasets reads as JSON (its ``Json`` feature)."""
    return type(split.features[column]).__name__ == "Json"


def _no_text_count(split, column: str) -> int:
    """Null and empty texts of a text column, counted by pyarrow (no pass in Python)."""
    import pyarrow.compute as pc

    values = split.data.column(column)
    return values.null_count + int(pc.sum(pc.equal(values, "")).as_py() or 0)


def check_text_column(raw: DatasetDict, column: str, nulls: bool = True, mixed: bool = False) -> None:
    """Every split has ``column``, it holds strings (``mixed``: or values of mixed types, which datasets reads as
    JSON: the caller drops those that are not strings), and (``nulls``) none is null."""
    for split_name, split in raw.items():
        if column not in split.column_names:
            raise ConfigError(
                "text_column_name",
                f"column {column!r} not in the {split_name} split; it has {split.column_names}",
            )
        feature = split.features[column]
        if not (_is_text(feature) or (mixed and _mixed(split, column))):
            raise ConfigError("text_column_name", f"column {column!r} of the {split_name} split holds {feature}, not "
                                                  "text; name the column that holds the text")
        # Null texts would be tokenized as "" and dropped without a word: say how many, and where.
        count = split.data.column(column).null_count if nulls else 0
        if count:
            raise ConfigError("text_column_name", f"{count} of {len(split)} rows of the {split_name} split have no "
                                                  f"text (null) in column {column!r}; remove or fill them")


def check_validation_columns(raw: DatasetDict, expected: list[str], args: DataArguments) -> None:
    """A validation_file (read apart from train_file: ``load_splits``) without a column the task reads: one line
    naming it, the columns it has and those expected."""
    if "validation" not in raw or not args.validation_file:
        return
    columns = raw["validation"].column_names
    missing = [c for c in expected if c not in columns]
    if missing:
        raise ConfigError("validation_file", f"{args.validation_file} has the columns {columns}, without {missing}: "
                                             f"this recipe reads {expected} (train_file has "
                                             f"{raw['train'].column_names}); give the validation rows those columns")


def load_splits(args: DataArguments, builtin: dict, holdout=None) -> DatasetDict:
    """'train' and (unless there is none) 'validation' from a built-in set (``builtin``: name -> function), the Hub
    or local files; ``max_train_samples`` / ``max_eval_samples`` applied. Columns are the caller's to check.
    ``holdout(train, fraction) -> (train, validation)`` splits local files that come without a validation file
    (default: the last ``validation_split_percentage`` percent, in file order)."""
    if args.dataset_name in builtin:
        raw = builtin[args.dataset_name]()
    elif args.dataset_name is not None:
        offline = hub.offline_if_unreachable(args.dataset_name)
        try:
            raw = load_dataset(args.dataset_name, args.dataset_config_name)
        except ConnectionError as e:  # datasets' "Couldn't reach ... on the Hub", after its retries unless offline
            why = hub.not_cached(args.dataset_name, offline) if offline else str(e).splitlines()[0][:200]
            raise ConfigError("dataset_name", f"cannot load {args.dataset_name!r}: {why}") from None
        if "validation" not in raw and args.validation_split_percentage > 0:
            pct = args.validation_split_percentage
            raw = DatasetDict(
                {
                    "train": load_dataset(args.dataset_name, args.dataset_config_name, split=f"train[{pct}%:]"),
                    "validation": load_dataset(args.dataset_name, args.dataset_config_name, split=f"train[:{pct}%]"),
                }
            )
    else:
        files = {"train": args.data_files("train_file")}
        if args.validation_file:
            files["validation"] = args.data_files("validation_file")
        builder, kwargs = file_builder(files)
        # each split read on its own: a validation file with other columns than the training file's is then the
        # format detection's to accept or refuse, naming it (toolkit.data.formats), not a cast error inside datasets
        raw = DatasetDict({split: read_files(builder, paths, kwargs, f"{split}_file") for split, paths in files.items()})
        if "validation" not in raw and args.validation_split_percentage > 0:
            fraction = args.validation_split_percentage / 100
            if holdout is None:
                # the seed changes no row (no shuffle) but names the split: without one, datasets names it from
                # numpy's global state, so another process (toolkit train's check, a rank) missed its tokenize cache
                split = raw["train"].train_test_split(test_size=fraction, shuffle=False, seed=0)
                train, validation = split["train"], split["test"]
            else:
                train, validation = holdout(raw["train"], fraction)
            raw = DatasetDict({"train": train, "validation": validation})
    if args.max_train_samples:
        raw["train"] = sample_rows(raw["train"], args.max_train_samples, args.sample_seed)
    if args.max_eval_samples and "validation" in raw:
        raw["validation"] = sample_rows(raw["validation"], args.max_eval_samples, args.sample_seed)
    return raw


def read_files(builder: str, paths: list[str], kwargs: dict, field: str) -> Dataset:
    """One split of local files (``field`` names them in an error): a malformed JSON line is one line naming the file
    and the line number, not pyarrow's trace."""
    try:
        return load_dataset(builder, data_files={"train": paths}, split="train", **kwargs)
    except Exception as e:  # noqa: BLE001 (malformed json/csv: name the file, not a pyarrow internals trace)
        raise unreadable(field, paths, e) from None


def unreadable(field: str, paths: list[str], error: BaseException) -> ConfigError:
    """The error of files that could not be read: the first line that is not one JSON object, named by file and line
    number, when the files are JSON lines; else the reader's own first line."""
    bad = bad_json_line(paths)
    if bad is None:
        return ConfigError(field, f"cannot read {paths}: {type(error).__name__}: {str(error).splitlines()[0][:300]}; "
                                  "fix or remove the row it names")
    path, number, why = bad
    return ConfigError(field, f"{path} line {number} is not a JSON object ({why}); fix or remove that line")


def bad_json_line(paths: list[str]) -> tuple[str, int, str] | None:
    """(path, line number from 1, why) of the first line of these JSON-lines files that is not one JSON object;
    None when every line is one, or a file is not JSON lines (one JSON document, e.g. a list)."""
    for path in paths:
        if os.path.splitext(path)[1].lower() not in (".json", ".jsonl"):
            continue
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                why = json_object(line)[1]
                if why is not None:
                    return None if number == 1 and _one_document(path) else (path, number, why)
    return None


def json_object(line: bytes | str) -> tuple[dict | None, str | None]:
    """One JSON-lines line: (its object, None), or (None, why it is not one JSON object)."""
    try:
        value = json.loads(line)
    except ValueError as e:
        return None, str(e)[:120]
    if not isinstance(value, dict):
        return None, f"a JSON {type(value).__name__}, not an object"
    return value, None


def _one_document(path: str) -> bool:
    """Whether the file is one JSON document (a list of rows, or an object spread over lines), not JSON lines."""
    try:
        with open(path, "rb") as f:
            json.load(f)
    except ValueError:
        return False
    return True


def file_builder(files: dict) -> tuple[str, dict]:
    """The ``datasets`` builder that reads every file of ``files`` (split -> paths) and its keyword arguments;
    refuses splits of different formats."""
    builders = {DATA_EXTENSIONS[os.path.splitext(p)[1].lower()] for paths in files.values() for p in paths}
    if len(builders) != 1:
        raise ConfigError("validation_file", "train_file and validation_file must have the same format")
    builder = builders.pop()
    return builder, {"keep_linebreaks": True} if builder == "text" else {}


def sample_rows(split, n: int, seed: int):
    """``n`` rows drawn at random (seeded) from ``split``, in their original relative order; all of it if n >= its
    length. Not the first n: on data sorted by class or by source (the built-in ``stdlib-docstrings``) those are a
    few classes only. Every rank draws the same rows (Python's ``random`` with the run's seed, no process state),
    so the sample is the same on any world size; a different seed draws different rows."""
    import random

    if n >= len(split):
        return split
    return split.select(sorted(random.Random(seed).sample(range(len(split)), n)))


def text_column(args: DataArguments) -> str:
    return args.text_column_name or "text"


def resolve_block_size(args: DataArguments, tokenizer, model_positions: int | None) -> int:
    """run_clm's default: the tokenizer's max length capped at 1024, and never above the model's positions."""
    if args.block_size is not None:
        if model_positions is not None and args.block_size > model_positions:
            raise ConfigError("block_size", f"{args.block_size} exceeds the model's {model_positions} positions")
        return args.block_size
    limit = min(1024, tokenizer.model_max_length or 1024)
    return min(limit, model_positions) if model_positions else limit


def token_encoder(tokenizer):
    """A function ``texts -> list of token id lists`` equal to ``tokenizer(texts, add_special_tokens=False)``, and
    a name for it (part of the map's cache fingerprint).

    A fast tokenizer's Rust backend is called directly (``encode_batch_fast``: no character offsets), instead of
    ``tokenizer(texts)``, which computes offsets and converts every ``Encoding`` into Python dicts: the whole
    tokenize + pack runs at 1.73x run_clm's documents/s with it, 1.13x without (bench/data_prep.py, identical
    rows). It is used only where it is the same thing: no truncation or padding configured on the backend
    (``tokenizer()`` turns those off per call), no special-token splitting, and the same ids on a probe of real
    texts; otherwise the tokenizer's own call.
    """

    def slow(texts):
        return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return slow, "tokenizer"
    # tokenizer() sets the backend's encode_special_tokens from split_special_tokens on every call, but a pickled
    # backend (datasets' num_proc workers) drops the flag and the backend's JSON (the map's fingerprint) omits it
    # (docs/pitfalls.md#pickled-split-special-tokens): a tokenizer that splits special tokens goes through its call.
    if getattr(tokenizer, "split_special_tokens", False) or backend.encode_special_tokens:
        return slow, "tokenizer"

    def fast(texts):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]

    probe = PROBE_TEXTS + _probe_corpus()
    return (fast, "backend") if fast(probe) == slow(probe) else (slow, "tokenizer")


# Texts where a Python-side step of a tokenizer would show (spaces, special-token text, accents, CJK, emoji).
PROBE_TEXTS = ["", " ", "  leading spaces", "Hello world!", "<|endoftext|> and </s> <s> [CLS] <unk>", "naïve café",
               "日本語のテキスト", "emoji \U0001f600 tab\tnewline\n", "x" * 300]


def _probe_corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k][:2000] for k in sorted(topics)[:8]]


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's whole state, for a map's fingerprint: a fast tokenizer's backend JSON (vocabulary, merges,
    normalizer, pre-tokenizer, post-processor, added tokens) and every other attribute (special tokens, chat
    template, sides, ...) but the Python copies of the vocabulary and merges that the JSON holds. 0.017 s for GPT-2's
    tokenizer where datasets' dill pickling of the object takes 0.35 s (measured, datasets 5.2)."""
    from datasets.fingerprint import Hasher

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return Hasher.hash(tokenizer)
    rest = {k: v for k, v in vars(tokenizer).items()
            if k not in ("_tokenizer", "_vocab", "_merges", "cache", "deprecation_warnings")}
    return Hasher.hash((type(tokenizer).__qualname__, backend.to_str(), rest))


def map_with_tokenizer(raw: DatasetDict, function, tokenizer, settings: tuple, **map_kwargs) -> DatasetDict:
    """``raw.map(function, remove_columns=<the split's columns>, **map_kwargs)`` for a ``function`` that reads
    ``tokenizer`` and ``settings`` (everything else it closes over), each split with its fingerprint given: datasets
    would otherwise dill-pickle the function, the tokenizer in it, to hash it for every split on every rank (0.35 s
    each with GPT-2's tokenizer). The fingerprint holds what datasets' own would: the split's, the function's code,
    the tokenizer's state and the settings (the map's other arguments are fixed by the caller's code)."""
    from datasets.fingerprint import Hasher

    identity = (function.__code__, tokenizer_fingerprint(tokenizer), settings)
    return DatasetDict({name: split.map(function, remove_columns=split.column_names,
                                        new_fingerprint=Hasher.hash((split._fingerprint, identity)), **map_kwargs)
                        for name, split in raw.items()})


def tokenize_and_group(raw: DatasetDict, tokenizer, args: DataArguments, block_size: int) -> DatasetDict:
    """Tokenize with a batched map, then pack into ``block_size`` rows or truncate one example per row."""
    column = text_column(args)
    eos = tokenizer.eos_token_id
    encode, how = token_encoder(tokenizer)
    # unset (None): the causal LM's default, as CausalLM.check resolves it; bfd keeps documents whole (below)
    wrapped = args.packing is not False and not args.padding_free

    def tokenize(batch):
        texts = [t if isinstance(t, str) else "" for t in batch[column]]
        # End every document with EOS so packed rows mark where one text stops and the next starts.
        return {"input_ids": [x + [eos] if eos is not None and x else x for x in encode(texts)]}

    map_kwargs: dict[str, Any] = {"num_proc": args.preprocessing_num_workers, "load_from_cache_file": not args.overwrite_cache}
    tokenized = map_with_tokenizer(raw, tokenize, tokenizer, (column, eos, how), batched=True, desc="tokenize",
                                   **map_kwargs)

    if wrapped:
        grouped = DatasetDict({name: pack(split, block_size, map_kwargs) for name, split in tokenized.items()})
    elif args.padding_free:  # bfd, bfd_split: packing cuts (or splits) what exceeds block_size, and says how much
        # A row with fewer than 2 tokens has no next-token target: drop it rather than feed a zero-token loss.
        kept = tokenized.filter(lambda b: [len(ids) >= 2 for ids in b["input_ids"]], batched=True,
                                desc="drop rows < 2 tokens")
        grouped = pack_splits(kept, block_size, map_kwargs, split=args.packing_strategy == "bfd_split")
    else:
        grouped = tokenized.map(
            lambda b: {"input_ids": [ids[:block_size] for ids in b["input_ids"]]},
            batched=True,
            desc=f"truncate to {block_size}",
            **map_kwargs,
        ).filter(lambda b: [len(ids) >= 2 for ids in b["input_ids"]], batched=True, desc="drop rows < 2 tokens")

    what = f"fewer than {block_size} tokens in all (packing)" if wrapped else "rows all shorter than 2 tokens"
    if "validation" in grouped and len(grouped["validation"]) == 0:
        # Otherwise evaluation would silently never happen.
        raise ConfigError(
            "block_size" if wrapped else ("validation_file" if args.validation_file else "dataset_name"),
            f"the validation split has no rows after tokenization: {what}; use more validation data or a smaller "
            "block_size, or validation_split_percentage: 0 (without validation_file) to train without evaluation",
        )
    if len(grouped["train"]) == 0:
        raise ConfigError(
            "train_file" if args.train_file else "dataset_name",
            f"no training rows after tokenization: {what}; use more data or a smaller block_size",
        )
    return grouped


PACK_BATCH_ROWS = 10_000  # documents per packing map batch: bounds its Python lists (~100 bytes per token)


def pack(tokenized: Dataset, block_size: int, map_kwargs: dict) -> Dataset:
    """Concatenate every document (each ending in EOS) into one token stream and cut it into ``block_size`` rows.

    Only the stream's final partial block (< block_size tokens) is left out. run_clm's ``group_texts`` instead drops
    each 1000-row map batch's tail, up to block_size-1 tokens per batch; a single map batch over the whole split
    avoids that but holds the split in Python lists (docs/pitfalls.md#packing). Here the map
    batches are bounded (``PACK_BATCH_ROWS`` documents) and the result is the same as one batch: each block belongs
    to the batch in which it *starts*, and a block that runs past the batch's last document reads the few documents
    it needs from the dataset (at most block_size tokens). Stateless per batch, so ``num_proc`` and the cache work.
    """
    import numpy as np

    lengths = document_lengths(tokenized)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # starts[i]: offset of document i
    n_blocks = int(starts[-1]) // block_size

    def blocks(batch, indices):
        first, end = indices[0], indices[-1] + 1
        k0 = -(-int(starts[first]) // block_size)  # first block starting in this batch's tokens
        k1 = min(-(-int(starts[end]) // block_size), n_blocks)  # one past the last
        if k1 <= k0:
            return {"input_ids": []}
        stream = [tok for ids in batch["input_ids"] for tok in ids]
        need = k1 * block_size - int(starts[end])  # tokens the last block takes from the documents after this batch
        if need > 0:
            stop = int(np.searchsorted(starts, k1 * block_size, side="left"))  # documents [end, stop) cover them
            stream += [tok for ids in tokenized[end:stop]["input_ids"] for tok in ids][:need]
        base = int(starts[first])
        return {"input_ids": [stream[k * block_size - base:(k + 1) * block_size - base] for k in range(k0, k1)]}

    return tokenized.map(blocks, batched=True, batch_size=PACK_BATCH_ROWS, with_indices=True,
                         new_fingerprint=f"{tokenized._fingerprint}-pack{block_size}-{PACK_BATCH_ROWS}",
                         desc=f"pack into {block_size}-token rows", **map_kwargs)


def pad_right(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences right-padded to the longest, and their attention mask (1 on real tokens)."""
    length = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, :len(seq)] = 1
    return ids, mask


class CausalLMCollator:
    """Right-pads a list of ``{"input_ids": [...]}`` rows to the longest in the batch.

    Pad positions get attention_mask 0 and label -100, so they carry no loss and (with right padding and a causal
    mask) do not change the logits of real tokens: a padded row trains exactly like the same row alone. Rows that
    carry their own ``labels`` (chat SFT: -100 on the prompt) keep them; otherwise the labels are the input ids.

    ``num_targets`` (next-token targets) and ``num_tokens`` (non-pad tokens) are counted here, on the CPU, as plain
    ints: the loop normalises by the global batch's targets without a micro-step waiting for the device.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if SEQ_LENGTHS in rows[0]:  # whole documents packed per row (bfd, bfd_split): flattened into one row
            return collate_packed(rows)
        ids, mask = pad_right([r["input_ids"] for r in rows], self.pad_token_id)
        labels = ids.masked_fill(mask == 0, -100)
        if "labels" in rows[0]:
            labels = torch.full_like(ids, -100)
            for i, r in enumerate(rows):
                labels[i, :len(r["labels"])] = torch.as_tensor(r["labels"], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "num_targets": int(count_targets(labels)), "num_tokens": int(mask.sum()), "num_slots": ids.numel()}

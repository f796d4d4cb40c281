"""A task's raw splits: one dataset (``dataset_name`` or ``train_file``), or several mixed (``dataset_mixture``),
each converted to the task's schema (``toolkit.data.formats``).

``dataset_mixture`` has alignment-handbook's shape and meaning (its ``DatasetMixtureConfig`` and ``get_dataset``):

    dataset_mixture:
      datasets:
        - id: data/chats.jsonl     # a local file or glob, a built-in set (pydoc-chats, ...), or a Hub dataset
          config: null             # the Hub dataset's configuration
          split: train             # the Hub dataset's split (a local file is one split: train)
          columns: [messages]      # the columns to keep (all by default)
          weight: 1.0              # the fraction of the set's rows to take, in (0, 1]
      seed: 0
      test_split_size: 0.05        # the fraction of the mixture held out for evaluation (none by default)

Each set is loaded, its columns selected, converted to the schema (so sets of different formats mix), and
``int(weight x rows)`` of its rows drawn with the seed (``data.sample_rows``: Python's ``random`` seeded, no process
state, the rows kept in their file order: the same rows on any world size). The sets are concatenated in the order
given and ``test_split_size`` of the whole is held out (``train_test_split`` with the seed: numpy's generator from
the seed, the same split everywhere). The sets' own validation splits are not used: the held-out part is drawn from
the same mixture the model trains on, as the handbook does; without ``test_split_size`` there is no evaluation.
The training order is then the core's (``toolkit.data.order``), independent of the world size like any other set's.
"""

from __future__ import annotations

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset

from toolkit.config import DataArguments, mixture_files
from toolkit.data import loading as data
from toolkit.data.formats import announce, convert, convert_splits, detect, detect_split
from toolkit.env import hub
from toolkit.errors import ConfigError


def load_task_splits(args: DataArguments, schema: str, builtin: dict) -> tuple[DatasetDict, dict | None]:
    """The task's raw splits in ``schema`` and, for a mixture, the rows taken from each set (summary.json's
    ``dataset_mixture``; None for one dataset)."""
    if args.dataset_mixture is None:
        raw = data.load_splits(args, builtin)
        if schema == "text":  # the causal LM's text is trained on as loaded
            for name, split in raw.items():
                detect_split(name, split.column_names, schema, args)
            return raw, None
        return convert_splits(raw, schema, args), None
    return load_mixture(args, schema, builtin)


def load_mixture(args: DataArguments, schema: str, builtin: dict) -> tuple[DatasetDict, dict]:
    """``dataset_mixture``'s sets, each converted and sampled, concatenated, and its held-out part split off."""
    mixture = args.dataset_mixture
    seed, parts, record = mixture["seed"], [], []
    for i, entry in enumerate(mixture["datasets"]):
        where = f"dataset_mixture datasets[{i}] ({entry['id']})"
        split = _select_columns(load_set(entry, builtin, where), entry["columns"], where)
        fmt = detect(split.column_names, schema, args, where)
        converted = convert(split, fmt, schema, args, where, select=True)
        n = int(len(converted) * entry["weight"])
        if n == 0:
            raise ConfigError("dataset_mixture", f"{where}: weight {entry['weight']} of its {len(converted)} rows "
                                                 "takes no row; raise the weight or remove the set")
        parts.append(data.sample_rows(converted, n, seed))
        record.append({"id": entry["id"], "split": entry["split"], "format": fmt, "rows": n, "of": len(converted)})
        announce(f"dataset_mixture: {entry['id']} ({entry['split']}): format {fmt}, {n} of {len(converted)} rows")
    try:
        whole = concatenate_datasets(parts)
    except ValueError as e:  # e.g. a conversational and a text preference set: different column types
        kinds = ", ".join(f"{r['id']}: {dict(p.features)}" for r, p in zip(record, parts))
        raise ConfigError("dataset_mixture", f"the sets' rows do not have the same columns and types, so they "
                                             f"cannot be mixed ({str(e).splitlines()[0][:120]}): {kinds:.400}") from None
    raw = _hold_out(whole, mixture["test_split_size"], seed)
    if args.max_train_samples:
        raw["train"] = data.sample_rows(raw["train"], args.max_train_samples, args.sample_seed)
    if args.max_eval_samples and "validation" in raw:
        raw["validation"] = data.sample_rows(raw["validation"], args.max_eval_samples, args.sample_seed)
    summary = {"datasets": record, "train_rows": len(raw["train"]),
               "validation_rows": len(raw["validation"]) if "validation" in raw else 0}
    return raw, summary


def _hold_out(whole: Dataset, test_size: float | None, seed: int) -> DatasetDict:
    if not test_size:
        return DatasetDict({"train": whole})
    if int(len(whole) * test_size) == 0:
        raise ConfigError("dataset_mixture", f"test_split_size {test_size} of the mixture's {len(whole)} rows holds "
                                             "out no row; raise it, or unset it to train without evaluation")
    split = whole.train_test_split(test_size=test_size, seed=seed)
    return DatasetDict({"train": split["train"], "validation": split["test"]})


def load_set(entry: dict, builtin: dict, where: str) -> Dataset:
    """One set of the mixture: local files (one split), a built-in set's split, or a Hub dataset's split."""
    files = mixture_files(entry["id"], where)
    if files is not None:
        if entry["split"] != "train":
            raise ConfigError("dataset_mixture", f"{where}: local files are one split, train; remove split")
        builder, kwargs = data.file_builder({"train": files})
        try:
            return load_dataset(builder, data_files={"train": files}, split="train", **kwargs)
        except Exception as e:  # noqa: BLE001 (malformed json/csv: the set and the line, not a pyarrow trace)
            raise ConfigError("dataset_mixture", f"{where}: {data.unreadable('dataset_mixture', files, e).message}") \
                from None
    if entry["id"] in builtin:
        sets = builtin[entry["id"]]()
        if entry["split"] not in sets:
            raise ConfigError("dataset_mixture", f"{where}: no split {entry['split']!r}; it has {list(sets)}")
        return sets[entry["split"]]
    offline = hub.offline_if_unreachable(entry["id"])
    try:
        return load_dataset(entry["id"], entry["config"], split=entry["split"])
    except ConnectionError as e:  # datasets' "Couldn't reach ... on the Hub", after its retries unless offline
        why = hub.not_cached(entry["id"], offline) if offline else str(e).splitlines()[0][:200]
        raise ConfigError("dataset_mixture", f"{where}: cannot load it: {why}") from None
    except (FileNotFoundError, ValueError) as e:  # no such dataset, or no such split
        raise ConfigError("dataset_mixture", f"{where}: cannot load it: {str(e).splitlines()[0][:200]}") from None


def _select_columns(split: Dataset, columns: list[str] | None, where: str) -> Dataset:
    if columns is None:
        return split
    missing = [c for c in columns if c not in split.column_names]
    if missing:
        raise ConfigError("dataset_mixture", f"{where}: no column(s) {missing}; it has {split.column_names}")
    return split.select_columns(columns)

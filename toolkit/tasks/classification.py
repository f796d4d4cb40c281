"""Sequence classification: labelled text, the per-example loss (optionally class-weighted), accuracy and macro-F1.

Labels come from a column of class names (strings) or ids (integers), or a ``ClassLabel``; the class names are those
of the training split (sorted for strings), and a validation label the training split never shows is refused.
Local files without a validation file are split *stratified* (each class keeps its share in both splits): a tail
split of a file sorted by label would validate on one class only.

The loss of one example is its cross-entropy times its class's weight (``class_weights``; 1 without). The loop
divides the summed loss by the number of examples in the whole global batch, as it divides a language model's by
its target tokens, so accumulation and world size do not change the objective. (torch's weighted *mean* divides by
the sum of the batch's weights instead; over a global batch split into micro-batches that sum is the same, but the
objective differs from batch to batch with the class mix. We keep the plain mean over examples.)

``SequenceClassification``, at the end, is the task (``toolkit.tasks.base.Task``) that the classify recipe trains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from datasets import ClassLabel, DatasetDict, Value

from toolkit.config import DataArguments
from toolkit.data import loading as data
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX
from toolkit.tasks.base import Task

STDLIB_DOCSTRINGS = "stdlib-docstrings"  # the built-in offline set (toolkit.data.builtin.stdlib_docstrings)


def label_column(args: DataArguments) -> str:
    return args.label_column_name or "label"


def encode_labels(split, column: str, names: list[str] | None, split_name: str):
    """``split`` with ``column`` as a ClassLabel, and the class names (``names``: those of the training split)."""
    if column not in split.column_names:
        raise ConfigError("label_column_name", f"column {column!r} not in the {split_name} split; it has "
                                               f"{split.column_names}")
    feature = split.features[column]
    if isinstance(feature, ClassLabel):
        if names is not None and feature.names != names:
            raise ConfigError("label_column_name", f"the {split_name} split's classes {feature.names} are not the "
                                                   f"training split's {names}")
        return split, feature.names
    if split.data.column(column).null_count:
        raise ConfigError("label_column_name", f"some rows of the {split_name} split have no label (null) in "
                                               f"column {column!r}; remove or fill them")
    values = list(split[column])
    if isinstance(feature, Value) and feature.dtype.startswith("int"):
        if any(v < 0 for v in values):
            raise ConfigError("label_column_name", f"label ids must be >= 0; the {split_name} split has "
                                                   f"{min(values)}")
        names = names or [str(i) for i in range(max(values) + 1)]
        ids = values
    elif isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
        names = names or sorted(set(values))
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ConfigError("label_column_name", f"the {split_name} split has labels the training split never "
                                                   f"shows: {unknown[:5]}")
        ids = [names.index(v) for v in set(values)]
    else:
        raise ConfigError("label_column_name", f"column {column!r} holds {feature}; labels must be class names "
                                               "(text) or ids (integers)")
    if len(names) < 2:
        raise ConfigError("label_column_name", f"only one class ({names}) in column {column!r}; a classifier needs "
                                               "two or more")
    if max(ids, default=0) >= len(names):
        raise ConfigError("label_column_name", f"the {split_name} split has label id {max(ids)}, beyond the "
                                               f"training split's {len(names)} classes")
    features = split.features.copy()
    features[column] = ClassLabel(names=list(names))
    by_name = {name: i for i, name in enumerate(names)}
    integer_ids = feature.dtype.startswith("int")

    def encode(batch):
        return {column: batch[column] if integer_ids else [by_name[v] for v in batch[column]]}

    return split.map(encode, batched=True, features=features, desc="encode labels"), list(names)


def _small_for_stratified(train, names: list[str], column: str, percentage: float, error: ValueError) -> ConfigError:
    """The stratified holdout's refusal (datasets': a part with fewer rows than there are classes, or a class with one
    row) as one line naming the field, the set's size and the fix that applies."""
    import math

    counts = torch.bincount(torch.as_tensor(_labels(train)), minlength=len(names))
    n, k, held = len(train), len(names), math.ceil(len(train) * percentage / 100)
    rarest = int(counts.argmin())
    if counts[rarest] < 2:
        fix = (f"class {names[rarest]!r} of column {column!r} has {int(counts[rarest])} row, and each class needs one "
               "in each part; give more rows of it")
    elif held < k:
        fix = (f"{held} held-out row(s) cannot hold each of the {k} classes of column {column!r}; raise "
               f"validation_split_percentage to at least {math.ceil(100 * k / n)}")
    else:
        fix = (f"the {n - held} row(s) left to train on cannot hold each of the {k} classes of column {column!r}; "
               f"lower validation_split_percentage to at most {math.floor(100 * (n - k) / n)}")
    return ConfigError("validation_split_percentage", f"a stratified validation split of {percentage}% of the {n} "
                                                      f"training rows ({held} rows, datasets: "
                                                      f"{str(error).splitlines()[0][:100]}): {fix}, give a "
                                                      "validation_file, or validation_split_percentage: 0 to train "
                                                      "without evaluation")


def load_raw_labelled(args: DataArguments) -> tuple[DatasetDict, list[str]]:
    """The splits with the text column checked and the label column encoded; the class names."""
    from toolkit.data.builtin import stdlib_docstrings

    column = label_column(args)

    def stratified(train, fraction):
        train, names = encode_labels(train, column, None, "train")
        try:
            split = train.train_test_split(test_size=fraction, stratify_by_column=column, seed=0)
        except ValueError as e:  # too few rows (or too few of one class) for every class to be in both parts
            raise _small_for_stratified(train, names, column, args.validation_split_percentage, e) from None
        return split["train"], split["test"]

    raw = data.load_splits(args, {STDLIB_DOCSTRINGS: stdlib_docstrings}, holdout=stratified)
    data.check_validation_columns(raw, [data.text_column(args), column], args)
    data.check_text_column(raw, data.text_column(args))
    train, names = encode_labels(raw["train"], column, None, "train")
    out = {"train": train}
    if "validation" in raw:
        out["validation"], _ = encode_labels(raw["validation"], column, names, "validation")
    return DatasetDict(out), names


def resolve_class_weights(spec: list[str] | None, train, names: list[str]) -> torch.Tensor | None:
    """None, the listed weights, or 'balanced' (n_rows / (n_classes x class rows), scikit-learn's)."""
    if not spec:
        return None
    if spec == ["balanced"]:
        counts = torch.bincount(torch.as_tensor(_labels(train)),
                                minlength=len(names)).double()
        if (counts == 0).any():
            missing = [names[i] for i in torch.nonzero(counts == 0).flatten().tolist()]
            raise ConfigError("class_weights", f"'balanced' needs every class in the training split; {missing} "
                                               "have no rows")
        return (counts.sum() / (len(names) * counts)).float()
    if len(spec) != len(names):
        raise ConfigError("class_weights", f"{len(spec)} weights for {len(names)} classes ({names})")
    return torch.tensor([float(w) for w in spec])


def _labels(split) -> list[int]:
    column = next(name for name, feature in split.features.items() if isinstance(feature, ClassLabel))
    return list(split[column])


def configure_labels(config, names: list[str], pad_token_id: int | None) -> None:
    """The classifier's size and label names on the model config (saved with the export), before the weights load.
    Decoder models (GPT-2, Llama) classify from the last non-pad token, which they find through the pad id."""
    config.num_labels = len(names)
    config.id2label = dict(enumerate(names))
    config.label2id = {name: i for i, name in enumerate(names)}
    config.problem_type = "single_label_classification"
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = pad_token_id


def tokenize_labelled(raw: DatasetDict, tokenizer, args: DataArguments, block_size: int) -> DatasetDict:
    """``input_ids`` (with the tokenizer's special tokens, truncated to ``block_size``) and ``labels``."""
    text, label = data.text_column(args), label_column(args)

    def tokenize(batch):
        ids = tokenizer(batch[text], add_special_tokens=True, truncation=True, max_length=block_size,
                        verbose=False)["input_ids"]
        return {"input_ids": ids, "labels": batch[label]}

    kwargs = {"num_proc": args.preprocessing_num_workers, "load_from_cache_file": not args.overwrite_cache}
    return data.map_with_tokenizer(raw, tokenize, tokenizer, (text, label, block_size), batched=True, desc="tokenize",
                                   **kwargs)


class ClassificationCollator:
    """Right-pads ``input_ids``; ``labels`` is one class id per row. ``num_targets`` (examples) and ``num_tokens``
    are counted here, on the CPU, like the language-model collator's."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict:
        ids, mask = data.pad_right([r["input_ids"] for r in rows], self.pad_token_id)
        labels = torch.as_tensor([r["labels"] for r in rows], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "num_targets": int((labels != IGNORE_INDEX).sum()), "num_tokens": int(mask.sum())}


def row_losses(logits: torch.Tensor, labels: torch.Tensor, class_weights: torch.Tensor | None) -> torch.Tensor:
    """Per-example cross-entropy in fp32, times the example's class weight."""
    ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    if class_weights is not None:
        ce = ce * class_weights.to(ce.device)[labels.clamp(min=0)]
    return ce


def scores(predictions: torch.Tensor, labels: torch.Tensor) -> dict:
    """Accuracy and macro-F1 (the unweighted mean of per-class F1 over the classes that occur in the labels or the
    predictions, as scikit-learn's ``f1_score(average="macro")``)."""
    keep = labels != IGNORE_INDEX
    predictions, labels = predictions[keep], labels[keep]
    if len(labels) == 0:
        return {"accuracy": float("nan"), "macro_f1": float("nan")}
    f1 = []
    for c in torch.unique(torch.cat([labels, predictions])).tolist():
        tp = int(((predictions == c) & (labels == c)).sum())
        fp = int(((predictions == c) & (labels != c)).sum())
        fn = int(((predictions != c) & (labels == c)).sum())
        f1.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": float((predictions == labels).double().mean()), "macro_f1": sum(f1) / len(f1)}


class SequenceClassification(Task):
    """One label per text (``AutoModelForSequenceClassification``): cross-entropy per example, optionally weighted
    by class; accuracy and macro-F1 on the validation split (the functions above)."""

    name = "sequence-classification"
    stream_refusal = "its labels, stratified split and class weights come from the whole training set"
    auto_class = "AutoModelForSequenceClassification"
    peft_task_type = "SEQ_CLS"
    best_metric = ("accuracy", max)
    row_unit = "examples"
    loss_unit = "nats/example"  # cross-entropy averaged over the examples (class weights, when set, weigh them)

    def __init__(self):
        self.labels: list[str] | None = None  # class names, set by load_raw
        self.class_weights: torch.Tensor | None = None

    def check(self, cfg) -> None:
        if cfg.data.packing or cfg.data.packing_strategy:
            # one label per row: a packed row would need a label per document, which the model class cannot give
            raise ConfigError("packing", "a classifier takes one example per row (its label is the row's); packing "
                                         "and packing_strategy do not apply: set packing: false and unset "
                                         "packing_strategy")
        cfg.data.packing = False  # unset (None): this task's default
        if cfg.data.dataset_mixture is not None:
            raise ConfigError("dataset_mixture", "the classifier trains on one labelled dataset (its classes and "
                                                 "split are drawn from it); set dataset_name or train_file")
        if cfg.train.optim == "muon":
            # Muon's split (toolkit.training.optimizers.muon_split) keeps the output head on AdamW and finds it by
            # get_output_embeddings, which a classifier does not have: refused here, before launching, not in the
            # ranks after the weights load
            raise ConfigError("optim", "muon needs a causal LM's output head; the classifier has none (its score "
                                       "layer would get Muon): use optim adamw_torch")
        if cfg.train.loss_chunk_size:
            raise ConfigError("loss_chunk_size", "the chunked loss is for language models' vocabulary logits; set "
                                                 "loss_chunk_size: 0")

    def load_raw(self, args):
        raw, self.labels = load_raw_labelled(args)
        self.class_weights = resolve_class_weights(args.class_weights, raw["train"], self.labels)
        return raw

    def configure_model(self, config, tokenizer) -> None:
        configure_labels(config, self.labels, tokenizer.pad_token_id)

    def tokenize(self, raw, tokenizer, args, block_size: int):
        return tokenize_labelled(raw, tokenizer, args, block_size)

    def collator(self, tokenizer):
        return ClassificationCollator(tokenizer.pad_token_id)

    def count_targets(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def row_losses(self, model, batch: dict, chunked: bool = False) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return row_losses(logits, batch["labels"], self.class_weights)  # the module's function, not this method

    def eval_rows(self, model, batch: dict, chunked: bool = False) -> tuple[torch.Tensor, ...]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return row_losses(logits, batch["labels"], None), logits.argmax(-1), batch["labels"]

    def eval_metrics(self, rows: list[tuple[torch.Tensor, ...]]) -> dict:
        loss = torch.cat([r[0].double() for r in rows])
        predictions, labels = torch.cat([r[1] for r in rows]), torch.cat([r[2] for r in rows])
        return {"eval_loss": float(loss.mean()) if len(loss) else float("nan"),
                **scores(predictions, labels), "eval_samples": len(labels)}

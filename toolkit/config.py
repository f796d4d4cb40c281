"""Run configuration: dataclasses parsed by transformers' ``HfArgumentParser`` from a YAML file plus CLI overrides.

The convention is TRL's / alignment-handbook's: ``--config recipe.yaml`` sets the values, and any field can be
overridden on the command line (``--learning_rate 1e-4``); the command line wins. Field names are those of
``transformers.TrainingArguments`` and ``run_clm.py`` wherever they exist, so users can carry their configs over.

Everything here runs before a model, a dataset or a process group is touched: a typo, a wrong type or an impossible
value stops with one message naming the field (``ConfigError``), not a stack trace ten minutes into a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A bad configuration, reported as ``config error: <field>: <what to do>``."""

    def __init__(self, field_name: str | None, message: str):
        self.field_name = field_name
        super().__init__(f"{field_name}: {message}" if field_name else message)


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Pretrained model: a Hub id or a local folder. Leave unset to train from scratch."}
    )
    config_name: Optional[str] = field(
        default=None, metadata={"help": "Config to build the model from scratch (Hub id or local folder)."}
    )
    config_overrides: Optional[str] = field(
        default=None, metadata={"help": "Comma-separated config overrides, e.g. 'n_layer=2,n_embd=64,resid_pdrop=0'."}
    )
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer (Hub id or folder); defaults to model_name_or_path/config_name."}
    )
    gguf_file: Optional[str] = field(default=None, metadata={"help": "GGUF file name inside model_name_or_path."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the Hub. Off: safety."})


@dataclass
class DataArguments:
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset, or 'pydoc' (CPython's reference docs, no download)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local txt/json/jsonl/csv/parquet file."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local validation file (same formats)."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train held out when the dataset has no validation split."}
    )
    text_column_name: Optional[str] = field(default=None, metadata={"help": "Text column (default: 'text')."})
    block_size: Optional[int] = field(
        default=None, metadata={"help": "Tokens per row; default min(1024, the model's positions)."}
    )
    packing: bool = field(
        default=True, metadata={"help": "true: concatenate and cut into block_size rows; false: one example per row."}
    )
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N training rows."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N validation rows."})
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={"help": "Processes for datasets.map."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute cached tokenization."})


OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)
LOSS_NORMALIZATIONS = ("global_tokens", "per_micro_batch")


@dataclass
class TrainingArguments:
    output_dir: str = field(default="outputs/run", metadata={"help": "Where metrics, checkpoints and final/ go."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Allow reusing a finished output_dir."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Rows per rank per micro-step."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Rows per rank per eval batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not on biases/norms)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    optim: str = field(default="adamw_torch", metadata={"help": f"One of {', '.join(OPTIMIZERS)}."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": f"One of {', '.join(SCHEDULERS)}."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warmup, in optimizer steps."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Epochs (ignored when max_steps > 0)."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; > 0 overrides num_train_epochs."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global grad norm; 0 turns clipping off."})
    seed: int = field(default=42, metadata={"help": "Seed for init, sample order and dropout."})
    shuffle: bool = field(
        default=True, metadata={"help": "Shuffle the sample order each epoch (same order on any world size)."}
    )
    loss_normalization: str = field(
        default="global_tokens",
        metadata={
            "help": "global_tokens: divide by target tokens in the whole accumulated global batch (correct). "
            "per_micro_batch: mean per micro-batch, the pre-2024 transformers bug; for comparison only."
        },
    )
    logging_steps: int = field(default=10, metadata={"help": "Log every N optimizer steps."})
    eval_steps: Optional[int] = field(default=None, metadata={"help": "Evaluate every N steps (and at the end)."})
    eval_on_start: bool = field(default=False, metadata={"help": "Evaluate before the first step."})
    save_steps: Optional[int] = field(default=None, metadata={"help": "Checkpoint every N optimizer steps."})
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "Keep only the N newest checkpoints."})
    resume_from_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "A checkpoint folder, or 'latest' (newest in output_dir/checkpoints)."}
    )
    report_to: str = field(default="tensorboard", metadata={"help": "Trackers: 'tensorboard', 'none', 'all', ..."})
    dataloader_num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes."})
    save_final_model: bool = field(default=True, metadata={"help": "Write output_dir/final with save_pretrained."})


ARGUMENT_CLASSES = (ModelArguments, DataArguments, TrainingArguments)


@dataclass
class RunConfig:
    """The three argument groups of one run; ``as_dict`` is what lands in ``output_dir/config.yaml``."""

    model: ModelArguments
    data: DataArguments
    train: TrainingArguments

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in (self.model, self.data, self.train):
            out.update(dataclasses.asdict(part))
        return out


def field_names(classes=ARGUMENT_CLASSES) -> list[str]:
    return [f.name for cls in classes for f in dataclasses.fields(cls)]


def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _parser(classes):
    from transformers import HfArgumentParser

    class _Parser(HfArgumentParser):
        # argparse's default error() prints the whole usage (50 fields) and exits; we want one line naming the field.
        def error(self, message):
            raise ConfigError(None, message)

    return _Parser(classes, allow_abbrev=False)


def _yaml_to_argv(values: dict, source: str, known: list[str]) -> tuple[list[str], dict]:
    """Turn YAML values into CLI tokens so that argparse type-checks them exactly like command-line values."""
    argv, nulls = [], {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(key, f"unknown field in {source}.{_suggest(key, known)}")
        if value is None:
            nulls[key] = None
        elif isinstance(value, bool):
            argv += [f"--{key}", "true" if value else "false"]
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", *[str(v) for v in value]]
        elif isinstance(value, dict):
            raise ConfigError(key, f"expected a single value in {source}, got a mapping")
        else:
            argv += [f"--{key}", str(value)]
    return argv, nulls


def parse_args(argv: list[str] | None = None, classes=ARGUMENT_CLASSES, validate_fn=None) -> RunConfig:
    """Parse ``--config file.yaml`` plus overrides. Raises ConfigError; ``cli`` turns it into one line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    ns, rest = pre.parse_known_args(argv)
    known = field_names(classes)

    yaml_argv, nulls = [], {}
    if ns.config is not None:
        if not os.path.isfile(ns.config):
            raise ConfigError("config", f"file not found: {ns.config}")
        try:
            with open(ns.config) as f:
                values = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError("config", f"{ns.config} is not valid YAML: {e}") from None
        if not isinstance(values, dict):
            raise ConfigError("config", f"{ns.config} must be a mapping of field: value")
        yaml_argv, nulls = _yaml_to_argv(values, ns.config, known)

    if "-h" in rest or "--help" in rest:
        _parser(classes).print_help()
        sys.exit(0)

    return _parse(yaml_argv + rest, nulls, classes, validate_fn)


def config_from_dict(values: dict, validate_fn=None) -> RunConfig:
    """A RunConfig from a plain dict (notebooks, scripts), type-checked and validated exactly like a YAML file."""
    argv, nulls = _yaml_to_argv(values, "the given values", field_names())
    return _parse(argv, nulls, ARGUMENT_CLASSES, validate_fn)


def _parse(argv: list[str], nulls: dict, classes, validate_fn):
    """argv tokens (YAML values first, command line after: the last value wins) -> validated dataclasses."""
    known = field_names(classes)
    parser = _parser(classes)
    if nulls:
        parser.set_defaults(**nulls)
    try:
        *groups, remaining = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except ConfigError as e:
        raise _name_field(e, known) from None
    if remaining:
        first = next((r for r in remaining if r.startswith("--")), remaining[0])
        name = first.lstrip("-").split("=")[0]
        raise ConfigError(name, f"unknown argument '{first}'.{_suggest(name, known)}")
    if classes is ARGUMENT_CLASSES:
        cfg = RunConfig(*groups)
        (validate_fn or validate)(cfg)
        return cfg
    return groups


def _name_field(err: ConfigError, known: list[str]) -> ConfigError:
    # argparse says "argument --learning_rate: invalid float value: 'abc'"; lift the field name to the front.
    msg = str(err)
    if msg.startswith("argument --"):
        name, _, rest = msg[len("argument --") :].partition(":")
        name = name.split("/")[0].strip()
        return ConfigError(name, rest.strip())
    return err


# ----------------------------------------------------------------------------------------------------------- checks
def _positive(cfg_part, name, allow_none=False):
    value = getattr(cfg_part, name)
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


def _model_positions(margs: ModelArguments) -> int | None:
    """The model's maximum positions, read from its config (no weights), or None when it cannot be read cheaply."""
    name = margs.config_name or margs.model_name_or_path
    if name is None:
        return None
    if not os.path.isdir(name):
        return None  # a Hub id: transformers will fetch/verify it; we do not fetch here
    try:
        from transformers import AutoConfig

        kw = {"gguf_file": margs.gguf_file} if margs.gguf_file else {}
        config = AutoConfig.from_pretrained(name, trust_remote_code=margs.trust_remote_code, **kw)
        if margs.config_overrides:
            config.update_from_string(margs.config_overrides)
    except Exception as e:  # a malformed override or folder: name it now rather than mid-launch
        field_name = "config_overrides" if margs.config_overrides else ("config_name" if margs.config_name else "model_name_or_path")
        raise ConfigError(field_name, f"cannot read the model config from {name}: {e}") from None
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(getattr(config, attr, None), int):
            return getattr(config, attr)
    return None


DATA_EXTENSIONS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def validate(cfg: RunConfig) -> None:
    """Every check that needs no model weights and no process group."""
    m, d, t = cfg.model, cfg.data, cfg.train
    if m.model_name_or_path is None and m.config_name is None:
        raise ConfigError("model_name_or_path", "set model_name_or_path (pretrained) or config_name (from scratch)")
    for name in ("model_name_or_path", "config_name", "tokenizer_name"):
        value = getattr(m, name)
        # Only what is unmistakably a path is checked here; "org/name" may be a Hub id.
        if value and value.startswith(("/", "./", "../", "~")):
            if not os.path.isdir(os.path.expanduser(value)):
                raise ConfigError(name, f"folder not found: {value}")
    if m.config_overrides:
        for item in m.config_overrides.split(","):
            if "=" not in item:
                raise ConfigError("config_overrides", f"expected key=value pairs separated by commas, got {item!r}")

    if d.dataset_name is None and d.train_file is None:
        raise ConfigError("dataset_name", "set dataset_name (Hub or 'pydoc') or train_file (a local file)")
    if d.dataset_name is not None and d.train_file is not None:
        raise ConfigError("train_file", "set either dataset_name or train_file, not both")
    for name in ("train_file", "validation_file"):
        path = getattr(d, name)
        if path is None:
            continue
        if not os.path.isfile(path):
            raise ConfigError(name, f"file not found: {path}")
        ext = os.path.splitext(path)[1].lower()
        if ext not in DATA_EXTENSIONS:
            raise ConfigError(name, f"unsupported extension {ext!r}; use one of {', '.join(DATA_EXTENSIONS)}")
        if os.path.getsize(path) == 0:
            raise ConfigError(name, f"file is empty: {path}")
    if not 0 <= d.validation_split_percentage < 100:
        raise ConfigError("validation_split_percentage", f"must be in [0, 100), got {d.validation_split_percentage}")
    for name in ("block_size", "max_train_samples", "max_eval_samples", "preprocessing_num_workers"):
        _positive(d, name, allow_none=True)

    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        _positive(t, name)
    for name in ("logging_steps",):
        _positive(t, name)
    for name in ("eval_steps", "save_steps", "save_total_limit"):
        _positive(t, name, allow_none=True)
    if t.learning_rate < 0:
        raise ConfigError("learning_rate", f"must be >= 0, got {t.learning_rate}")
    if t.max_grad_norm < 0:
        raise ConfigError("max_grad_norm", f"must be >= 0 (0 turns clipping off), got {t.max_grad_norm}")
    if t.weight_decay < 0:
        raise ConfigError("weight_decay", f"must be >= 0, got {t.weight_decay}")
    if t.warmup_steps < 0:
        raise ConfigError("warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError("max_steps", f"must be a positive number of steps, or -1 to use num_train_epochs; got {t.max_steps}")
    if t.max_steps == -1 and t.num_train_epochs <= 0:
        raise ConfigError("num_train_epochs", f"must be > 0 when max_steps is -1, got {t.num_train_epochs}")
    if t.dataloader_num_workers < 0:
        raise ConfigError("dataloader_num_workers", f"must be >= 0, got {t.dataloader_num_workers}")
    for name, choices in (("optim", OPTIMIZERS), ("lr_scheduler_type", SCHEDULERS), ("loss_normalization", LOSS_NORMALIZATIONS)):
        value = getattr(t, name)
        if value not in choices:
            raise ConfigError(name, f"unknown value {value!r}; choose one of {', '.join(choices)}.{_suggest(value, choices)}")
    if t.resume_from_checkpoint not in (None, "latest") and not os.path.isdir(t.resume_from_checkpoint):
        raise ConfigError("resume_from_checkpoint", f"folder not found: {t.resume_from_checkpoint} (or use 'latest')")
    if t.resume_from_checkpoint == "latest":
        from toolkit.checkpoint import latest_checkpoint

        if latest_checkpoint(t.output_dir) is None:
            raise ConfigError("resume_from_checkpoint", f"'latest' but {t.output_dir}/checkpoints holds no checkpoint")
    if (
        t.resume_from_checkpoint is None
        and not t.overwrite_output_dir
        and os.path.isfile(os.path.join(t.output_dir, "final", "config.json"))
    ):
        raise ConfigError(
            "output_dir",
            f"{t.output_dir} already holds a finished run (final/); pick a new output_dir, "
            "set overwrite_output_dir: true, or resume_from_checkpoint",
        )

    if t.resume_from_checkpoint is None and not t.overwrite_output_dir:
        from toolkit.checkpoint import list_checkpoints

        if list_checkpoints(t.output_dir):
            raise ConfigError(
                "output_dir",
                f"{t.output_dir}/checkpoints already holds checkpoints of an earlier run; continue it with "
                "resume_from_checkpoint: latest, or set overwrite_output_dir: true to start over",
            )

    positions = _model_positions(m)
    if positions is not None and d.block_size is not None and d.block_size > positions:
        raise ConfigError("block_size", f"{d.block_size} exceeds the model's {positions} positions; use <= {positions}")


def write_config(cfg: RunConfig, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(cfg.as_dict(), f, sort_keys=False)


def cli(main_fn):
    """Run ``main_fn`` and turn a ConfigError into one line on stderr and exit code 2 (argparse's code for usage)."""
    try:
        return main_fn()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)

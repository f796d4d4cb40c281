"""Run configuration: dataclasses parsed by transformers' ``HfArgumentParser`` from a YAML file plus CLI overrides.

The convention is TRL's / alignment-handbook's: ``--config recipe.yaml`` sets the values, and any field can be
overridden on the command line (``--learning_rate 1e-4``); the command line wins. Field names are those of
``transformers.TrainingArguments`` and ``run_clm.py`` wherever they exist, so users can carry their configs over.

Everything here runs before a model, a dataset or a process group is touched: a typo, a wrong type or an impossible
value stops with one message naming the field (``ConfigError``), not a stack trace ten minutes into a run. Each
dataclass checks its own fields in ``__post_init__`` (so a value is checked wherever the dataclass is built); what
needs two groups or the file system (is there a model and data, does ``output_dir`` hold a finished run, does
``block_size`` fit the model) is ``RunConfig``'s.

This module imports no toolkit module but ``errors``, ``layout``, ``elastic`` and ``config_help`` (standard library
and yaml only), and neither torch nor accelerate: parsing a config stays cheap. What a torch elastic restart does to a
config is ``toolkit.elastic``'s; a recipe's ``--help`` and which recipe takes a field are ``toolkit.config_help``'s;
the process exit of a recipe is ``toolkit.cli``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import importlib.util
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from toolkit import config_help, elastic, layout
from toolkit.errors import ConfigError

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adamw_bnb_8bit", "paged_adamw_8bit")
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
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # torch.distributed.pipelining's schedules
LOSS_TYPES = ("sigmoid", "ipo")  # DPO losses (TRL's loss_type names)
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")  # GRPO's (toolkit.grpo_loss)
SCALE_REWARDS = ("group", "batch", "none")
TORCH_DTYPES = ("float32", "auto", "bfloat16", "float16")
BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
DATA_EXTENSIONS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# packing_strategy (TRL's names): concatenate-and-cut, or best-fit decreasing documents, cut or split (toolkit.packing)
PACKING_STRATEGIES = ("wrapped", "bfd", "bfd_split")
# the dataset formats (TRL's, toolkit.formats converts them), and the fields that take a YAML mapping
DATASET_FORMATS = ("text", "messages", "prompt_completion", "alpaca", "sharegpt", "preference", "implicit_preference")
MAPPING_FIELDS = ("sharegpt_roles", "dataset_mixture")
ROLE_NAMES = ("system", "user", "assistant")
# accelerate's trackers (LoggerType) and the modules each needs, any one of them (accelerate's is_*_available).
TRACKERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "trackio": ("trackio",),
            "aim": ("aim",), "comet_ml": ("comet_ml",), "mlflow": ("mlflow",), "clearml": ("clearml",),
            "dvclive": ("dvclive",), "swanlab": ("swanlab",)}
# The tasks (Task.name) of a field that only some recipes use (metadata "tasks"; toolkit.config_help): --help lists
# it for those recipes only, and the others refuse it.
DPO_ONLY = ("dpo",)
GRPO_ONLY = ("grpo",)
PREFERENCE_TASKS = ("dpo", "grpo")  # beta and loss_type: one field each, the task's own values and default
CLASSIFICATION_ONLY = ("sequence-classification",)
CHAT_TASKS = ("chat-sft", "dpo", "grpo")  # chat_template: chats, DPO's and GRPO's prompts as messages
TEXT_TASKS = ("causal-lm", "chat-sft", "sequence-classification")  # DPO's columns are prompt/chosen/rejected
# packing and streaming: the tasks that take them; the others refuse them in Task.check, saying why ("task_checks")
PACKING_TASKS = ("causal-lm", "chat-sft")
# Where model configs keep their context length (GPT-2: n_positions; Llama, Qwen, Mistral: max_position_embeddings).
POSITION_ATTRIBUTES = ("n_positions", "max_position_embeddings", "n_ctx")


# ----------------------------------------------------------------------------------------------- small checks
def _closest(name: str, choices) -> str | None:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    if not close:
        return None
    # A name that drops the train/eval part (per_device_batch_size) is nearer the eval twin by difflib's ratio only
    # because "eval_" is one letter shorter than "train_"; the train-side field is what such a name means far more
    # often, so when both twins are close matches, the train one is preferred.
    twin = close[0].replace("eval", "train")
    if "eval" in close[0] and "eval" not in name and twin in close:
        return twin
    return close[0]


def _suggest(name: str, choices) -> str:
    close = _closest(name, choices)
    return f" Did you mean '{close}'?" if close else ""


def _positive(obj, *names, allow_none=False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None and allow_none:
            continue
        if value is None or value <= 0:
            raise ConfigError(name, f"must be a positive integer, got {value!r}")


def _at_least_zero(obj, *names, why: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ConfigError(name, f"must be >= 0{why}, got {value}")


def _finite(obj, *names) -> None:
    # NaN passes every comparison check (nan < 0 is False) and a NaN max_grad_norm silently makes the weights NaN.
    for name in names:
        value = getattr(obj, name)
        if not math.isfinite(value):
            raise ConfigError(name, f"must be a finite number, got {value}")


def _fraction(obj, *names, why: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0 <= value < 1:  # also refuses NaN
            raise ConfigError(name, f"must be in [0, 1){why}, got {value}")


def _one_of(obj, name: str, choices) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(name, f"unknown value {value!r}; choose one of {', '.join(choices)}."
                                f"{_suggest(value, choices)}")


def _check_report_to(value: str) -> None:
    """A tracker the user named must be installed: accelerate drops a missing one with a warning and the run trains
    without it (docs/pitfalls.md#missing-tracker); an unknown name raised accelerate's ValueError
    after the process group was up. 'none' (or empty) logs nowhere; 'all' is whatever is installed."""
    if value in ("none", "", "all"):
        return
    choices = ("none", "all", *TRACKERS)
    if value not in TRACKERS:
        raise ConfigError("report_to", f"unknown tracker {value!r}; choose one of {', '.join(choices)}."
                                       f"{_suggest(value, choices)}")
    if not any(importlib.util.find_spec(module) for module in TRACKERS[value]):
        raise ConfigError("report_to", f"{value!r} is not installed (pip install {TRACKERS[value][0]}); install it, "
                                       "or set report_to: none (or tensorboard, or all: the installed trackers)")


def max_positions(model_config) -> int | None:
    """The model's context length from its config object, or None if it names none (the one place this is read)."""
    for attr in POSITION_ATTRIBUTES:
        value = getattr(model_config, attr, None)
        if isinstance(value, int):
            return value
    return None


# --------------------------------------------------------------------------------------------------- dataclasses
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
    torch_dtype: str = field(
        default="float32",
        metadata={"help": "dtype the weights load and train in: float32 (fp32 master weights, the default), auto (the "
                          "dtype the checkpoint was stored in: bf16 for most Hub models), bfloat16 or float16 (pure "
                          "low-precision training, on purpose). Mixed precision is accelerate's --mixed_precision."},
    )
    attn_implementation: Optional[str] = field(
        default=None, metadata={"help": "The attention kernel (transformers' and TRL's name): sdpa, eager, "
                                        "flash_attention_2 (on GPUs: pip install flash-attn; bf16 or fp16 weights or "
                                        "autocast), flash_attention_3, flex_attention, or a Hub kernel "
                                        "('kernels-community/...'). Default: transformers' choice (sdpa where the "
                                        "model has it)."}
    )
    # LoRA, with TRL's field names (ModelConfig): the same fields in every recipe.
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of every weight."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: Optional[list[str]] = field(
        default=None, metadata={"help": "Module names to adapt, or all-linear (every linear layer but the output "
                                        "head); default: peft's choice for the model type (e.g. GPT-2's c_attn, "
                                        "Llama's q_proj v_proj, BERT's query value).", "nargs": "+"}
    )
    lora_modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules trained fully and saved with the adapter (a classifier's head is "
                                        "added by peft itself).", "nargs": "+"}
    )
    merge_lora: bool = field(
        default=False, metadata={"help": "Also export the merged full weights (base + adapter) to final/merged/."}
    )
    # bitsandbytes quantization of the frozen base (QLoRA), TRL's names (ModelConfig); toolkit.quantization
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base in 4 bits (QLoRA; needs use_peft: true "
                                                                "and pip install '.[qlora]'). Compute in torch_dtype."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base in 8 bits (LLM.int8; needs use_peft: "
                                                                "true and pip install '.[qlora]')."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "With load_in_4bit: nf4 (NormalFloat, QLoRA's) "
                                                                      "or fp4."})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "With load_in_4bit: quantize the quantization "
                                                                        "constants too (double quantization: about "
                                                                        "0.37 bits less a weight)."})
    ref_model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "DPO: the reference model (Hub id or local folder, the policy's tokenizer); "
                                        "default: the policy's starting weights (with use_peft: the base, adapter "
                                        "disabled).", "tasks": DPO_ONLY}
    )

    def __post_init__(self):
        _one_of(self, "torch_dtype", TORCH_DTYPES)
        self._check_attn_implementation()
        _positive(self, "lora_r", "lora_alpha")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        if self.use_peft and not self.model_name_or_path:
            raise ConfigError("use_peft", "LoRA adapts pretrained weights: set model_name_or_path (the adapter is "
                                          "exported without the base, which must be loadable again)")
        self._check_quantization()
        if self.merge_lora and not self.use_peft:
            raise ConfigError("merge_lora", "merges LoRA adapters into the weights; set use_peft: true, or drop it")
        for name in ("model_name_or_path", "config_name", "tokenizer_name", "ref_model_name_or_path"):
            value = getattr(self, name)
            # Only what is unmistakably a path is checked here; "org/name" may be a Hub id.
            if value and value.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(value)):
                raise ConfigError(name, f"folder not found: {value}")
        for item in self.config_overrides.split(",") if self.config_overrides else []:
            if "=" not in item:
                raise ConfigError("config_overrides", f"expected key=value pairs separated by commas, got {item!r}")

    def _check_quantization(self) -> None:
        """A quantized base is frozen (only adapters train on it) and needs bitsandbytes: refused here, at once."""
        _one_of(self, "bnb_4bit_quant_type", BNB_4BIT_QUANT_TYPES)
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("load_in_8bit", "choose one of load_in_4bit and load_in_8bit")
        name = "load_in_4bit" if self.load_in_4bit else "load_in_8bit" if self.load_in_8bit else None
        if name and not self.use_peft:
            raise ConfigError(name, "a quantized base cannot be trained, only adapters on it: set use_peft: true")
        if name and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(name, "needs bitsandbytes: pip install '.[qlora]' (or set it false)")

    def _check_attn_implementation(self) -> None:
        """A name transformers knows (or a Hub kernel, owner/name), at parse time; whether this machine can run it
        (flash-attn, a GPU, the kernels package) is ``toolkit.model.check_attn_implementation``'s, with the model's
        config, still before the weights load."""
        value = self.attn_implementation
        if value is not None and "/" not in value:
            _one_of(self, "attn_implementation", ATTN_IMPLEMENTATIONS)

    @property
    def config_source(self) -> str | None:
        """Where the model's config comes from: config_name (from scratch) or the pretrained model."""
        return self.config_name or self.model_name_or_path

    def model_kwargs(self) -> dict:
        """The keyword arguments of building the model itself (``from_pretrained`` of the weights, ``from_config``),
        beyond ``pretrained_kwargs``: the attention kernel, when one is asked for."""
        return {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}

    def pretrained_kwargs(self) -> dict:
        """The keyword arguments of every ``from_pretrained`` of the model's own files (config, weights)."""
        kw = {"trust_remote_code": self.trust_remote_code}
        if self.gguf_file:
            kw["gguf_file"] = self.gguf_file
        return kw

    def auto_config(self):
        """transformers' config of the model (``config_source``, no weights), ``config_overrides`` applied: the one
        place it is loaded, for ``read_model_config`` here and for the run (``toolkit.model.load_config``).
        transformers is imported here, when called: importing this module stays cheap."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.config_source, **self.pretrained_kwargs())
        if self.config_overrides:
            config.update_from_string(self.config_overrides)
        return config

    def read_model_config(self):
        """The model's config (no weights) when it is a local folder, else None: Hub ids are not fetched here."""
        name = self.config_source
        if name is None or not os.path.isdir(name):
            return None
        try:
            config = self.auto_config()
        except Exception as e:  # a malformed override or folder: name it now rather than mid-launch
            which = "config_overrides" if self.config_overrides else (
                "config_name" if self.config_name else "model_name_or_path")
            raise ConfigError(which, f"cannot read the model config from {name}: {e}") from None
        return config


@dataclass
class DataArguments:
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset, or 'pydoc' (CPython's reference docs, no download)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration."})
    train_file: Optional[str] = field(default=None, metadata={
        "help": "Local txt/json/jsonl/csv/parquet file(s): a path, a glob ('data/part-*.jsonl', quoted), or several "
                "separated by commas (in YAML also a list)."})
    validation_file: Optional[str] = field(default=None, metadata={
        "help": "Local validation file(s), as train_file (same format)."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train held out when the dataset has no validation split."}
    )
    text_column_name: Optional[str] = field(
        default=None, metadata={"help": "Text column (default: 'text'; chat SFT: 'messages', a list of {role, "
                                        "content}).", "tasks": TEXT_TASKS}
    )
    label_column_name: Optional[str] = field(
        default=None, metadata={"help": "Classification: the label column, class names or ids (default: 'label').",
                                "tasks": CLASSIFICATION_ONLY}
    )
    class_weights: Optional[list[str]] = field(
        default=None, metadata={"help": "Classification: one loss weight per class (in the order of the class "
                                        "names), or 'balanced' (n_rows / (n_classes x class rows), from train).",
                                "nargs": "+", "tasks": CLASSIFICATION_ONLY}
    )
    chat_template: Optional[str] = field(
        default=None, metadata={"help": "Chat SFT: a Jinja chat template, or a file holding one; overrides the "
                                        "tokenizer's.", "tasks": CHAT_TASKS}
    )
    block_size: Optional[int] = field(
        default=None, metadata={"help": "Tokens per row; default min(1024, the model's positions)."}
    )
    packing: Optional[bool] = field(
        default=None, metadata={"help": "true: several documents per block_size row (how: packing_strategy); false: "
                                        "one example per row. Unset: the task's default (causal LM: true; chat SFT: "
                                        "false, true packs whole chats with bfd; classification: false, refuses "
                                        "true).", "tasks": PACKING_TASKS, "task_checks": True}
    )
    packing_strategy: Optional[str] = field(
        default=None, metadata={"help": "With packing (TRL's name): 'wrapped', concatenate every document and cut "
                                        "into block_size rows (a document attends to the one before it); 'bfd', "
                                        "best-fit decreasing: whole documents or chats per row, each attending only "
                                        "to itself, no padding (a document longer than block_size is cut; the run "
                                        "logs how much); 'bfd_split', the same, a longer document split into "
                                        "block_size pieces instead (no token dropped). "
                                        "Unset: causal LM wrapped, chat SFT bfd (which refuses wrapped).",
                                "tasks": PACKING_TASKS, "task_checks": True}
    )
    # Documents, not blocks (run_clm selects blocks after grouping): the point is to bound tokenization on big data.
    # A seeded sample, not the first N: the first N rows of data sorted by class hold a few classes only.
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep N training documents (before tokenization and packing), drawn at "
                                        "random with the run's seed, in their original order (the same rows on any "
                                        "world size)."}
    )
    max_eval_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep N validation documents (before tokenization and packing), drawn as "
                                        "max_train_samples' rows are."}
    )
    streaming: bool = field(
        default=False, metadata={"help": "run_clm's name: read train_file as a stream (nothing tokenized ahead, "
                                         "bounded memory), in the same order on any world size (shuffled in windows "
                                         "of shuffle_buffer_size rows); needs max_steps. Causal LM and chat SFT.",
                                 "tasks": PACKING_TASKS, "task_checks": True}
    )
    shuffle_buffer_size: int = field(
        default=10_000, metadata={"help": "With streaming: rows per shuffled window of the stream (held in memory "
                                          "on every rank); a larger window mixes the corpus more.",
                                  "tasks": PACKING_TASKS}
    )
    drop_long_prompts: bool = field(
        default=True, metadata={"help": "DPO: drop a pair whose prompt leaves its completions no token within "
                                        "block_size (TRL drops them too), counted in the log and summary.json; "
                                        "false: such a pair stops the run before any work, naming its row.",
                                "tasks": DPO_ONLY}
    )
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={"help": "Processes for datasets.map."})
    dataset_format: Optional[str] = field(
        default=None, metadata={"help": f"The data's format, one of {', '.join(DATASET_FORMATS)}; unset: detected "
                                        "from the columns (docs/recipes.md#dataset-formats)."}
    )
    sharegpt_roles: Optional[str] = field(
        default=None, metadata={"help": "ShareGPT data: a mapping of its 'from' names to roles (system, user, "
                                        "assistant), beside the defaults human: user, gpt: assistant, e.g. {bot: "
                                        "assistant}; a YAML mapping (on the command line, its YAML/JSON text).",
                                "tasks": ("chat-sft",)}
    )
    dataset_mixture: Optional[str] = field(
        default=None, metadata={"help": "Several datasets, mixed (alignment-handbook's shape): {datasets: [{id, "
                                         "config, split, columns, weight}], seed, test_split_size}; each set is "
                                         "converted to the recipe's format, a weight fraction of its rows drawn with "
                                         "the seed; a YAML mapping (on the command line, its YAML/JSON text). "
                                         "Instead of dataset_name/train_file."}
    )
    # Not a field: the run's seed (TrainingArguments.seed, set by RunConfig) that draws max_*_samples' rows.
    sample_seed = 42
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute cached tokenization."})

    def data_files(self, name: str = "train_file") -> list[str]:
        """The files ``train_file`` or ``validation_file`` names: comma-separated paths or globs (a YAML list is
        joined with commas), each glob expanded in sorted order; refuses a glob that matches nothing, a missing or
        empty file and an unknown extension (one format per field)."""
        files = []
        for piece in (p.strip() for p in getattr(self, name).split(",")):
            if not piece:
                continue
            if glob.has_magic(piece):
                matched = sorted(p for p in glob.glob(piece, recursive=True) if os.path.isfile(p))
                if not matched:
                    raise ConfigError(name, f"the pattern {piece!r} matches no file; check the path (quote the "
                                            "pattern on the command line so that the shell does not expand it)")
                files += matched
            else:
                files.append(piece)
        if not files:
            raise ConfigError(name, "names no file")
        for path in files:
            if not os.path.isfile(path):
                raise ConfigError(name, f"file not found: {path}")
            ext = os.path.splitext(path)[1].lower()
            if ext not in DATA_EXTENSIONS:
                raise ConfigError(name, f"unsupported extension {ext!r} ({path}); use one of "
                                        f"{', '.join(DATA_EXTENSIONS)}")
            if os.path.getsize(path) == 0:
                raise ConfigError(name, f"file is empty: {path}")
        formats = {DATA_EXTENSIONS[os.path.splitext(p)[1].lower()] for p in files}
        if len(formats) > 1:
            raise ConfigError(name, f"mixes formats ({', '.join(sorted(formats))}); give files of one format")
        return files

    def _check_stream(self) -> None:
        """What a stream (``toolkit.stream``) cannot honour, refused before work."""
        if self.train_file is None:
            raise ConfigError("streaming", "streams local files: set train_file (paths, a glob or a list), not "
                                           "dataset_name")
        if self.max_train_samples is not None:
            raise ConfigError("max_train_samples", "draws rows from the whole training set, which a stream does "
                                                   "not have; bound a stream with max_steps")

    def _check_formats(self) -> None:
        """dataset_format is a known name, sharegpt_roles maps names to roles, dataset_mixture has the handbook's
        shape (files that exist, weights in (0, 1]) and no other data field beside it. The mappings are parsed here
        from their text (what the command line and YAML give) to dicts."""
        if self.dataset_format is not None and self.dataset_format not in DATASET_FORMATS:
            raise ConfigError("dataset_format", f"{self.dataset_format!r} is not one of {', '.join(DATASET_FORMATS)}")
        self.sharegpt_roles = _mapping("sharegpt_roles", self.sharegpt_roles)
        for name, role in (self.sharegpt_roles or {}).items():
            if role not in ROLE_NAMES:
                raise ConfigError("sharegpt_roles", f"{name!r} maps to {role!r}; map each name to one of "
                                                    f"{', '.join(ROLE_NAMES)}")
        self.dataset_mixture = _mapping("dataset_mixture", self.dataset_mixture)
        if self.dataset_mixture is not None:
            self.dataset_mixture = _check_mixture(self.dataset_mixture)
            given = [n for n in ("dataset_name", "train_file", "validation_file") if getattr(self, n) is not None]
            if given:
                raise ConfigError("dataset_mixture", f"replaces dataset_name, train_file and validation_file; unset "
                                                     f"{', '.join(given)}")
            if self.streaming:
                raise ConfigError("dataset_mixture", "a mixture is drawn from whole sets, which a stream does not "
                                                     "have; set streaming: false")

    @property
    def padding_free(self) -> bool:
        """bfd or bfd_split: documents per packed row, each attending only to itself (``toolkit.packing``); either
        with packing false is refused."""
        return self.packing is not False and self.packing_strategy in ("bfd", "bfd_split")

    def __post_init__(self):
        if self.dataset_name is not None and self.train_file is not None:
            raise ConfigError("train_file", "set either dataset_name or train_file, not both")
        for name in ("train_file", "validation_file"):
            if getattr(self, name) is not None:
                self.data_files(name)  # checks every file the field names
        if not 0 <= self.validation_split_percentage < 100:
            raise ConfigError("validation_split_percentage",
                              f"must be in [0, 100), got {self.validation_split_percentage}")
        _positive(self, "block_size", "max_train_samples", "max_eval_samples", "preprocessing_num_workers",
                  allow_none=True)
        _positive(self, "shuffle_buffer_size")
        if self.streaming:
            self._check_stream()
        if self.packing_strategy is not None:
            if self.packing_strategy not in PACKING_STRATEGIES:
                raise ConfigError("packing_strategy", f"{self.packing_strategy!r} is not one of "
                                                      f"{', '.join(PACKING_STRATEGIES)}")
            if self.packing is False:
                raise ConfigError("packing_strategy", "applies only with packing: true; unset packing_strategy or "
                                                      "set packing: true")
        self._check_formats()
        if self.class_weights and self.class_weights != ["balanced"]:
            try:
                weights = [float(w) for w in self.class_weights]
            except ValueError:
                raise ConfigError("class_weights", f"expected one number per class or 'balanced', got "
                                                   f"{self.class_weights}") from None
            if any(not w > 0 for w in weights):
                raise ConfigError("class_weights", f"every weight must be > 0, got {self.class_weights}")


def _mapping(name: str, value):
    """A mapping field's value as a dict: YAML gives one, the command line its YAML (or JSON) text."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(name, f"is not a YAML mapping: {str(e).splitlines()[0]}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(name, f"expected a mapping, e.g. {{key: value}}, got {value!r:.200}")
    return parsed


MIXTURE_KEYS = ("datasets", "seed", "test_split_size")
MIXTURE_SET_KEYS = ("id", "config", "split", "columns", "weight")


def _check_mixture(mixture: dict) -> dict:
    """alignment-handbook's ``dataset_mixture``, checked, with its defaults filled in (seed 0, split train, weight
    1, all columns, no test split); local ids (a path or a glob) must name files."""
    _known_keys(mixture, MIXTURE_KEYS, "")
    sets = mixture.get("datasets")
    if not isinstance(sets, list) or not sets:
        raise ConfigError("dataset_mixture", "needs datasets: a list of {id, split, columns, weight}")
    out = []
    for i, entry in enumerate(sets):
        where = f"datasets[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            raise ConfigError("dataset_mixture", f"{where} needs an id (a file, a glob or a Hub dataset name)")
        _known_keys(entry, MIXTURE_SET_KEYS, f"{where} ")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1:
            raise ConfigError("dataset_mixture", f"{where} ({entry['id']}): weight is the fraction of the set's rows "
                                                 f"to take, in (0, 1]; got {weight!r}")
        columns = entry.get("columns")
        if columns is not None and (not isinstance(columns, list) or not all(isinstance(c, str) for c in columns)):
            raise ConfigError("dataset_mixture", f"{where} ({entry['id']}): columns must be a list of column names")
        mixture_files(entry["id"], where)
        out.append({"id": entry["id"], "config": entry.get("config"), "split": str(entry.get("split") or "train"),
                    "columns": columns, "weight": float(weight)})
    seed, test = mixture.get("seed", 0), mixture.get("test_split_size")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError("dataset_mixture", f"seed must be an integer, got {seed!r}")
    if test is not None and (isinstance(test, bool) or not isinstance(test, (int, float)) or not 0 <= test < 1):
        raise ConfigError("dataset_mixture", f"test_split_size is the fraction held out, in [0, 1); got {test!r}")
    return {"datasets": out, "seed": seed, "test_split_size": test}


def _known_keys(mapping: dict, known: tuple, where: str) -> None:
    unknown = [k for k in mapping if k not in known]
    if unknown:
        raise ConfigError("dataset_mixture", f"{where}has unknown key(s) {unknown}; known: {', '.join(known)}")


def mixture_files(dataset_id: str, where: str = "dataset_mixture") -> list[str] | None:
    """The local files a mixture id names (a path or a glob, as train_file's), or None for a Hub (or built-in) name:
    an id with a data file's extension, a path separator or a glob pattern is local."""
    local = glob.has_magic(dataset_id) or os.path.splitext(dataset_id)[1].lower() in DATA_EXTENSIONS or \
        os.path.exists(dataset_id)
    if not local:
        return None
    files = sorted(p for p in glob.glob(dataset_id, recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError("dataset_mixture", f"{where}: no file matches {dataset_id!r}")
    for path in files:
        if os.path.splitext(path)[1].lower() not in DATA_EXTENSIONS:
            raise ConfigError("dataset_mixture", f"{where}: unsupported extension ({path}); use one of "
                                                 f"{', '.join(DATA_EXTENSIONS)}")
    return files


@dataclass
class TrainingArguments:
    """Training fields, named as in ``transformers.TrainingArguments``; the class takes transformers' name too, as
    ``ModelArguments`` and ``DataArguments`` take run_clm.py's. Not transformers' class: only the fields this toolkit
    implements, checked here."""

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
    disable_dropout: Optional[bool] = field(
        default=None, metadata={"help": "Set every dropout probability of the model to 0 (TRL's name): "
                                        "deterministic runs, e.g. to compare strategies. Unset: the task's default "
                                        "(DPO: true, as TRL's; every other recipe: false)."}
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute each layer's activations in the backward pass instead of keeping "
                                         "them (non-reentrant; TrainingArguments' name): less memory, ~1/3 more "
                                         "compute. Under FSDP, fsdp_activation_checkpointing in the launch config "
                                         "does the same; set one of them."}
    )
    peak_flops: Optional[float] = field(
        default=None, metadata={"help": "Peak FLOP/s of one device, for MFU; default: a datasheet value for known "
                                        "GPUs (toolkit/accounting.py), none on a CPU."}
    )
    loss_chunk_size: int = field(
        default=0, metadata={"help": "Compute the training and the evaluation loss this many token positions at a "
                                     "time, never holding the whole micro-batch's (or eval batch's) fp32 logits "
                                     "(the largest activation of a small model with a big vocabulary); 0 = off."}
    )
    cpu_memory_reuse: Optional[bool] = field(
        default=None, metadata={"help": "On CPU ranks, keep freed memory in the process for reuse (glibc mallopt) "
                                        "instead of handing it back to the kernel, which zero-fills fresh pages for "
                                        "every logits-sized tensor: 1.5x faster steps, but the process keeps a "
                                        "fragmented peak heap (toolkit/host_memory.py). Unset: on, unless "
                                        "activation checkpointing or loss_chunk_size asks for less memory. No effect "
                                        "on GPUs."}
    )
    skip_nonfinite_steps: bool = field(
        default=False, metadata={"help": "On a non-finite gradient norm, skip that optimizer step (counted in the "
                                         "metrics as skipped_steps) instead of stopping the run. Not under "
                                         "DeepSpeed, whose engine applies a step before its norm is known."}
    )
    max_consecutive_overflows: int = field(
        default=20, metadata={"help": "fp16 loss scaling: an overflow step is skipped and the scale halved (counted "
                                      "as skipped_steps); this many in a row stop the run (from the default scale "
                                      "2^16, 17 halvings leave it below 1)."}
    )
    loss_normalization: str = field(
        default="global_tokens",
        metadata={
            "help": "global_tokens: divide by target tokens in the whole accumulated global batch (correct). "
            "per_micro_batch: mean per micro-batch, the pre-2024 transformers bug; for comparison only."
        },
    )
    beta: Optional[float] = field(
        default=None, metadata={"help": "DPO and GRPO (TRL's name). DPO: how far the policy may move from the "
                                        "reference; the loss is -logsigmoid(beta x the difference of the chosen and "
                                        "rejected log-ratios); must be > 0. GRPO: the weight of the per-token KL to "
                                        "the reference; 0 loads no reference. Unset: the task's default (DPO: 0.1, "
                                        "GRPO: 0.0, TRL's).",
                                "tasks": PREFERENCE_TASKS}
    )
    loss_type: Optional[str] = field(
        default=None, metadata={"help": "DPO and GRPO (TRL's names). DPO: 'sigmoid', the loss of the DPO paper, or "
                                        "'ipo' (TRL's IPO: the squared distance of the token-averaged log-ratio "
                                        "difference from 1/(2 beta)). GRPO: 'dapo' (over the global batch's "
                                        "completion tokens), 'grpo' (each completion's token mean, averaged), "
                                        "'bnpo' (here the same as dapo: over the global batch's tokens) or "
                                        "'dr_grpo' (over completions x max_completion_length). Unset: the task's "
                                        "default (DPO: sigmoid, GRPO: dapo, TRL's).", "tasks": PREFERENCE_TASKS}
    )
    num_generations: int = field(
        default=8, metadata={"help": "GRPO (TRL's name): completions sampled per prompt, a group; the global batch "
                                     "(ranks x per_device_train_batch_size x gradient_accumulation_steps) counts "
                                     "completions and must be a multiple of it.", "tasks": GRPO_ONLY}
    )
    max_prompt_length: Optional[int] = field(
        default=512, metadata={"help": "GRPO: prompts longer than this many tokens keep their last tokens (TRL's "
                                       "left truncation); null keeps them whole.", "tasks": GRPO_ONLY}
    )
    max_completion_length: int = field(
        default=512, metadata={"help": "GRPO (TRL's name): tokens generated per completion at most; a completion "
                                       "with no EOS within it is truncated.", "tasks": GRPO_ONLY}
    )
    temperature: float = field(default=1.0, metadata={"help": "GRPO (TRL's name): the sampling temperature (the "
                                                              "log-probs of the loss are taken at it too).",
                                                      "tasks": GRPO_ONLY})
    top_p: float = field(default=1.0, metadata={"help": "GRPO (TRL's name): nucleus sampling's probability mass; 1 "
                                                        "turns it off.", "tasks": GRPO_ONLY})
    top_k: int = field(default=0, metadata={"help": "GRPO (TRL's name): sample among the k likeliest tokens; 0 turns "
                                                    "it off.", "tasks": GRPO_ONLY})
    epsilon: float = field(default=0.2, metadata={"help": "GRPO (TRL's name): the ratio is clipped to [1 - epsilon, "
                                                          "1 + epsilon_high].", "tasks": GRPO_ONLY})
    epsilon_high: Optional[float] = field(default=None, metadata={"help": "GRPO (TRL's name): the upper clip; unset: "
                                                                          "epsilon.", "tasks": GRPO_ONLY})
    num_iterations: int = field(
        default=1, metadata={"help": "GRPO (TRL's name): optimizer steps per generated batch; the steps after the "
                                     "first reuse its completions with the old policy's log-probs (clipped ratio).",
                             "tasks": GRPO_ONLY}
    )
    scale_rewards: str = field(
        default="group", metadata={"help": "GRPO (TRL's name): divide each advantage by its group's reward std "
                                           "('group'), the global batch's ('batch') or not ('none'), + 1e-4.",
                                   "tasks": GRPO_ONLY}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "GRPO (TRL's name): completions with no EOS within max_completion_length "
                                         "take no part in the loss.", "tasks": GRPO_ONLY}
    )
    reward_funcs: Optional[list[str]] = field(
        default=None, metadata={"help": "GRPO: reward functions, import paths 'module:function' (TRL's signature: "
                                        "prompts, completions, completion_ids and the dataset's other columns as "
                                        "keyword arguments -> a list of floats) or a built-in's name "
                                        "(arithmetic_correct, arithmetic_format). Unset: the built-in set's.",
                                "nargs": "+", "tasks": GRPO_ONLY}
    )
    reward_weights: Optional[list[float]] = field(
        default=None, metadata={"help": "GRPO (TRL's name): one weight per reward function; unset: 1 each.",
                                "nargs": "+", "tasks": GRPO_ONLY}
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "DPO (TRL's name): compute the reference's log-probabilities once before "
                                         "training (a whole copy on the device, each rank its share, then freed; "
                                         "kept in output_dir/reference_logps/ for a resume) instead of a live "
                                         "frozen copy sharded like the policy.", "tasks": DPO_ONLY}
    )
    logging_steps: int = field(default=10, metadata={"help": "Log every N optimizer steps."})
    eval_steps: Optional[int] = field(default=None, metadata={"help": "Evaluate every N steps (and at the end)."})
    eval_on_start: bool = field(default=False, metadata={"help": "Evaluate before the first step."})
    save_steps: Optional[int] = field(default=None, metadata={"help": "Checkpoint every N optimizer steps."})
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "Keep only the N newest checkpoints."})
    resume_from_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "A checkpoint folder, or 'latest' (newest in output_dir/checkpoints)."}
    )
    trust_checkpoint: bool = field(
        default=False, metadata={"help": "Allow resume_from_checkpoint to name a checkpoint outside this output_dir "
                                         "(another run's, a download). Resuming unpickles parts of a checkpoint "
                                         "(DeepSpeed's files, DCP's metadata): a checkpoint folder is code; trust "
                                         "only one you wrote (docs/reliability.md#checkpoints-are-code)."}
    )
    report_to: str = field(
        default="tensorboard", metadata={"help": "The tracker: 'tensorboard', 'wandb', 'mlflow', ... (accelerate's; "
                                                 "it must be installed), 'all' (every installed one) or 'none'."}
    )
    plot: bool = field(
        default=True, metadata={"help": "Draw output_dir/loss.png (train and eval loss, learning rate) when the run "
                                        "ends; `python -m toolkit report` draws it from metrics.jsonl any time."}
    )
    dataloader_num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes."})
    save_final_model: bool = field(default=True, metadata={"help": "Write output_dir/final with save_pretrained."})
    pipeline_parallel_size: int = field(
        default=1, metadata={"help": "Pipeline stages: the model's decoder layers cut into this many stages, one per "
                                     "rank of a pipeline; ranks = pipeline_parallel_size x data-parallel replicas "
                                     "(ddp.yaml; docs/strategies.md#pipeline-parallelism). 1 = off."}
    )
    pipeline_schedule: str = field(
        default="1f1b", metadata={"help": "The pipeline's schedule (torch.distributed.pipelining's): gpipe, 1f1b or "
                                          "interleaved_1f1b; its micro-batches are the gradient_accumulation_steps."}
    )
    pipeline_stages_per_rank: int = field(
        default=1, metadata={"help": "Stages each rank holds (interleaved_1f1b only: 2 or more; the others take 1)."}
    )

    def __post_init__(self):
        _positive(self, "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                  "logging_steps", "max_consecutive_overflows")
        _positive(self, "eval_steps", "save_steps", "save_total_limit", allow_none=True)
        _finite(self, "learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon")
        _at_least_zero(self, "learning_rate", "weight_decay", "warmup_steps", "dataloader_num_workers")
        _fraction(self, "adam_beta1", "adam_beta2",
                  why=" (a moving average's decay: at 1 it never moves and its bias correction divides by zero)")
        _at_least_zero(self, "max_grad_norm", why=" (0 turns clipping off)")
        _at_least_zero(self, "loss_chunk_size", why=" (0 turns it off)")
        if self.beta is not None:
            _finite(self, "beta")
            _at_least_zero(self, "beta", why=" (DPO takes > 0, GRPO 0 for no reference)")
        if self.loss_type is not None:  # which task takes which value: the task's check
            _one_of(self, "loss_type", (*LOSS_TYPES, *GRPO_LOSS_TYPES))
        self._check_grpo()
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError("peak_flops", f"must be a device's peak FLOP/s (> 0), e.g. 989e12; got {self.peak_flops}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError("max_steps", "must be a positive number of steps, or -1 to use num_train_epochs; "
                                           f"got {self.max_steps}")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise ConfigError("num_train_epochs", f"must be > 0 when max_steps is -1, got {self.num_train_epochs}")
        _one_of(self, "optim", OPTIMIZERS)
        if self.optim.endswith("_8bit") and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("optim", f"{self.optim} is bitsandbytes' 8-bit AdamW: pip install '.[qlora]', or use "
                                       "optim: adamw_torch")
        _one_of(self, "lr_scheduler_type", SCHEDULERS)
        _one_of(self, "loss_normalization", LOSS_NORMALIZATIONS)
        _check_report_to(self.report_to)
        self._check_pipeline()
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise ConfigError("output_dir",
                              f"{self.output_dir} is a file; output_dir must be a folder (new, or a run's)")
        self._check_resume_folder()

    def _check_grpo(self) -> None:
        """GRPO's fields on their own (the global batch against num_generations needs the world size: the task's
        check)."""
        _positive(self, "max_completion_length", "num_iterations")
        _positive(self, "max_prompt_length", allow_none=True)
        _at_least_zero(self, "top_k", why=" (0 turns it off)")
        _finite(self, "temperature", "top_p", "epsilon")
        if self.num_generations < 2:
            raise ConfigError("num_generations", f"must be >= 2 (a group's advantages are its rewards against the "
                                                 f"group's mean), got {self.num_generations}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            name = "temperature" if self.temperature <= 0 else "top_p"
            raise ConfigError(name, f"must be {'> 0' if name == 'temperature' else 'in (0, 1]'}, got "
                                    f"{getattr(self, name)}")
        _one_of(self, "scale_rewards", SCALE_REWARDS)

    def _check_pipeline(self) -> None:
        """Pipeline parallelism's fields, and what it does not run yet, refused before any work."""
        _positive(self, "pipeline_parallel_size", "pipeline_stages_per_rank")
        _one_of(self, "pipeline_schedule", PIPELINE_SCHEDULES)
        interleaved = self.pipeline_schedule == "interleaved_1f1b"
        if self.pipeline_parallel_size > 1 and interleaved != (self.pipeline_stages_per_rank > 1):
            raise ConfigError("pipeline_stages_per_rank",
                              "interleaved_1f1b needs 2 or more stages per rank, gpipe and 1f1b exactly 1; got "
                              f"{self.pipeline_stages_per_rank} with {self.pipeline_schedule}")
        if self.pipeline_parallel_size == 1:
            return
        m, stages = self.gradient_accumulation_steps, self.pipeline_parallel_size
        if (self.pipeline_schedule == "1f1b" and m < stages) or (interleaved and m % stages):
            need = f"at least {stages}" if self.pipeline_schedule == "1f1b" else f"a multiple of {stages}"
            raise ConfigError("gradient_accumulation_steps",
                              f"is the pipeline's micro-batches: {self.pipeline_schedule} with {stages} stages needs "
                              f"{need} (torch's schedule), got {m}; raise it (fewer rows per micro-batch keep the "
                              "global batch) or use gpipe")
        for name, off in (("save_steps", None), ("resume_from_checkpoint", None), ("loss_chunk_size", 0)):
            if getattr(self, name) != off:
                raise ConfigError(name, f"is not supported with pipeline_parallel_size {self.pipeline_parallel_size} "
                                        "yet (checkpoints of a pipeline and the chunked loss are not implemented): "
                                        f"leave {name} unset, or train with pipeline_parallel_size 1")
        if self.loss_normalization != "global_tokens":
            raise ConfigError("loss_normalization", "a pipeline normalises by the global batch's target tokens only: "
                                                    "use global_tokens")

    def _check_resume_folder(self) -> None:
        """A named checkpoint folder: one this toolkit wrote, and output_dir's own unless trust_checkpoint."""
        resume = self.resume_from_checkpoint
        if resume not in (None, layout.LATEST):
            if not os.path.isdir(resume):
                raise ConfigError("resume_from_checkpoint", f"folder not found: {resume} (or use '{layout.LATEST}')")
            if layout.read_checkpoint_state(resume) is None:
                raise ConfigError("resume_from_checkpoint",
                                  f"{resume} is not a checkpoint of this toolkit (no {layout.CHECKPOINT_STATE}): "
                                  "resuming it would unpickle files this toolkit did not write, and it records no "
                                  f"position to continue from; pass a {layout.CHECKPOINTS}/step-N folder of a run, "
                                  f"or '{layout.LATEST}'")
            if not self.trust_checkpoint and not layout.belongs_to(resume, self.output_dir):
                raise ConfigError("resume_from_checkpoint",
                                  f"{resume} is not one of output_dir {self.output_dir}'s checkpoints; resuming "
                                  "unpickles parts of a checkpoint (DeepSpeed's files, DCP's metadata), so a "
                                  "checkpoint folder is code: if you trust it (your own run's), set "
                                  "trust_checkpoint: true (docs/reliability.md#checkpoints-are-code)")


ARGUMENT_CLASSES = (ModelArguments, DataArguments, TrainingArguments)


@dataclass
class RunConfig:
    """The three argument groups of one run; ``as_dict`` is what lands in ``output_dir/config.yaml``.

    Building one checks what needs more than one group or the file system: a model and data are named, the
    output_dir can be written without losing an earlier run, block_size fits the model (read from its config only).
    """

    model: ModelArguments
    data: DataArguments
    train: TrainingArguments

    def __post_init__(self):
        if self.model.model_name_or_path is None and self.model.config_name is None:
            raise ConfigError("model_name_or_path", "set model_name_or_path (pretrained) or config_name (from scratch)")
        if self.data.dataset_name is None and self.data.train_file is None and self.data.dataset_mixture is None:
            raise ConfigError("dataset_name", "set dataset_name (Hub or 'pydoc') or train_file (a local file)")
        self.data.sample_seed = self.train.seed  # max_*_samples draw their rows with the run's seed
        if self.data.streaming:
            self._check_stream()
        if self.train.pipeline_parallel_size > 1 and (self.data.padding_free or self.data.streaming):
            raise ConfigError("packing_strategy" if self.data.padding_free else "streaming",
                              "padding-free packing and streaming are not supported under pipeline parallelism (a "
                              "pipeline passes each row's attention mask): use packing_strategy wrapped or padded "
                              "rows, streaming false")
        # A torch elastic restart continues its earlier attempt (toolkit.elastic): resume 'latest', and that
        # attempt's files are no "earlier run" for _check_output_dir.
        elastic.check_machines()  # a scheduler's N machines, one process group each: refused before any work
        self.elastic_restart = elastic.continue_restart(self)
        self._check_output_dir()
        positions = max_positions(self.model.read_model_config())
        if positions is not None and self.data.block_size is not None and self.data.block_size > positions:
            raise ConfigError("block_size",
                              f"{self.data.block_size} exceeds the model's {positions} positions; use <= {positions}")

    def _check_stream(self) -> None:
        if self.train.max_steps <= 0:
            raise ConfigError("max_steps", "streaming: a stream has no length, so num_train_epochs cannot say when "
                                           "to stop; set max_steps (the run also ends, with a message, if the "
                                           "stream ends first)")
        if self.train.dataloader_num_workers:
            raise ConfigError("dataloader_num_workers", "streaming: the stream is read and tokenized in the "
                                                        "training process (its position goes into checkpoints); "
                                                        "set dataloader_num_workers: 0")

    def _check_output_dir(self) -> None:
        """Never start over an earlier run's files by accident; never promise a resume that has nothing to load."""
        args = self.train
        if args.resume_from_checkpoint == layout.LATEST and layout.latest_checkpoint(args.output_dir) is None:
            raise ConfigError("resume_from_checkpoint",
                              f"'latest' but {layout.checkpoints_dir(args.output_dir)} holds no checkpoint")
        if args.overwrite_output_dir or getattr(self, "elastic_restart", False):
            return  # overwrite: moved aside (Checkpointer); a restart: the earlier attempt's files
        if args.resume_from_checkpoint is not None:
            self._check_resume_into_output_dir()
            return
        if layout.has_final_model(args.output_dir):
            raise ConfigError(
                "output_dir",
                f"{args.output_dir} already holds a finished run ({layout.FINAL}/); pick a new output_dir, "
                "set overwrite_output_dir: true, or resume_from_checkpoint",
            )
        if layout.list_checkpoints(args.output_dir):
            raise ConfigError(
                "output_dir",
                f"{layout.checkpoints_dir(args.output_dir)} already holds checkpoints of an earlier run; continue it "
                "with resume_from_checkpoint: latest, or set overwrite_output_dir: true to start over (the earlier "
                "files are moved aside, not deleted)",
            )
        if os.path.isfile(layout.path(args.output_dir, layout.METRICS)):
            raise ConfigError(
                "output_dir",
                f"{args.output_dir} holds the {layout.METRICS} of an earlier run (it stopped before any checkpoint); "
                "pick a new output_dir, or set overwrite_output_dir: true (the earlier files are moved aside)",
            )

    def _check_resume_into_output_dir(self) -> None:
        """A checkpoint of another output_dir continues only into a folder no run has written to: resumed into
        another run's folder, the run would replace its final/, append to its metrics.jsonl and rotate its
        checkpoints away."""
        args = self.train
        resume = args.resume_from_checkpoint
        if resume == layout.LATEST or layout.belongs_to(resume, args.output_dir):
            return
        found = layout.earlier_run(args.output_dir)
        if found is not None:
            raise ConfigError(
                "resume_from_checkpoint",
                f"{resume} is not a checkpoint of output_dir {args.output_dir}, which holds {found}; resuming there "
                "would overwrite that run's files. Resume into a new output_dir, or set overwrite_output_dir: true "
                "(the earlier files are moved aside, not deleted)",
            )

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in (self.model, self.data, self.train):
            out.update(dataclasses.asdict(part))
        return out


def field_names() -> list[str]:
    return [f.name for cls in ARGUMENT_CLASSES for f in dataclasses.fields(cls)]


# ------------------------------------------------------------------------------------------------------ parsing
def _parser():
    from transformers import HfArgumentParser

    class _Parser(HfArgumentParser):
        # argparse's default error() prints the whole usage (50 fields) and exits; we want one line naming the field.
        def error(self, message):
            raise ConfigError(None, message)

        # HfArgumentParser passes a field's metadata to add_argument; "tasks" is ours (toolkit.config_help), not
        # argparse's.
        def add_argument(self, *names, tasks=None, task_checks=None, **kwargs):
            return super().add_argument(*names, **kwargs)

    return _Parser(ARGUMENT_CLASSES, allow_abbrev=False)


def _optional_fields() -> set[str]:
    """Fields whose value may be None (unset): the Optional[...] ones."""
    # From the class annotations: HfArgumentParser rewrites each field's .type in place (Optional[str] -> str).
    return {name for cls in ARGUMENT_CLASSES for name, hint in typing.get_type_hints(cls).items()
            if type(None) in typing.get_args(hint)}


FILE_LISTS = ("train_file", "validation_file")  # a YAML list is one comma-separated value (DataArguments.data_files)
NULL_WORDS = ("null", "none", "None", "~", "")  # on the command line: unset an optional field (YAML's null)


def _yaml_to_argv(values: dict, source: str, known: list[str]) -> tuple[list[str], dict, list[str]]:
    """Turn YAML values into CLI tokens so that argparse type-checks them exactly like command-line values; also
    the YAML nulls of optional fields, and the unknown keys (reported with the command line's, all at once)."""
    argv, nulls, unknown = [], {}, []
    optional = _optional_fields()
    for key, value in values.items():
        if key not in known:
            unknown.append(key)
        elif value is None:
            # `seed:` or `shuffle: null` in YAML: unset is not a value for these (once: a crash in set_seed after
            # the process group was up, or shuffling silently off).
            if key not in optional:
                raise ConfigError(key, f"is empty (null) in {source}; give it a value or delete the line to use the "
                                       "default")
            nulls[key] = None
        elif isinstance(value, bool):
            argv += [f"--{key}", "true" if value else "false"]
        elif isinstance(value, (list, tuple)) and key in FILE_LISTS:
            argv += [f"--{key}", ",".join(str(v) for v in value)]
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", *[str(v) for v in value]]
        elif isinstance(value, dict) and key in MAPPING_FIELDS:  # its YAML text, parsed back by the field's check
            argv += [f"--{key}", yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()]
        elif isinstance(value, dict):
            raise ConfigError(key, f"expected a single value in {source}, got a mapping")
        else:
            argv += [f"--{key}", str(value)]
    return argv, nulls, unknown


def _join_file_lists(argv: list[str]) -> list[str]:
    """``--train_file data/part-*.jsonl`` typed unquoted reaches us as the shell's expansion, several paths: the
    values after ``--train_file`` or ``--validation_file`` up to the next ``--flag`` become one comma-separated value
    (the YAML list's form), instead of an unknown argument for every path after the first."""
    out, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        if name not in FILE_LISTS:
            out.append(argv[i])
            i += 1
            continue
        values, i = ([value] if eq else []), i + 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        out += [f"--{name}", ",".join(values)] if values else [argv[i - 1]]  # no value: argparse says so
    return out


def _cli_nulls(argv: list[str]) -> tuple[list[str], set[str]]:
    """``--field null`` (or none, None, ~, "") on the command line unsets an optional field, the way a YAML null
    does: the tokens are taken out and the field's name returned. A field that cannot be unset keeps its tokens
    (argparse then names it and the bad value)."""
    optional, out, unset, i = _optional_fields(), [], set(), 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        if name in optional and (eq or i + 1 < len(argv)) and value in NULL_WORDS:
            unset.add(name)
            out = _drop_field(out, name)  # an earlier value of the field on the command line: the last one wins
            i += 1 if eq else 2
            continue
        unset.discard(name)  # a later value wins over an earlier null
        out.append(token)
        i += 1
    return out, unset


def _drop_field(argv: list[str], name: str) -> list[str]:
    """argv without ``--name`` (or ``--name=...``) and the values after it."""
    out, dropping = [], False
    for token in argv:
        if token.startswith("--"):
            dropping = token[2:].partition("=")[0] == name
        if not dropping:
            out.append(token)
    return out


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError("config", f"file not found: {path}")
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError("config", f"{path} must be a mapping of field: value")
    return values


def parse_args(argv: list[str] | None = None, task: str | None = None,
               description: str | None = None) -> RunConfig:
    """Parse ``--config file.yaml`` plus overrides. Raises ConfigError; ``toolkit.cli`` turns it into one line and exit 2.
    ``--field null`` on the command line unsets an optional field that the YAML file sets.

    A recipe passes its ``task`` (``Task.name``) and its docstring: ``--help`` then shows that description and the
    task's fields only, and a field of another task set to other than its default is refused, naming the recipe
    that takes it (``toolkit.config_help``). Without a task (scripts) every field is taken."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    ns, rest = pre.parse_known_args(argv)
    rest, unset = _cli_nulls(_join_file_lists(rest))

    yaml_argv, nulls, unknown = [], {}, []
    if ns.config is not None:
        values = {k: v for k, v in _read_yaml(ns.config).items() if k not in unset}  # the command line wins
        yaml_argv, nulls, unknown = _yaml_to_argv(values, ns.config, field_names())

    if "-h" in rest or "--help" in rest:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "recipe"
        sys.stdout.write(config_help.help_text(ARGUMENT_CLASSES, task, description, prog))
        sys.exit(0)

    return _parse(yaml_argv + rest, {**nulls, **dict.fromkeys(unset)}, unknown, ns.config, task)


def config_from_dict(values: dict) -> RunConfig:
    """A RunConfig from a plain dict (notebooks, scripts), type-checked and validated exactly like a YAML file."""
    argv, nulls, unknown = _yaml_to_argv(values, "the given values", field_names())
    return _parse(argv, nulls, unknown, "the given values")


def _unknown_error(yaml_unknown: list[str], source: str | None, cli_unknown: list[str], known) -> ConfigError:
    """One error naming every unknown field at once, each with its closest known name."""
    cli_names = [t.lstrip("-").split("=")[0] for t in cli_unknown]
    names = yaml_unknown + cli_names
    if len(names) == 1:
        where = f"unknown field in {source}." if yaml_unknown else f"unknown argument '{cli_unknown[0]}'."
        return ConfigError(names[0], f"{where}{_suggest(names[0], known)}")

    def hint(name):
        close = _closest(name, known)
        return f": did you mean '{close}'?" if close else ""

    described = [f"'{k}' (in {source}{hint(k)})" for k in yaml_unknown]
    described += [f"'{t}' (command line{hint(n)})" for t, n in zip(cli_unknown, cli_names)]
    return ConfigError(", ".join(names), f"{len(names)} unknown fields: {'; '.join(described)}")


def _parse(argv: list[str], nulls: dict, yaml_unknown: list[str] = (), source: str | None = None,
           task: str | None = None) -> RunConfig:
    """argv tokens (YAML values first, command line after: the last value wins) -> checked RunConfig."""
    known = field_names()
    parser = _parser()
    if nulls:
        parser.set_defaults(**nulls)
    try:
        # Every unknown field first, all in one message (a run once reported one typo per try).
        _, remaining = parser.parse_known_args(args=argv)
        cli_unknown = [r for r in remaining if r.startswith("--")] or remaining[:1]
        if yaml_unknown or cli_unknown:
            raise _unknown_error(list(yaml_unknown), source, cli_unknown, known)
        # Each dataclass checks its fields as it is built, RunConfig checks the whole.
        groups = parser.parse_args_into_dataclasses(args=argv)
        _check_task_fields(groups, task)
        return RunConfig(*groups)
    except ConfigError as e:
        raise _name_field(e) from None


def _check_task_fields(groups, task: str | None) -> None:
    """A field of another recipe's task set to other than its default: refused, naming the recipe that takes it (the
    recipe would ignore it). A default value passes, so that a run's own config.yaml (every field) parses again."""
    for group in groups:
        for f in dataclasses.fields(group):
            if f.init and config_help.refuses(f, task, getattr(group, f.name)):
                raise ConfigError(f.name, f"is a field of {config_help.recipes_of(f)}; "
                                          f"recipes/{config_help.TASK_RECIPES[task]} does not use it: delete it")


def _name_field(err: ConfigError) -> ConfigError:
    # argparse says "argument --learning_rate: invalid float value: 'abc'"; lift the field name to the front.
    msg = str(err)
    if err.field_name is None and msg.startswith("argument --"):
        name, _, rest = msg[len("argument --") :].partition(":")
        name = name.split("/")[0].strip()
        return ConfigError(name, rest.strip())
    return err


def write_config(cfg: RunConfig, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(cfg.as_dict(), f, sort_keys=False)

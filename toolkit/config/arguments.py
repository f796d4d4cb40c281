"""Run configuration: dataclasses parsed by transformers' ``HfArgumentParser`` from a YAML file plus CLI overrides.

The convention is TRL's / alignment-handbook's: ``--config recipe.yaml`` sets the values, and any field can be
overridden on the command line (``--learning_rate 1e-4``); the command line wins. Field names are those of
``transformers.TrainingArguments`` and ``run_clm.py`` wherever they exist, so users can carry their configs over.

Everything here runs before a model, a dataset or a process group is touched: a typo, a wrong type or an impossible
value stops with one message naming the field (``ConfigError``), not a stack trace ten minutes into a run. Each
dataclass checks its own fields in ``__post_init__`` (so a value is checked wherever the dataclass is built); what
needs two groups or the file system (is there a model and data, does ``output_dir`` hold a finished run, does
``block_size`` fit the model) is ``RunConfig``'s.

This module lists every field: its classes name their parts, each a small module with its fields and their checks
(``config_quantization``, ``config_grpo``, ``config_pipeline``; the dataset mixture's check is ``config_mixture``'s),
on the shared small checks of ``config_checks``. Parsing YAML and the command line is ``config_parsing``'s (bound
here to these classes: ``parse_args``, ``config_from_dict``). It imports no other toolkit module but ``errors``,
``layout``, ``elastic`` (standard library and yaml only), and neither torch nor accelerate: parsing a config stays
cheap. What a torch elastic restart does to a config is ``toolkit.env.elastic``'s; a recipe's ``--help`` and which
recipe takes a field are ``toolkit.config.help``'s; the process exit of a recipe is ``toolkit.cli.recipe``'s.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from toolkit import layout
from toolkit.config import parsing as config_parsing
from toolkit.config.checks import (
    CHAT_TASKS,
    DATA_EXTENSIONS,
    DPO_ONLY,
    FORMAT_TASKS,
    HELD_OUT_TASKS,
    LOGIT_TASKS,
    PACKING_TASKS,
    TEXT_TASKS,
    _at_least_zero,
    _finite,
    _fraction,
    _mapping,
    _one_of,
    _positive,
    _suggest,
)
from toolkit.config.classification import ClassificationArguments
from toolkit.config.grpo import GRPO_LOSS_TYPES, GRPOArguments
from toolkit.config.mixture import _check_mixture, mixture_files
from toolkit.config.muon import MuonArguments
from toolkit.config.pipeline import PipelineArguments
from toolkit.config.preference import LOSS_TYPES, PreferenceArguments
from toolkit.config.quantization import QuantizationArguments
from toolkit.config.sequence import SequenceArguments
from toolkit.env import elastic
from toolkit.errors import ConfigError

# Names other modules import from here, as before the parts had modules of their own.
__all__ = ["ARGUMENT_CLASSES", "DATA_EXTENSIONS", "GRPO_LOSS_TYPES", "LOSS_TYPES", "TRACKERS",
           "ConfigError", "DataArguments", "ModelArguments", "RunConfig", "TrainingArguments", "config_from_dict",
           "field_names", "max_positions", "mixture_files", "parse_args", "write_config"]

# muon: torch.optim.Muon on the hidden matrices, AdamW on the rest (toolkit.training.optimizers, toolkit.config.muon)
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adamw_bnb_8bit", "paged_adamw_8bit", "muon")
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
TORCH_DTYPES = ("float32", "auto", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# packing_strategy (TRL's names): concatenate-and-cut, or best-fit decreasing documents, cut or split (toolkit.data.packing)
PACKING_STRATEGIES = ("wrapped", "bfd", "bfd_split")
# the dataset formats (TRL's, toolkit.data.formats converts them)
DATASET_FORMATS = ("text", "messages", "prompt_completion", "alpaca", "sharegpt", "preference", "implicit_preference")
ROLE_NAMES = ("system", "user", "assistant")
# accelerate's trackers (LoggerType) and the modules each needs, any one of them (accelerate's is_*_available).
TRACKERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "trackio": ("trackio",),
            "aim": ("aim",), "comet_ml": ("comet_ml",), "mlflow": ("mlflow",), "clearml": ("clearml",),
            "dvclive": ("dvclive",), "swanlab": ("swanlab",)}
# Where model configs keep their context length (GPT-2: n_positions; Llama, Qwen, Mistral: max_position_embeddings).
POSITION_ATTRIBUTES = ("n_positions", "max_position_embeddings", "n_ctx")


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
class _ModelFields:
    """ModelArguments' own fields (run_clm.py's names, LoRA's TRL ones) and checks; a base of ``ModelArguments``
    so that its parts' fields follow these in --help and config.yaml (a dataclass lists a base's fields first)."""

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
            if value and os.path.isdir(os.path.expanduser(value)):
                # a local folder (transformers prefers it to a Hub id of the same name) as an absolute path: what the
                # run records (config.yaml, a LoRA adapter's base) must resolve from any folder, not only this one
                setattr(self, name, os.path.abspath(os.path.expanduser(value)))
        for item in self.config_overrides.split(",") if self.config_overrides else []:
            if "=" not in item:
                raise ConfigError("config_overrides", f"expected key=value pairs separated by commas, got {item!r}")

    def _check_attn_implementation(self) -> None:
        """A name transformers knows (or a Hub kernel, owner/name), at parse time; whether this machine can run it
        (flash-attn, a GPU, the kernels package) is ``toolkit.models.loading.check_attn_implementation``'s, with the model's
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
        place it is loaded, for ``read_model_config`` here and for the run (``toolkit.models.loading.load_config``).
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
class _DataFields:
    """DataArguments' own fields and checks; a base of ``DataArguments`` so that its parts' fields follow these in
    --help and config.yaml (a dataclass lists a base's fields first)."""

    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset, or 'pydoc' (CPython's reference docs, no download)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration."})
    train_file: Optional[str] = field(default=None, metadata={
        "help": "Local txt/json/jsonl/csv/parquet file(s): a path, a glob ('data/part-*.jsonl', quoted), or several "
                "separated by commas (in YAML also a list)."})
    validation_file: Optional[str] = field(default=None, metadata={
        "help": "Local validation file(s), as train_file (same format).", "tasks": HELD_OUT_TASKS})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train held out when the dataset has no validation split.",
                             "tasks": HELD_OUT_TASKS}
    )
    text_column_name: Optional[str] = field(
        default=None, metadata={"help": "Text column (default: 'text'; chat SFT: 'messages', a list of {role, "
                                        "content}).", "tasks": TEXT_TASKS}
    )
    chat_template: Optional[str] = field(
        default=None, metadata={"help": "Chat SFT: a Jinja chat template, or a file holding one; overrides the "
                                        "tokenizer's.", "tasks": CHAT_TASKS}
    )
    block_size: Optional[int] = field(
        default=None, metadata={"help": "Tokens per row; default min(1024, the model's positions).",
                                "tasks": HELD_OUT_TASKS}
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
                                        "max_train_samples' rows are.", "tasks": HELD_OUT_TASKS}
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
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={"help": "Processes for datasets.map.",
                                                                             "tasks": HELD_OUT_TASKS})
    dataset_format: Optional[str] = field(
        default=None, metadata={"help": f"The data's format, one of {', '.join(DATASET_FORMATS)}; unset: detected "
                                        "from the columns (docs/recipes.md#dataset-formats).", "tasks": FORMAT_TASKS}
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
                                         "Instead of dataset_name/train_file.", "tasks": FORMAT_TASKS,
                                 "task_checks": True}
    )
    # Not a field: the run's seed (TrainingArguments.seed, set by RunConfig) that draws max_*_samples' rows.
    sample_seed = 42
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute cached tokenization.",
                                                           "tasks": HELD_OUT_TASKS})

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
        """What a stream (``toolkit.data.stream``) cannot honour, refused before work, naming the field the user set."""
        if self.dataset_mixture is not None:
            raise ConfigError("dataset_mixture", "a mixture is drawn from whole sets, which a stream does not have: "
                                                 "set streaming: false, or stream the files as train_file (a list or "
                                                 "a glob) without dataset_mixture")
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

    @property
    def padding_free(self) -> bool:
        """bfd or bfd_split: documents per packed row, each attending only to itself (``toolkit.data.packing``); either
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
        self._check_class_weights()


@dataclass
class _TrainingFields:
    """TrainingArguments' own fields and checks; a base of ``TrainingArguments`` so that its parts' fields follow
    these in --help and config.yaml (a dataclass lists a base's fields first)."""

    output_dir: str = field(default="outputs/run", metadata={"help": "Where metrics, checkpoints and final/ go."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Allow reusing a finished output_dir."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Rows per rank per micro-step."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Rows per rank per eval batch.",
                                                                 "tasks": HELD_OUT_TASKS})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate (optim muon: the Muon group's)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Weight decay (not on biases/norms; optim muon: on both groups)."})
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
                                        "GPUs (toolkit/reporting/accounting.py), none on a CPU."}
    )
    torch_compile: bool = field(
        default=False, metadata={"help": "torch.compile each decoder block (transformers' name): one process, DDP "
                                         "and FSDP2; refused under DeepSpeed, FSDP1, tensor or pipeline parallelism, "
                                         "and with activation checkpointing or LoRA (not proven)."}
    )
    torch_compile_backend: Optional[str] = field(
        default=None, metadata={"help": "torch.compile's backend (transformers' name); unset: inductor. aot_eager "
                                        "traces without generating code (bitwise equal to eager)."}
    )
    torch_compile_mode: Optional[str] = field(
        default=None, metadata={"help": "torch.compile's mode (transformers' name): default, reduce-overhead, "
                                        "max-autotune, ...; unset: torch's default."}
    )
    torch_compile_cache_dir: Optional[str] = field(
        default=None, metadata={"help": "A folder for inductor's compile cache (TORCHINDUCTOR_CACHE_DIR), so that a "
                                        "restart reuses the compiled kernels; unset: torch's default (/tmp)."}
    )
    loss_chunk_size: int = field(
        default=0, metadata={"help": "Compute the training and the evaluation loss this many token positions at a "
                                     "time, never holding the whole micro-batch's (or eval batch's) fp32 logits "
                                     "(the largest activation of a small model with a big vocabulary): torch's fused "
                                     "F.linear_cross_entropy in chunks of this size (GRPO: its completions' log-probs, and the "
                                     "entropy metric from one chunk's logits at a time); 0 = off.",
                             "tasks": LOGIT_TASKS, "task_checks": True}
    )
    cpu_memory_reuse: Optional[bool] = field(
        default=None, metadata={"help": "On CPU ranks, keep freed memory in the process for reuse (glibc mallopt) "
                                        "instead of handing it back to the kernel, which zero-fills fresh pages for "
                                        "every logits-sized tensor: 1.5x faster steps, but the process keeps a "
                                        "fragmented peak heap (toolkit/env/host_memory.py). Unset: on, unless "
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
    logging_steps: int = field(default=10, metadata={"help": "Log every N optimizer steps."})
    eval_steps: Optional[int] = field(default=None, metadata={"help": "Evaluate every N steps (and at the end).",
                                                              "tasks": HELD_OUT_TASKS})
    eval_on_start: bool = field(default=False, metadata={"help": "Evaluate before the first step.",
                                                         "tasks": HELD_OUT_TASKS})
    save_steps: Optional[int] = field(default=None, metadata={"help": "Checkpoint every N optimizer steps."})
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "Keep only the N newest checkpoints."})
    async_save: bool = field(
        default=False, metadata={"help": "Write each checkpoint while training goes on: the weights and optimizer "
                                         "state are copied into host memory (torch.distributed.checkpoint's "
                                         "async_save) and written by a background thread; latest moves once the "
                                         "write is complete. Under DDP and FSDP2 (and one process); not DeepSpeed, "
                                         "FSDP1, tensor or pipeline parallelism."}
    )
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
        self._check_preference()
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
        self._check_muon()
        self._check_sequence()
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise ConfigError("output_dir",
                              f"{self.output_dir} is a file; output_dir must be a folder (new, or a run's)")
        self._check_resume_folder()

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


@dataclass
class ModelArguments(QuantizationArguments, _ModelFields):
    """The model: its own fields, then quantization's (``toolkit.config.quantization``)."""


@dataclass
class DataArguments(ClassificationArguments, _DataFields):
    """The data: its own fields (run_clm.py's names), then classification's (``toolkit.config.classification``)."""


@dataclass
class TrainingArguments(SequenceArguments, MuonArguments, PipelineArguments, GRPOArguments, PreferenceArguments,
                        _TrainingFields):
    """Training fields, named as in ``transformers.TrainingArguments``; the class takes transformers' name too, as
    ``ModelArguments`` and ``DataArguments`` take run_clm.py's. Not transformers' class: only the fields this toolkit
    implements, checked here. Its own fields, then the preference tasks' (``toolkit.config.preference``), GRPO's
    (``toolkit.config.grpo``), the pipeline's (``toolkit.config.pipeline``), Muon's (``toolkit.config.muon``) and
    sequence parallelism's (``toolkit.config.sequence``)."""


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
        if self.train.optim == "muon" and self.model.use_peft:  # Muon on LoRA's factors: untested here
            raise ConfigError("optim", "muon trains every weight (Muon on the hidden matrices, AdamW on the rest); "
                                       "with use_peft use optim adamw_torch")
        # A torch elastic restart continues its earlier attempt (toolkit.env.elastic): resume 'latest', and that
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


# ------------------------------------------------------------------------------------------------------ parsing
# toolkit.config.parsing parses any argument classes; these bind it to this module's (the names recipes import).
def field_names() -> list[str]:
    return config_parsing.field_names(ARGUMENT_CLASSES)


def parse_args(argv: list[str] | None = None, task: str | None = None,
               description: str | None = None) -> RunConfig:
    """Parse ``--config file.yaml`` plus overrides into a checked RunConfig (``toolkit.config.parsing.parse_args``):
    raises ConfigError; a recipe's ``task`` and docstring make its ``--help`` and refuse other tasks' fields."""
    return config_parsing.parse_args(ARGUMENT_CLASSES, RunConfig, argv, task, description)


def config_from_dict(values: dict) -> RunConfig:
    """A RunConfig from a plain dict (notebooks, scripts), type-checked and validated exactly like a YAML file."""
    return config_parsing.config_from_dict(ARGUMENT_CLASSES, RunConfig, values)


write_config = config_parsing.write_config

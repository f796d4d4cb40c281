"""The configuration: every field a recipe takes, checked before torch, accelerate or a model is touched.

  help            a recipe's --help (its fields grouped), which recipe takes a field, a field the task ignores refused
  checks          the small checks the argument classes share (_positive, _one_of, ...), a field's task tuples
  mixture         dataset_mixture's check (alignment-handbook's shape), the local files a mixture id names
  quantization    quantization's fields (load_in_4bit, ...) and checks, a part of ModelArguments
  grpo            GRPO's fields (sampling, clipping, rewards) and checks, a part of TrainingArguments
  preference      beta and loss_type (DPO and GRPO), DPO's precompute_ref_log_probs, a part of TrainingArguments
  pipeline        pipeline parallelism's fields and checks, a part of TrainingArguments
  muon            optim muon's fields (torch.optim.Muon's arguments) and checks, a part of TrainingArguments
  sequence        sequence parallelism's fields and checks (Ulysses; the ring refused), a part of TrainingArguments
  classification  label_column_name and class_weights, a part of DataArguments
  parsing         YAML + command line -> argument dataclasses through HfArgumentParser; one error per mistake
  arguments       the argument dataclasses (every field, each class naming its parts), RunConfig's checks of the whole
May import: errors, layout, env.elastic, env.upstream (inside the parser's builder), the standard library and yaml.
User code imports from here: ``from toolkit.config import RunConfig, parse_args, config_from_dict``.
"""

from toolkit.config.arguments import (
    ARGUMENT_CLASSES,
    DATA_EXTENSIONS,
    GRPO_LOSS_TYPES,
    LOSS_TYPES,
    TRACKERS,
    DataArguments,
    ModelArguments,
    RunConfig,
    TrainingArguments,
    config_from_dict,
    field_names,
    max_positions,
    mixture_files,
    parse_args,
    write_config,
)
from toolkit.errors import ConfigError

__all__ = ["ARGUMENT_CLASSES", "DATA_EXTENSIONS", "GRPO_LOSS_TYPES", "LOSS_TYPES", "TRACKERS", "ConfigError",
           "DataArguments", "ModelArguments", "RunConfig", "TrainingArguments", "config_from_dict", "field_names",
           "max_positions", "mixture_files", "parse_args", "write_config"]

"""Test 6 (bad config): each error names the field, exits non-zero, and comes before any model is loaded."""

import importlib
import math
import os
import re
import sys

import pytest
import yaml
from helpers import RECIPE

from toolkit.config import ConfigError, parse_args, write_config
from toolkit.config.help import TASK_RECIPES


def _yaml(tmp_path, **values):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.fixture
def base(tiny_model, padded_data, tmp_path):
    return {"model_name_or_path": tiny_model, "train_file": padded_data["train_file"],
            "output_dir": str(tmp_path / "out"), "block_size": 32}


def test_yaml_plus_cli_override(base, tmp_path):
    cfg = parse_args(["--config", _yaml(tmp_path, **base, learning_rate=1e-3), "--learning_rate", "1e-4",
                      "--packing", "false"])
    assert cfg.train.learning_rate == 1e-4
    assert cfg.data.packing is False
    assert cfg.model.model_name_or_path == base["model_name_or_path"]


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ({"learning_rat": 1e-3}, "learning_rat", "Did you mean 'learning_rate'"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size", "positive"),
        ({"learning_rate": "fast"}, "learning_rate", "invalid float"),
        ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps", "invalid int"),
        ({"train_file": "/nonexistent/train.jsonl"}, "train_file", "not found"),
        ({"block_size": 4096}, "block_size", "exceeds the model's 64 positions"),
        ({"optim": "adamw"}, "optim", "choose one of"),
        ({"lr_scheduler_type": "cosin"}, "lr_scheduler_type", "Did you mean 'cosine'"),
        ({"max_grad_norm": -1}, "max_grad_norm", "0 turns clipping off"),
        ({"max_steps": 0}, "max_steps", "positive"),
        # NaN passes every comparison (nan < 0 is False): each was accepted, a NaN max_grad_norm made the weights NaN
        ({"learning_rate": float("nan")}, "learning_rate", "must be a finite number, got nan"),
        ({"learning_rate": float("inf")}, "learning_rate", "must be a finite number, got inf"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm", "must be a finite number"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm", "must be a finite number"),
        ({"weight_decay": float("nan")}, "weight_decay", "must be a finite number"),
        ({"weight_decay": float("inf")}, "weight_decay", "must be a finite number"),
        ({"adam_beta1": 1.0}, "adam_beta1", "must be in [0, 1)"),
        ({"adam_beta2": 1.5}, "adam_beta2", "must be in [0, 1)"),
        ({"adam_beta2": float("nan")}, "adam_beta2", "must be in [0, 1)"),
        ({"max_consecutive_overflows": 0}, "max_consecutive_overflows", "positive"),
        ({"resume_from_checkpoint": "latest"}, "resume_from_checkpoint", "no checkpoint"),
        ({"packing_strategy": "ffd"}, "packing_strategy", "'ffd' is not one of wrapped, bfd"),
        ({"packing": False, "packing_strategy": "bfd"}, "packing_strategy", "applies only with packing: true"),
    ],
)
def test_bad_yaml_values(base, tmp_path, extra, field, words):
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", _yaml(tmp_path, **{**base, **extra})])
    assert err.value.field_name == field
    assert words in str(err.value)


def test_bad_cli_values(base, tmp_path):
    path = _yaml(tmp_path, **base)
    with pytest.raises(ConfigError, match="per_device_train_batch_sise.*Did you mean 'per_device_train_batch_size'"):
        parse_args(["--config", path, "--per_device_train_batch_sise", "4"])
    with pytest.raises(ConfigError, match="seed.*invalid int"):
        parse_args(["--config", path, "--seed", "x"])


def test_finished_output_dir_is_refused(base, tmp_path):
    final = tmp_path / "out" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="overwrite_output_dir"):
        parse_args(["--config", _yaml(tmp_path, **base)])
    parse_args(["--config", _yaml(tmp_path, **base, overwrite_output_dir=True)])


def test_earlier_checkpoints_are_not_overwritten(base, tmp_path):
    (tmp_path / "out" / "checkpoints" / "step-3").mkdir(parents=True)
    with pytest.raises(ConfigError, match="resume_from_checkpoint: latest"):
        parse_args(["--config", _yaml(tmp_path, **base)])
    cfg = parse_args(["--config", _yaml(tmp_path, **base, resume_from_checkpoint="latest")])
    assert cfg.train.resume_from_checkpoint == "latest"


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(os.path.dirname(RECIPE), "configs"))))
def test_shipped_recipe_configs_parse_and_say_how_to_launch(name, tmp_path):
    path = os.path.join(os.path.dirname(RECIPE), "configs", name)
    header = open(path).read().split("\n\n")[0]
    assert header.startswith("#") and "accelerate launch --config_file accelerate_configs/" in header
    recipe = re.search(r"recipes/(\w+\.py)", header).group(1)  # parsed as its recipe parses it: its task's fields
    task = {script: task for task, script in TASK_RECIPES.items()}[recipe]
    cfg = parse_args(["--config", path, "--output_dir", str(tmp_path / "out")], task=task)
    assert cfg.train.output_dir == str(tmp_path / "out")


RECIPE_HELP = {  # recipe: (fields its help lists, fields of other recipes it does not)
    "gpt2": (["text_column_name", "packing_strategy"], ["beta", "label_column_name", "class_weights", "chat_template"]),
    "sft": (["chat_template", "text_column_name"], ["beta", "loss_type", "label_column_name"]),
    "dpo": (["beta", "loss_type", "precompute_ref_log_probs", "ref_model_name_or_path", "chat_template"],
            ["text_column_name", "label_column_name", "class_weights"]),
    # a field the task ignores is not listed either (before: the classifier listed dataset_format, which it ignores,
    # and dataset_mixture and loss_chunk_size, which it refuses; GRPO's help was 308 lines of them)
    "classify": (["label_column_name", "class_weights", "block_size", "eval_steps"],
                 ["beta", "chat_template", "ref_model_name_or_path", "dataset_format", "dataset_mixture",
                  "loss_chunk_size"]),
    "grpo": (["beta", "loss_type", "num_generations", "reward_funcs", "chat_template", "max_train_samples",
              "loss_chunk_size"],  # issue 50: GRPO's log-probs and entropy metric without the logits
             ["text_column_name", "precompute_ref_log_probs", "label_column_name", "dataset_mixture", "eval_steps",
              "eval_on_start", "validation_file", "validation_split_percentage", "max_eval_samples",
              "per_device_eval_batch_size", "block_size", "preprocessing_num_workers", "overwrite_cache",
              "dataset_format", "packing"]),
}


@pytest.mark.parametrize("recipe", sorted(RECIPE_HELP))
def test_a_recipes_help_says_what_it_does_lists_config_first_and_only_its_own_fields(recipe, monkeypatch, capsys):
    """``python recipes/X.py --help``: the recipe's description, --config first, its fields grouped model / data /
    training, no field of another recipe, each field once (no --no_plot beside --plot)."""
    module = importlib.import_module(f"recipes.{recipe}")
    monkeypatch.setattr(sys, "argv", [f"recipes/{recipe}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert " ".join(text.split()).startswith(f"usage: {recipe}.py [--config FILE.yaml]")
    assert " ".join(module.__doc__.split("\n\n")[0].split()) in " ".join(text.split())  # first paragraph
    assert text.index("--config FILE.yaml ") < text.index("\nmodel:\n") < text.index("\ndata:\n") < text.index(
        "\ntraining:\n")
    assert text.index("\nmodel:\n") < text.index("--model_name_or_path") < text.index("\ndata:\n")
    listed = set(re.findall(r"^\s+--(\w+)", text, re.MULTILINE))
    own, others = RECIPE_HELP[recipe]
    assert set(own) <= listed and not set(others) & listed, (own, others, listed)
    assert "no_plot" not in listed and "plot" in listed and "learning_rate" in listed


@pytest.mark.parametrize("task, field, value, recipe", [
    ("causal-lm", "beta", "0.2", "recipes/dpo.py"),
    ("chat-sft", "label_column_name", "topic", "recipes/classify.py"),
    ("sequence-classification", "chat_template", "{{ messages }}", "recipes/sft.py, recipes/dpo.py"),
    ("dpo", "text_column_name", "body", "recipes/gpt2.py, recipes/sft.py, recipes/classify.py"),
    # every task's field that one task ignores (before: accepted, unused)
    ("grpo", "validation_split_percentage", "10", "recipes/gpt2.py, recipes/sft.py, recipes/dpo.py, recipes/classify.py"),
    ("grpo", "block_size", "32", "recipes/gpt2.py, recipes/sft.py, recipes/dpo.py, recipes/classify.py"),
    ("grpo", "max_eval_samples", "4", "recipes/gpt2.py, recipes/sft.py, recipes/dpo.py, recipes/classify.py"),
    ("grpo", "overwrite_cache", "true", "recipes/gpt2.py, recipes/sft.py, recipes/dpo.py, recipes/classify.py"),
    ("sequence-classification", "dataset_format", "text", "recipes/gpt2.py, recipes/sft.py, recipes/dpo.py"),
])
def test_a_field_of_another_recipe_is_refused_naming_the_recipe_that_takes_it(base, tmp_path, task, field, value,
                                                                              recipe):
    path = _yaml(tmp_path, **{k: v for k, v in base.items() if k != "block_size" or task != "grpo"})  # GRPO has none
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", path, f"--{field}", value], task=task)
    assert err.value.field_name == field and f"is a field of {recipe}" in str(err.value)
    assert parse_args(["--config", path, f"--{field}", value]).as_dict()[field]  # no task (a script): taken


def test_a_runs_own_config_yaml_parses_again_under_its_recipe(base, tmp_path):
    """config.yaml holds every field, the other recipes' at their defaults: those are not refused."""
    written = tmp_path / "config.yaml"
    write_config(parse_args(["--config", _yaml(tmp_path, **base)], task="causal-lm"), str(written))
    assert "beta" in yaml.safe_load(written.read_text())
    cfg = parse_args(["--config", str(written)], task="causal-lm")
    assert cfg.train.beta is None and cfg.data.label_column_name is None  # unset: the task gives its default


def test_skip_nonfinite_steps_under_deepspeed_is_refused_before_the_accelerator(monkeypatch, tmp_path):
    """DeepSpeed's engine applies a step before the loop can read its norm: the field cannot be honoured there. Refused
    in make_accelerator, from the launch's environment, before accelerate or a model is touched (the battery runs it
    through the recipe)."""
    from toolkit.config import TrainingArguments
    from toolkit.parallel.accelerator import make_accelerator

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), skip_nonfinite_steps=True)
    with pytest.raises(ConfigError, match="skip_nonfinite_steps: cannot be honoured under DeepSpeed") as err:
        make_accelerator(args)
    assert err.value.field_name == "skip_nonfinite_steps"


@pytest.mark.parametrize("env, launch", [({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
                                          "deepspeed-zero3"),
                                         ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp1")])
def test_async_save_outside_ddp_and_fsdp2_is_refused_before_the_accelerator(monkeypatch, tmp_path, env, launch):
    """async_save stages through DCP's get_state_dict, proven under DDP and FSDP2 only (tests/launch/
    test_reliability.py): DeepSpeed (its engine writes its own files) and FSDP1 are refused with one line, from the
    launch's environment, before accelerate or a model is touched."""
    from toolkit.config import TrainingArguments
    from toolkit.parallel.accelerator import make_accelerator

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), async_save=True)
    with pytest.raises(ConfigError, match=f"async_save: runs under DDP and FSDP2 only, not {launch}; set async_save: "
                                          "false, or launch with ddp.yaml or fsdp.yaml") as err:
        make_accelerator(args)
    assert err.value.field_name == "async_save"
    from toolkit.parallel.accelerator import check_launch

    check_launch(TrainingArguments(output_dir=str(tmp_path / "out")))


def _checkpoint(folder, step: int) -> str:
    """A checkpoint folder as RunConfig sees it (its toolkit_state.json)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "toolkit_state.json"), "w") as f:
        f.write('{"loop": {"step": %d}}' % step)
    return str(folder)


def test_a_checkpoint_of_another_output_dir_never_resumes_over_another_run(base, tmp_path):
    """issue 25, 4b: resumed into a folder that holds another (finished) run, the run would replace its final/,
    append to its metrics.jsonl and rotate its checkpoints away. Refused before anything loads, unless the checkpoint
    is output_dir's own, the folder is new, or overwrite_output_dir moves the earlier run aside."""
    other = _checkpoint(tmp_path / "other" / "checkpoints" / "step-2", 2)
    final = tmp_path / "out" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    trusted = {"resume_from_checkpoint": other, "trust_checkpoint": True}  # another run's (point 4e)
    with pytest.raises(ConfigError, match="resume_from_checkpoint: .* not a checkpoint of output_dir .* finished run"):
        parse_args(["--config", _yaml(tmp_path, **base, **trusted)])
    parse_args(["--config", _yaml(tmp_path, **base, **trusted, overwrite_output_dir=True)])
    own = _checkpoint(tmp_path / "out" / "checkpoints" / "step-1", 1)
    parse_args(["--config", _yaml(tmp_path, **base, resume_from_checkpoint=own)])  # its own checkpoint: continues
    parse_args(["--config", _yaml(tmp_path, **{**base, "output_dir": str(tmp_path / "new")},
                                  **trusted)])  # a new folder: nothing to overwrite


def test_a_checkpoint_this_run_did_not_write_is_code_and_resumes_only_when_trusted(base, tmp_path):
    """issue 25, 4e: resuming unpickles DeepSpeed's files and DCP's metadata. A checkpoint outside output_dir
    (another run's, a download) resumes only with trust_checkpoint: true; a folder without toolkit_state.json (not
    this toolkit's: nothing to continue from) never does. Before the fix both were accepted or refused silently as
    to what loading them runs."""
    other = _checkpoint(tmp_path / "downloaded" / "step-5", 5)
    new = {**base, "output_dir": str(tmp_path / "new")}
    with pytest.raises(ConfigError, match="resume_from_checkpoint: .* checkpoint folder is code.*trust_checkpoint: true"):
        parse_args(["--config", _yaml(tmp_path, **new, resume_from_checkpoint=other)])
    assert parse_args(["--config", _yaml(tmp_path, **new, resume_from_checkpoint=other,
                                         trust_checkpoint=True)]).train.trust_checkpoint
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "pytorch_model.bin").write_text("pickled")
    with pytest.raises(ConfigError, match="not a checkpoint of this toolkit .* would unpickle"):
        parse_args(["--config", _yaml(tmp_path, **new, resume_from_checkpoint=str(foreign), trust_checkpoint=True)])


def test_a_tracker_that_is_not_installed_is_refused_before_work(monkeypatch, tmp_path):
    """accelerate drops a tracker whose package is missing with a debug line and trains on without it: the user
    named it, so it is refused; tensorboard (a dependency), none and all (whatever is installed) keep working."""
    import importlib.util

    from toolkit.config import TrainingArguments

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = str(tmp_path / "out")
    with pytest.raises(ConfigError, match="report_to: 'wandb' is not installed") as err:
        TrainingArguments(output_dir=out, report_to="wandb")
    assert err.value.field_name == "report_to"
    with pytest.raises(ConfigError, match="report_to: unknown tracker 'wandbb'.*Did you mean 'wandb'"):
        TrainingArguments(output_dir=out, report_to="wandbb")
    for fine in ("tensorboard", "none", "all", ""):
        TrainingArguments(output_dir=out, report_to=fine)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else real(name, *a))
    TrainingArguments(output_dir=out, report_to="wandb")  # installed: accepted


@pytest.mark.parametrize("unset", [["--dataset_name", "null"], ["--dataset_name", "none"], ["--dataset_name", "None"],
                                   ["--dataset_name", ""], ["--dataset_name=null"],
                                   ["--dataset_name", "x", "--dataset_name", "null"]])
def test_the_command_line_unsets_an_optional_yaml_field(base, tmp_path, unset):
    """Switching a shipped config from a Hub/built-in dataset to one's own file: `--dataset_name null` unsets the
    YAML's value (every spelling of null kept it, and the run refused dataset_name and train_file together)."""
    path = _yaml(tmp_path, **{k: v for k, v in base.items() if k != "train_file"}, dataset_name="pydoc",
                 tokenizer_name=base["model_name_or_path"], max_train_samples=10)
    cfg = parse_args(["--config", path, *unset, "--train_file", base["train_file"], "--max_train_samples", "none",
                      "--packing", "null"])
    assert cfg.data.dataset_name is None and cfg.data.train_file == base["train_file"]
    assert cfg.data.max_train_samples is None and cfg.data.packing is None
    assert cfg.model.tokenizer_name == base["model_name_or_path"]  # only the named fields are unset
    again = parse_args(["--config", path, "--dataset_name", "null", "--dataset_name", "pydoc"])  # the last wins
    assert again.data.dataset_name == "pydoc"
    with pytest.raises(ConfigError, match="seed: invalid int value: 'null'"):  # a field that cannot be unset
        parse_args(["--config", path, "--dataset_name", "null", "--train_file", base["train_file"], "--seed", "null"])


def test_every_unknown_field_is_reported_at_once(base, tmp_path):
    path = _yaml(tmp_path, **base, learning_rat=1e-3, warmup_step=2)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", path, "--per_device_batch_size", "4", "--frobnicate", "1"])
    message = str(err.value)
    assert err.value.field_name == "learning_rat, warmup_step, per_device_batch_size, frobnicate"
    assert "4 unknown fields" in message
    for words in ("'learning_rat' (in", "did you mean 'learning_rate'", "did you mean 'warmup_steps'",
                  "'--per_device_batch_size' (command line: did you mean 'per_device_train_batch_size'?)",
                  "'--frobnicate' (command line)"):
        assert words in message, (words, message)


@pytest.mark.parametrize("typo, meant", [("per_device_batch_size", "per_device_train_batch_size"),
                                         ("per_device_eval_batch_sise", "per_device_eval_batch_size"),
                                         ("per_device_train_batch", "per_device_train_batch_size"),
                                         ("eval_step", "eval_steps")])
def test_a_typo_is_matched_to_the_train_side_name_unless_it_says_eval(base, tmp_path, typo, meant):
    with pytest.raises(ConfigError, match=f"Did you mean '{meant}'") as err:
        parse_args(["--config", _yaml(tmp_path, **base), f"--{typo}", "4"])
    assert err.value.field_name == typo


@pytest.mark.parametrize("sizes, world, field, words", [
    ({"DP_REPLICATE": "2", "DP_SHARD": "2"}, 2, "parallelism_config_dp_replicate_size",
     "need 4 processes, but 2 were launched: pass --parallelism_config_dp_replicate_size 1 to accelerate launch, or "
     "--num_processes 4"),
    ({"DP_REPLICATE": "2", "DP_SHARD": "2"}, 3, "num_processes", "pass --num_processes 4"),
    ({"TP": "2"}, 4, "num_processes", "pass --num_processes 2"),
])
def test_parallel_sizes_that_do_not_fill_the_launched_world_are_refused_before_the_accelerator(
        monkeypatch, tmp_path, sizes, world, field, words):
    """hsdp.yaml (dp_replicate 2 x dp_shard 2) launched with --num_processes 2 failed inside the Accelerator with
    torch's raw 'Mesh should not be bigger than default world size 2, but found 4 ranks!'; refused in
    make_accelerator from the launch's environment, before accelerate is touched, naming the option to pass."""
    from toolkit.config import TrainingArguments
    from toolkit.parallel import accelerator as distributed

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name in ("DP_REPLICATE", "DP_SHARD", "TP", "CP"):
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name}_SIZE", sizes.get(name, "1"))
    monkeypatch.setenv("WORLD_SIZE", str(world))

    def no_accelerator(*a, **k):
        raise AssertionError("the Accelerator was built before the check")

    monkeypatch.setattr(distributed, "Accelerator", no_accelerator)
    with pytest.raises(ConfigError) as err:
        distributed.make_accelerator(TrainingArguments(output_dir=str(tmp_path / "out")))
    assert err.value.field_name == field and words in str(err.value), str(err.value)
    monkeypatch.setenv("WORLD_SIZE", str(math.prod(int(v) for v in sizes.values())))
    distributed._check_parallel_sizes()  # the launched world it needs: accepted
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "1")
    distributed._check_parallel_sizes()  # a product of 1: accelerate's data parallel over every rank


def test_attn_implementation_picks_the_models_attention_kernel_and_is_checked_before_work(base, tmp_path):
    """GPUs want flash attention: the field reaches the model (transformers' attn_implementation); a name
    transformers does not know, or flash_attention_2 without flash-attn installed, is one line at parse time."""

    from toolkit.models.loading import load_model

    path = _yaml(tmp_path, **base)
    chosen = {impl: load_model(parse_args(["--config", path, *flag]).model).config._attn_implementation
              for impl, flag in [("default", []), ("eager", ["--attn_implementation", "eager"])]}
    assert chosen == {"default": "sdpa", "eager": "eager"}
    with pytest.raises(ConfigError, match="attn_implementation: unknown value 'flash'; choose one of eager, sdpa"):
        parse_args(["--config", path, "--attn_implementation", "flash"])
    # whether this machine runs flash_attention_2: toolkit.models.loading.check_attn_implementation (tests/unit/test_packing.py)


def test_an_unquoted_glob_expanded_by_the_shell_is_a_list_of_files(tmp_path):
    """`--train_file data/part-*.jsonl` typed without quotes reaches the recipe as the shell's expansion: every path
    after the flag is one of its files (it stopped with "unknown argument '.../part-01.jsonl'")."""
    parts = []
    for i in range(3):
        parts.append(str(tmp_path / f"part-{i:02d}.jsonl"))
        open(parts[-1], "w").write('{"text": "a b c"}\n')
    base = ["--model_name_or_path", "gpt2", "--output_dir", str(tmp_path / "out")]
    cfg = parse_args([*base, "--train_file", *parts, "--validation_file", *parts[:2], "--streaming", "true",
                      "--max_steps", "2"])
    assert cfg.data.data_files("train_file") == parts and cfg.data.data_files("validation_file") == parts[:2]
    cfg = parse_args([*base, f"--train_file={parts[0]}", *parts[1:]])  # the = form too
    assert cfg.data.data_files("train_file") == parts
    with pytest.raises(ConfigError, match="train_file"):  # a flag with no value still names the field
        parse_args([*base, "--train_file", "--seed", "1"])


@pytest.mark.parametrize("value", ["yes", "0", "t", "on"])
def test_a_boolean_takes_true_or_false_and_nothing_else(base, tmp_path, value):
    """transformers' string_to_bool took yes/no, t/f, y/n and 1/0: ``--use_peft yes`` trained LoRA. Two words, in
    any case; a flag alone is true; a YAML file's booleans are YAML's (``use_peft: yes`` is YAML 1.1's true), its
    strings are checked as the command line's."""
    path = _yaml(tmp_path, **base)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", path, "--use_peft", value])
    assert (err.value.field_name, err.value.message) == ("use_peft", f"takes true or false, got {value!r}")
    assert parse_args(["--config", path, "--packing", "False"]).data.packing is False
    assert parse_args(["--config", path, "--packing", "TRUE", "--shuffle"]).train.shuffle is True
    (tmp_path / "yes").mkdir()
    with pytest.raises(ConfigError, match="packing: takes true or false, got 'yes'"):
        parse_args(["--config", _yaml(tmp_path / "yes", **base, packing="yes")])


def test_async_save_with_muon_is_refused_before_the_accelerator(tmp_path):
    """Each is proven alone; DCP's get_state_dict of muon's two-optimizer wrapper is not tested with the asynchronous
    writer: one line naming async_save, from check_launch (what a rank and toolkit train run before any work)."""
    from toolkit.config import TrainingArguments
    from toolkit.parallel.accelerator import check_launch

    with pytest.raises(ConfigError, match="^async_save: with optim muon is not proven yet") as err:
        check_launch(TrainingArguments(output_dir=str(tmp_path / "out"), async_save=True, optim="muon"))
    assert err.value.field_name == "async_save"
    check_launch(TrainingArguments(output_dir=str(tmp_path / "out"), optim="muon"))
    check_launch(TrainingArguments(output_dir=str(tmp_path / "out"), async_save=True))

"""Test 6 (bad config): each error names the field, exits non-zero, and comes before any model is loaded."""

import os

import pytest
import yaml
from helpers import RECIPE

from toolkit.config import ConfigError, parse_args


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
    cfg = parse_args(["--config", path, "--output_dir", str(tmp_path / "out")])
    assert cfg.train.output_dir == str(tmp_path / "out")


def test_skip_nonfinite_steps_under_deepspeed_is_refused_before_the_accelerator(monkeypatch, tmp_path):
    """DeepSpeed's engine applies a step before the loop can read its norm: the field cannot be honoured there. Refused
    in make_accelerator, from the launch's environment, before accelerate or a model is touched (the battery runs it
    through the recipe)."""
    from toolkit.config import TrainingArguments
    from toolkit.distributed import make_accelerator

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), skip_nonfinite_steps=True)
    with pytest.raises(ConfigError, match="skip_nonfinite_steps: cannot be honoured under DeepSpeed") as err:
        make_accelerator(args)
    assert err.value.field_name == "skip_nonfinite_steps"


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

"""``toolkit train TASK`` (toolkit.launch) before it launches: a mistake in a field, a file, the data or the
strategy x model x world size is one line and exit code 2 from the launching process itself (no launcher, no
traceback); ``--model``/``--dataset`` become the recipe's fields; ``--help`` is the task's own; the shipped launch
configs are found by name. The launched run itself: tests/launch/test_train_command.py."""

from __future__ import annotations

import os

import pytest

from toolkit import launch
from toolkit.errors import ConfigError


def _refused(capsys, argv) -> str:
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_mistakes_are_one_line_and_exit_2_before_any_launch(capsys, tmp_path, tiny_model, tiny_llama, padded_data,
                                                            chats):
    base = ["--model", tiny_model, "--dataset", padded_data["train_file"], "--output_dir", str(tmp_path / "out")]
    assert _refused(capsys, ["lm", *base, "--learning_rat", "1"]).startswith(
        "config error: learning_rat: unknown argument '--learning_rat'. Did you mean 'learning_rate'?")
    assert _refused(capsys, ["lm", *base[:2], "--dataset", str(tmp_path / "none.jsonl"), *base[4:]]) == (
        f"config error: train_file: file not found: {tmp_path / 'none.jsonl'}")
    assert _refused(capsys, ["lm", *base, "--beta", "0.3"]).startswith(
        "config error: beta: is a field of recipes/dpo.py")
    # the strategy against the model (tiny GPT-2 has no TP plan) and against the processes (tp.yaml's 2)
    assert "a gpt2 model has no tensor-parallel plan" in _refused(capsys, ["lm", *base, "--strategy", "tp"])
    llama = ["lm", "--model", tiny_llama, *base[2:], "--strategy", "tp", "--num_processes", "3"]
    assert _refused(capsys, llama).startswith("config error: num_processes: the launch config's parallelism sizes")
    # the launch config's world against the processes: hsdp.yaml's 2 x 2 mesh on 2 processes
    assert _refused(capsys, ["lm", *base, "--strategy", "hsdp", "--num_processes", "2"]).startswith(
        "config error: parallelism_config_dp_replicate_size:")
    assert "skip_nonfinite_steps" in _refused(capsys, ["lm", *base, "--strategy", "zero2",
                                                       "--skip_nonfinite_steps", "true"])
    # the data against the task: text rows for chat SFT; a chat template for a tokenizer without one
    sft = ["sft", *base, "--chat_template", chats["chat_template"]]
    assert _refused(capsys, sft).startswith("config error: dataset_format:")
    assert _refused(capsys, ["sft", *base[:2], "--dataset", chats["train_file"], *base[4:]]).startswith(
        "config error: chat_template: the tokenizer")
    assert _refused(capsys, ["lm", *base, "--strategy", "zero4"]).startswith(
        "config error: strategy: 'zero4' is neither a shipped launch config (ddp, zero2")


def test_a_lora_runs_final_as_the_model_passes_or_is_refused_in_one_line(capsys, tmp_path, tiny_model, padded_data):
    """A LoRA run's final/ (an adapter, no full weights) as ``--model``: it passes the check before the launch (the
    ranks load it as its base with the adapter merged in: tests/unit/test_checkpoint_files.py), unless the launch
    would load the base quantized, split or partitioned as it reads it: then one line naming final/merged and
    merge_lora. Before, every such launch passed the check and died in the ranks ("no file named model.safetensors")."""
    import yaml
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.config import ModelArguments
    from toolkit.lora import save_adapter
    from toolkit.model import check_adapter_model

    adapter = str(tmp_path / "sft-lora" / "final")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                                LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    save_adapter(peft_model, peft_model.state_dict(), adapter)  # what a LoRA run's export writes
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(adapter)
    base = ["--model", adapter, "--dataset", padded_data["train_file"], "--output_dir", str(tmp_path / "out")]
    launch.check("causal-lm", launch.strategy_config("ddp"), 2, launch.recipe_argv(*launch.parser().parse_known_args(
        base)))
    assert check_adapter_model(ModelArguments(model_name_or_path=adapter)) == (
        f"model_name_or_path {adapter} is a LoRA adapter: loaded as its base {tiny_model} with the adapter merged in, "
        "the model that run trained")
    zero3 = yaml.safe_load(open(launch.strategy_config("zero3")))
    zero3["deepspeed_config"]["zero3_init_flag"] = True
    (tmp_path / "zero3_init.yaml").write_text(yaml.safe_dump(zero3))
    capsys.readouterr()  # the loading above
    for extra, why in ((["--use_peft", "true", "--load_in_4bit", "true"], "a quantized base (load_in_4bit / "
                        "load_in_8bit) is quantized as it loads"),
                       (["--strategy", "tp"], "tensor parallelism splits the weights as they load"),
                       (["--strategy", str(tmp_path / "zero3_init.yaml")],
                        "zero3_init_flag: true partitions the weights as they load")):
        assert _refused(capsys, ["lm", *base, *extra]) == (
            f"config error: model_name_or_path: {adapter} is a LoRA adapter, which loads as its base with the adapter "
            f"merged in; {why}: name the merged weights instead, final/merged (a LoRA run writes it with merge_lora: "
            "true)"), extra


def test_model_and_dataset_name_the_recipes_fields(tmp_path):
    local = tmp_path / "my.jsonl"
    local.write_text("{}\n")

    def argv(*args):
        opts, rest = launch.parser().parse_known_args(list(args))
        return launch.recipe_argv(opts, rest)

    assert argv("--model", "org/m", "--dataset", str(local), "--seed", "1") == [
        "--model_name_or_path", "org/m", "--train_file", str(local), "--dataset_name", "null", "--seed", "1"]
    assert argv("--dataset", str(tmp_path / "part-*.jsonl"))[:2] == ["--train_file", str(tmp_path / "part-*.jsonl")]
    assert argv("--dataset", "wikitext", "--dataset_config_name", "wikitext-2-raw-v1") == [
        "--dataset_name", "wikitext", "--dataset_config_name", "wikitext-2-raw-v1"]
    for name in launch.STRATEGIES:
        assert os.path.isfile(launch.strategy_config(name)), name


def test_a_tasks_help_describes_it_its_data_and_only_its_fields(capsys):
    assert launch.main(["dpo", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: toolkit train dpo [--strategy S]")
    assert "Direct preference optimisation" in text and "implicit_preference" in text
    assert text.index("--strategy") < text.index("--config FILE.yaml") < text.index("--model_name_or_path")
    assert "--beta" in text and "--label_column_name" not in text
    assert launch.main(["classify", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--label_column_name" in text and "--beta" not in text
    assert launch.main(["nope"]) == 2 and "TASK: lm, sft, dpo, classify, grpo" in capsys.readouterr().err


@pytest.mark.parametrize("short", sorted(launch.TASKS))
def test_every_task_has_its_recipe_and_class(short):
    from toolkit.config_help import TASK_RECIPES

    task = launch.TASKS[short]
    assert os.path.isfile(launch.packaged("recipes", TASK_RECIPES[task]))
    module, name = launch.TASK_CLASSES[task].split(":")
    import importlib

    assert getattr(importlib.import_module(module), name).name == task


def test_a_streams_first_rows_are_read_before_launching(tmp_path, tiny_model, chats):
    """toolkit train did not read a stream before launching: columns that fit no format, or a stream with no row to
    train on, met the ranks under the launcher. Now one ConfigError in the launching process (main: one line, exit 2)
    naming the columns found."""
    import json

    def check(task, rows, *fields):
        path = tmp_path / f"{task}-{len(rows)}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        argv = ["--model_name_or_path", tiny_model, "--train_file", str(path), "--dataset_name", "null",
                "--streaming", "true", "--max_steps", "3", "--output_dir", str(tmp_path / "out"), *fields]
        with pytest.raises(ConfigError) as err:
            launch.check(launch.TASKS[task], launch.strategy_config("ddp"), 1, argv)
        return err.value

    err = check("lm", [{"body": "some words", "id": i} for i in range(3)])
    assert err.field_name == "dataset_format" and err.message.startswith(
        f"the stream (its first 3 rows, from {tmp_path / 'lm-3.jsonl'}) has the columns ['body', 'id'], which fit "
        "none of the formats this recipe takes: text (text)")
    err = check("sft", [{"question": "Hi?", "answer": "Hello."}] * 2, "--chat_template", chats["chat_template"])
    assert err.field_name == "dataset_format" and "has the columns ['answer', 'question']" in err.message
    err = check("lm", [{"text": None, "id": 1}, {"text": "", "id": 2}])
    assert (err.field_name, err.message) == ("train_file", "the stream's 2 rows (columns ['id', 'text']) have none to "
                                             "train on: rows with no text (null, empty or not a string) in column "
                                             "'text'; give rows with data")


@pytest.mark.parametrize("short", ["dpo", "classify"])
def test_a_tasks_help_leaves_out_the_fields_it_refuses(short, capsys, tmp_path):
    """classify and dpo listed streaming, shuffle_buffer_size, packing and packing_strategy, which they refuse."""
    from toolkit.config import parse_args

    assert launch.main([short, "--help"]) == 0
    text = capsys.readouterr().out
    for name in ("--streaming", "--shuffle_buffer_size", "--packing", "--packing_strategy"):
        assert name not in text.split(), name
    assert launch.main(["lm", "--help"]) == 0 and "--streaming" in capsys.readouterr().out.split()
    # the value that turns packing off is still taken; the task's own check refuses streaming, saying why
    task = launch.TASKS[short]
    base = ["--model_name_or_path", "some/model", "--dataset_name", "some/set", "--output_dir", str(tmp_path / "o")]
    assert parse_args(["--packing", "false", *base], task=task).data.packing is False
    with pytest.raises(ConfigError, match="shuffle_buffer_size: is a field of recipes/gpt2.py, recipes/sft.py"):
        parse_args(["--shuffle_buffer_size", "5", *base], task=task)

"""``toolkit train TASK`` (toolkit.cli.train) before it launches: a mistake in a field, a file, the data or the
strategy x model x world size is one line and exit code 2 from the launching process itself (no launcher, no
traceback); ``--model``/``--dataset`` become the recipe's fields; ``--help`` is the task's own; the shipped launch
configs are found by name. The launched run itself: tests/launch/test_train_command.py."""

from __future__ import annotations

import json
import os

import pytest

from toolkit.cli import train as launch
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
    from toolkit.models.loading import check_adapter_model
    from toolkit.models.lora import save_adapter

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
    assert launch.main(["nope"]) == 2 and "which takes lm, sft, dpo, classify, grpo" in capsys.readouterr().err


@pytest.mark.parametrize("short", sorted(launch.TASKS))
def test_every_task_has_its_recipe_and_class(short):
    from toolkit.config.help import TASK_RECIPES

    task = launch.TASKS[short]
    assert os.path.isfile(launch.packaged("recipes", TASK_RECIPES[task]))
    module, name = launch.TASK_CLASSES[task].split(":")
    import importlib

    assert getattr(importlib.import_module(module), name).name == task


def test_a_streams_first_rows_are_read_before_launching(tmp_path, tiny_model, chats):
    """toolkit train did not read a stream before launching: columns that fit no format, or a stream with no row to
    train on, met the ranks under the launcher. Now one ConfigError in the launching process (main: one line, exit 2)
    naming the columns found."""

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


def test_what_only_the_tokenized_data_shows_is_refused_before_launching(tmp_path, tiny_model, padded_data, chats,
                                                                        capsys):
    """toolkit train checked the data's files and columns, not what the ranks find once they tokenize it: a global
    batch larger than the training set, GRPO's conversational prompts without a chat template, a GRPO prompt plus
    max_completion_length past the model's positions. Each passed ("checked; launching"), then failed in the ranks
    (exit 1; the second rank added gloo's "connection closed"). The check now runs the ranks' own code up to their
    weights (``build.build_data``), tokenization included: chats with nothing to learn within block_size, a stream
    without one global batch (refused by the loop after the weights loaded, before) are one line too."""
    base = ["--model_name_or_path", tiny_model, "--output_dir", str(tmp_path / "out"), "--dataset_name", "null"]

    def refused(task, processes, *fields):
        with pytest.raises(ConfigError) as err:
            launch.check(task, launch.strategy_config("ddp"), processes, [*base, *fields])
        return err.value

    text = ["--train_file", padded_data["train_file"], "--block_size", "48", "--per_device_train_batch_size", "20"]
    launch.check("causal-lm", launch.strategy_config("ddp"), 1, [*base, *text])  # 1 x 20 rows fit, 2 x 20 do not (33)
    err = refused("causal-lm", 2, *text)
    assert err.field_name == "per_device_train_batch_size" and err.message.startswith("the training set has ")
    assert "fewer than one global batch (2 ranks x 20 x 1 accumulation = 40)" in err.message

    def prompts(name, prompt):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": prompt, "answer": i}) + "\n" for i in range(4)))
        return ["--train_file", str(path), "--reward_funcs", "arithmetic_correct", "--num_generations", "2",
                "--per_device_train_batch_size", "2"]

    err = refused("grpo", 1, *prompts("chats.jsonl", [{"role": "user", "content": "What is 2 + 3?"}]))
    assert err.field_name == "chat_template" and "has no chat template" in err.message
    err = refused("grpo", 1, *prompts("long.jsonl", "a long question " * 20), "--max_completion_length", "40")
    assert "40" in err.message and "more than the model's 64" in err.message

    sft = ["--train_file", chats["train_file"], "--chat_template", chats["chat_template"], "--block_size", "4"]
    err = refused("chat-sft", 1, *sft)
    assert (err.field_name, err.message) == ("block_size", "no training chat has an assistant token within block_size "
                                                           "4; raise block_size")
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5)))
    stream = ["--train_file", str(short), "--streaming", "true", "--max_steps", "3", "--per_device_train_batch_size",
              "4"]
    err = refused("causal-lm", 2, *stream)
    assert err.field_name == "train_file" and "the stream ends before its first global batch (8 rows" in err.message
    argv = ["lm", "--model", tiny_model, "--dataset", padded_data["train_file"], "--num_processes", "2", *text[2:],
            "--output_dir", str(tmp_path / "out")]
    assert _refused(capsys, argv).startswith("config error: per_device_train_batch_size: the training set has ")


def test_accelerates_launch_options_are_passed_on_and_each_bad_one_is_one_line(capsys, tmp_path, tiny_model,
                                                                               padded_data):
    """toolkit train took no launcher option: two runs on one machine collided on port 29500 (the launched run of
    tests/launch/test_train_command.py passes --main_process_port). ``--num_processes 0`` launched the default 2."""
    given = ["--main_process_port", "29600", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip",
             "10.0.0.1", "--rdzv_backend", "c10d", "--max_restarts", "0"]
    opts, rest = launch.parser().parse_known_args(["--num_processes", "4", *given, "--seed", "1"])
    launch.check_launcher(opts)
    assert rest == ["--seed", "1"] and launch.launcher_argv(opts) == [
        "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29600",
        "--rdzv_backend", "c10d", "--max_restarts", "0"]
    base = ["lm", "--model", tiny_model, "--dataset", padded_data["train_file"], "--output_dir", str(tmp_path / "o")]
    two = ["--num_machines", "2", "--main_process_ip", "10.0.0.1"]
    for options, line in [
        (["--num_processes", "0"], "num_processes: must be at least 1, got 0"),
        (["--num_processes", "two"], "num_processes: invalid int value: 'two'"),
        (["--main_process_port", "70000"], "main_process_port: must be a port in [1, 65535] (or 0: a free one), got "
                                           "70000"),
        (["--num_machines", "0"], "num_machines: must be at least 1, got 0"),
        ([*two, "--num_processes", "4", "--machine_rank", "2"], "machine_rank: must be in [0, 1] with num_machines 2, "
                                                                "got 2"),
        ([*two, "--num_processes", "3"], "num_processes: 3 processes do not split evenly over num_machines 2"),
        ([*two], "num_processes: with num_machines 2, give the total processes over every machine"),
        (["--num_machines", "2", "--num_processes", "4"], "main_process_ip: num_machines 2 needs the address"),
        (["--rdzv_backend", "etcd"], "rdzv_backend: invalid choice: 'etcd' (choose from "),  # quoted or not: Python's
        (["--max_restarts", "-1"], "max_restarts: must be 0 or more, got -1"),
        # the ranks' own check (toolkit.env.elastic), in the environment torch elastic's agent would give them
        ([*two, "--num_processes", "2", "--max_restarts", "1"], "max_restarts: elastic restarts across machines need "
                                                                "--rdzv_backend c10d"),
    ]:
        assert _refused(capsys, [*base, *options]).startswith(f"config error: {line}"), options


def test_an_unknown_task_and_a_boolean_spelled_otherwise_are_one_line_naming_them(capsys, tmp_path, tiny_model,
                                                                                  padded_data):
    """``toolkit train sfy`` printed the usage without naming what was wrong; ``--use_peft yes`` was taken as true
    (transformers' string_to_bool). A boolean takes true or false (in any case), nothing else."""
    assert _refused(capsys, ["sfy", "--model", tiny_model]) == (
        "config error: TASK: 'sfy' is not a task of toolkit train, which takes lm, sft, dpo, classify, grpo; did you "
        "mean 'sft'?")
    assert _refused(capsys, ["chat-sft"]).endswith("did you mean 'sft'?")  # a task's long name
    assert _refused(capsys, ["xyz"]).endswith("which takes lm, sft, dpo, classify, grpo")
    base = ["lm", "--model", tiny_model, "--dataset", padded_data["train_file"], "--output_dir", str(tmp_path / "o")]
    assert _refused(capsys, [*base, "--use_peft", "yes"]) == "config error: use_peft: takes true or false, got 'yes'"


def test_the_checks_tokenization_is_the_cache_the_ranks_read(tmp_path, tiny_model, padded_data, monkeypatch):
    """toolkit train now tokenizes before it launches: the ranks must read what it wrote, not tokenize again (a
    large set's tokenization is then paid once, here). The 5% held out of a file without validation_file was named
    from numpy's global state (datasets' train_test_split without a seed, docs/pitfalls.md#split-fingerprint): each
    process another name, so another process never found the tokenize cache."""
    import datasets
    import numpy as np

    from toolkit.config import parse_args
    from toolkit.tasks.lm import CausalLM
    from toolkit.training.build import build_data

    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    argv = ["--model_name_or_path", tiny_model, "--train_file", padded_data["train_file"], "--block_size", "48",
            "--output_dir", str(tmp_path / "out")]
    launch.check("causal-lm", launch.strategy_config("ddp"), 2, argv)
    written = sorted(cache.rglob("cache-*.arrow"))
    assert written
    np.random.seed(12345)  # a rank: another process, its own numpy state
    lm = build_data(parse_args(argv, task="causal-lm"), CausalLM(), lambda *a, **k: None, strategy="ddp",
                    data_parallel=2)[2]
    assert sorted(cache.rglob("cache-*.arrow")) == written  # nothing tokenized again
    assert {f["filename"] for split in lm.values() for f in split.cache_files} <= set(map(str, written))


@pytest.mark.slow  # an in-process LoRA run writes the checkpoint
def test_a_resume_the_checkpoint_refuses_is_refused_before_the_launch(capsys, tmp_path, tiny_model, padded_data):
    """A relaunch into an output_dir whose checkpoint has another LoRA rank or alpha (or another global batch): the
    ranks refused it (``plan_resume``, after the launch), ``toolkit train``'s check did not, as the resume checks took
    the Accelerator (the capability matrix's resume_new_rank cells). Now the check reads the checkpoint's record:
    one line, exit 2, nothing written, no launch."""
    from helpers import train_in_process, tree_hash

    out = tmp_path / "run"
    fields = {"model_name_or_path": tiny_model, "train_file": padded_data["train_file"], "block_size": 48,
              "per_device_train_batch_size": 4, "save_steps": 1, "report_to": "none", "plot": False,
              "save_final_model": False, "optim": "sgd", "use_peft": True, "lora_r": 4, "lora_alpha": 8,
              "lora_target_modules": "c_attn"}
    train_in_process({**fields, "max_steps": 1, "output_dir": str(out)})
    before = tree_hash(str(out))
    relaunch = {**fields, "max_steps": 2, "output_dir": str(out), "resume_from_checkpoint": "latest"}

    def argv(**changed) -> list[str]:
        return [f"--{k}={v}" for k, v in {**relaunch, **changed}.items() if k != "model_name_or_path"]

    ddp = launch.strategy_config("ddp")
    launch.check("causal-lm", ddp, 1, ["--model_name_or_path", tiny_model, *argv()])  # the same run: it resumes
    for changed, processes, field in (({"lora_r": 8}, 1, "lora_r"), ({"lora_alpha": 16}, 1, "lora_alpha"),
                                      ({"lora_target_modules": "c_proj"}, 1, "lora_target_modules"),
                                      ({}, 2, "per_device_train_batch_size")):  # 2 ranks x 4: a global batch of 8
        with pytest.raises(ConfigError) as e:
            launch.check("causal-lm", ddp, processes, ["--model_name_or_path", tiny_model, *argv(**changed)])
        assert e.value.field_name == field, str(e.value)
    capsys.readouterr()
    line = _refused(capsys, ["lm", "--model", tiny_model, "--num_processes", "1", *argv(lora_r=8)])
    assert line.startswith("config error: lora_r: cannot resume from ")
    assert "it was trained with lora_r 4, now 8" in line
    assert tree_hash(str(out)) == before, "the refused relaunch changed the run's files"

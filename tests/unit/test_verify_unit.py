"""``toolkit verify``'s own options cannot be mistaken for recipe fields (its parser, in process), and what it prints
of a failed run. verify run for real is in tests/launch/test_verify.py and tests/launch/test_launcher_errors.py."""

import pytest

from toolkit.cli.verify import _parser, own_options
from toolkit.config import field_names


def test_verify_options_never_swallow_a_recipe_field():
    """`--optim` used to be verify's own option, so a recipe's `--optim adamw_torch` ran the SGD check alone and
    still said PASS. No verify option may share a name with a recipe field; recipe fields pass through."""
    assert not own_options() & set(field_names())
    args, recipe_args = _parser().parse_known_args(["--config_file", "x.yaml", "--optim", "sgd", "--checks", "adamw",
                                                    "--learning_rate", "0.1"])
    assert args.checks == ["adamw"]
    assert _parser().parse_known_args(["--config_file", "x.yaml"])[0].checks == ["sgd", "adamw"]  # both by default
    assert recipe_args == ["--optim", "sgd", "--learning_rate", "0.1"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["--config_file", "x.yaml", "--checks", "sgd,adam"])


def test_a_failed_runs_cause_is_the_ranks_own_line_not_the_launchers(tmp_path):
    """issue 25, point 6: verify printed a failed run's last 40 lines, the launcher's ChildFailedError traceback. Now
    the recipe's own line (each once), else the last exception a rank raised, else the tail; then the log's path.
    The real failed launch: tests/launch/test_launcher_errors.py."""
    from toolkit.cli.verify import failure_cause

    launcher = ["E1205 10:06:16.444000 13961 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                "(exitcode: 1) local_rank: 0 (pid: 13982) of binary: /work/venv/bin/python",
                "Traceback (most recent call last):", '  File "/work/venv/bin/accelerate", line 8, in <module>',
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 60,
                "recipes/gpt2.py FAILED"]
    crashed = tmp_path / "crashed.log"
    crashed.write_text("\n".join(["Traceback (most recent call last):", '  File "recipes/gpt2.py", line 27',
                                  "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
                                  *launcher]) + "\n")
    assert failure_cause(str(crashed)).splitlines() == [
        "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        f"(the run's whole output: {crashed})"]
    refused = tmp_path / "refused.log"
    line = "config error: model_name_or_path: cannot load 'outputs/models/tiny-gpt2': not a local folder"
    refused.write_text("\n".join([line, line, *launcher]) + "\n")  # two machines, one line each
    assert failure_cause(str(refused)).splitlines() == [line, f"(the run's whole output: {refused})"]
    silent = tmp_path / "silent.log"
    silent.write_text("".join(f"line {i}\n" for i in range(100)))
    assert failure_cause(str(silent), lines=3).splitlines() == ["line 97", "line 98", "line 99",
                                                                f"(the run's whole output: {silent})"]


def test_a_field_of_another_recipe_stops_verify_before_any_launch(tiny_model, padded_data, tmp_path, capsys):
    """verify parses the recipe's arguments as that recipe will (its task's fields): DPO's beta given to gpt2.py
    is the recipe's own refusal, in a second, not a failed launch."""
    from helpers import ROOT

    from toolkit.cli.verify import main

    code = main(["--config_file", f"{ROOT}/accelerate_configs/ddp.yaml", "--num_processes", "2",
                 "--recipe", f"{ROOT}/recipes/gpt2.py", "--model_name_or_path", tiny_model,
                 "--train_file", padded_data["train_file"], "--block_size", "32", "--beta", "0.2",
                 "--work_dir", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err == "config error: beta: is a field of recipes/dpo.py, recipes/grpo.py; " \
                                      "recipes/gpt2.py does not use it: delete it\n"


def test_what_a_launched_rank_would_refuse_stops_verify_before_any_launch(tiny_model, padded_data, tmp_path, capsys):
    """The checks ``toolkit train`` makes before it launches (a rank's refusals, in the launch config's environment):
    a pipeline under ZeRO-3 is refused in a second, naming the field, not by the ranks of a launch."""
    from helpers import ROOT

    from toolkit.cli.verify import main

    code = main(["--config_file", f"{ROOT}/accelerate_configs/zero3.yaml", "--num_processes", "2",
                 "--model_name_or_path", tiny_model, "--train_file", padded_data["train_file"], "--block_size", "32",
                 "--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "2", "--work_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("config error: pipeline_parallel_size") and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []  # no run was started


def test_verify_gives_a_recipe_only_the_fields_its_task_takes(tiny_model, tmp_path):
    """verify's fixed fields (max_eval_samples, eval_on_start, ...) go to a recipe only where its task takes them:
    GRPO has no held-out evaluation and refuses max_eval_samples (before verify set it for every recipe, so any
    verify of recipes/grpo.py would be refused). Its arguments pass the recipe's parse and the checks a rank runs
    before its weights load."""
    from helpers import ROOT

    from toolkit.cli.train import check
    from toolkit.cli.verify import UNUSED_OUTPUT, _parser, _plan, _recipe_argv

    args, recipe_args = _parser().parse_known_args([
        "--config_file", f"{ROOT}/accelerate_configs/ddp.yaml", "--num_processes", "2", "--recipe",
        f"{ROOT}/recipes/grpo.py", "--model_name_or_path", tiny_model, "--dataset_name", "arithmetic",
        "--chat_template", "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "--num_generations", "4",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_completion_length", "4",
        "--work_dir", str(tmp_path)])
    plan = _plan(args, recipe_args)
    argv = _recipe_argv(args, recipe_args, "sgd")
    assert "--max_eval_samples" not in argv and "--max_steps" in argv and plan["global"] == 8
    check("grpo", args.config_file, plan["world"], [*argv, "--output_dir", UNUSED_OUTPUT], mixed_precision="no")


@pytest.mark.parametrize("field", ["sequence_parallel_size", "context_parallel_size"])
def test_verify_under_sequence_parallelism_compares_with_the_data_parallel_global_batch(tiny_llama, padded_data,
                                                                                        field):
    """A sequence-parallel group's ranks take the same rows: 4 processes with sequence_parallel_size (or the ring's
    context_parallel_size) 2 are 2 data-parallel ranks, so the one-process reference takes 2 x micro x accumulation
    rows, with no split of its own (one process cannot split a sequence: a split of 2 there is refused)."""
    from types import SimpleNamespace

    from helpers import ROOT

    from toolkit.cli.verify import _plan, reference_argv

    args = SimpleNamespace(config_file=f"{ROOT}/accelerate_configs/ddp.yaml", recipe=f"{ROOT}/recipes/gpt2.py",
                           steps=2, num_processes=4)
    plan = _plan(args, ["--model_name_or_path", tiny_llama, "--train_file", padded_data["train_file"],
                        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                        f"--{field}", "2"])
    assert (plan["world"], plan["dp"], plan["global"]) == (4, 2, 8)
    assert reference_argv(plan) == ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                                    "--pipeline_parallel_size", "1", "--sequence_parallel_size", "1",
                                    "--context_parallel_size", "1"]

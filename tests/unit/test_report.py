"""toolkit.reporting.report: summaries and plots from metrics.jsonl, one run or several side by side.

Synthetic metrics files check the arithmetic; the quickstart notebook's two real runs (1 process with accumulation,
2 gloo ranks) check it on what the loop actually writes, including the command line (tests/launch/test_report_launch.py).
"""

import json
import math
import os
import sys

import pytest
import yaml

from toolkit.reporting.metrics import format_run_summary
from toolkit.reporting.report import load_run, main, summarize, table


def write_run(folder, rows, config=None, summary=None):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        with open(os.path.join(folder, "config.yaml"), "w") as f:
            yaml.safe_dump(config, f)
    if summary is not None:
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump(summary, f)
    return str(folder)


CONFIG = {"packing": True, "block_size": 16, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}


def synthetic_rows(world=2, steps=6, rate=(100.0, 300.0, 300.0), loss0=10.0):
    per_step = world * 2 * 2 * 16
    rows = [{"step": 0, "epoch": 0.0, "tokens_seen": 0, "eval_loss": loss0 + 0.5, "perplexity": math.exp(loss0 + 0.5)}]
    for i, step in enumerate(range(2, steps + 1, 2)):
        row = {"step": step, "epoch": step / 100, "tokens_seen": step * per_step, "loss": loss0 - step,
               "lr": 1e-3 * (1 - step / steps), "grad_norm": 1.0, "tokens_per_s": rate[i]}
        if step in (4, 6):
            row.update(eval_loss=loss0 - step + (3.0 if step == 6 else 0.5))  # best eval at step 4, not the last
            row["perplexity"] = math.exp(row["eval_loss"])
        rows.append(row)
    return rows


def test_summary_numbers(tmp_path):
    run = write_run(tmp_path / "ddp", synthetic_rows(), CONFIG)
    s = summarize(load_run(run))
    assert s["steps"] == 6 and s["tokens_seen"] == 6 * 128
    assert s["first_train_loss"] == 8.0 and s["final_train_loss"] == 4.0
    assert s["first_eval_loss"] == 10.5 and s["best_eval_loss"] == 6.5 and s["best_eval_step"] == 4
    assert s["best_perplexity"] == pytest.approx(math.exp(6.5))
    # equal token windows at 100, 300, 300 tokens/s: 3 windows / (1/100 + 2/300) s per token = 180, not the mean 233
    assert s["tokens_per_s"] == pytest.approx(180.0)
    assert s["world_size"] == 2 and s["world_size_source"] == "inferred from tokens/step"
    assert s["global_batch"] == 8 and s["final_model"] is None and s["strategy"] is None


def test_summary_json_wins_and_padded_runs_do_not_guess(tmp_path):
    run = write_run(tmp_path / "a", synthetic_rows(), CONFIG, summary={"world_size": 4, "distributed_type": "DEEPSPEED",
                                                                       "seconds": 12.5})
    s = summarize(load_run(run))
    assert (s["world_size"], s["strategy"], s["seconds"]) == (4, "DEEPSPEED", 12.5)
    padded = write_run(tmp_path / "b", synthetic_rows(), {**CONFIG, "packing": False})
    assert summarize(load_run(padded))["world_size"] is None  # rows have variable length: no inference
    bfd = write_run(tmp_path / "c", synthetic_rows(), {**CONFIG, "packing_strategy": "bfd"})
    assert summarize(load_run(bfd))["world_size"] is None  # whole documents per row: rows are not all full


def test_compare_table_text_and_markdown(tmp_path, capsys):
    a = write_run(tmp_path / "x" / "run", synthetic_rows(world=2), CONFIG)
    b = write_run(tmp_path / "y" / "run", synthetic_rows(world=1, loss0=9.0), CONFIG)
    out = tmp_path / "cmp.png"
    md = tmp_path / "cmp.md"
    assert main([a, b, "--out", str(out), "--markdown", str(md)]) == 0
    printed = capsys.readouterr().out
    assert "x/run" in printed and "y/run" in printed  # same folder names: parent added
    assert "2 (inferred)" in printed and "1 (inferred)" in printed
    assert "8.0000 -> 4.0000" in printed and "7.0000 -> 3.0000" in printed
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    lines = md.read_text().splitlines()
    assert lines[0] == "|  | x/run | y/run |" and lines[1] == "| --- | --- | --- |"
    assert "| optimizer steps | 6 | 6 |" in lines
    assert all(line.count("|") == 4 for line in lines[:len(table([summarize(load_run(a))]).splitlines())] if line)


def test_the_compare_plot_goes_beside_the_runs_or_where_asked(tmp_path, monkeypatch, capsys):
    """Several runs' plot lands in the folder that holds them (not the shell's current folder), or at --output."""
    a = write_run(tmp_path / "outputs" / "ddp", synthetic_rows(), CONFIG)
    b = write_run(tmp_path / "outputs" / "zero3", synthetic_rows(), CONFIG)
    elsewhere = tmp_path / "shell"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([a, b]) == 0
    assert os.path.isfile(tmp_path / "outputs" / "compare.png") and os.listdir(elsewhere) == []
    assert f"plot: {tmp_path / 'outputs' / 'compare.png'}" in capsys.readouterr().out
    assert main([a, b, "--output", str(tmp_path / "cmp.png")]) == 0
    assert os.path.isfile(tmp_path / "cmp.png")


def test_the_loss_axis_names_the_task_unit(tmp_path):
    """loss.png's axis: the unit the rows name (the task's loss_unit), never nats/token for a DPO or classifier run;
    plain "loss" where the runs name none or disagree."""
    from toolkit.reporting.plots import loss_label

    def rows(unit):
        return [{"step": 1, "tokens_seen": 8, "loss": 0.7, "loss_unit": unit}] if unit else [{"step": 1, "loss": 1.0}]

    assert loss_label({"dpo": rows("per pair")}) == "loss (per pair)"
    assert loss_label({"a": rows("nats/example"), "b": rows("nats/example")}) == "loss (nats/example)"
    assert loss_label({"lm": rows("nats/token"), "dpo": rows("per pair")}) == "loss"
    assert loss_label({"old": rows(None)}) == "loss"


def test_one_run_redraws_in_place_without_touching_pyplot(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    run = write_run(tmp_path / "r", synthetic_rows(), CONFIG)
    assert main([run, "--format", "json"]) == 0
    assert os.path.isfile(os.path.join(run, "loss.png"))
    assert matplotlib.get_backend() == backend  # a notebook's inline backend survives a training run
    if "matplotlib.pyplot" in sys.modules:
        assert sys.modules["matplotlib.pyplot"].get_fignums() == []


def test_errors_name_the_folder_and_the_fix(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    os.makedirs(tmp_path / "empty")
    assert main([str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    bad = write_run(tmp_path / "bad", synthetic_rows())
    with open(os.path.join(bad, "metrics.jsonl"), "a") as f:
        f.write('{"step": 8, "loss"\n')  # a run killed mid-write
    assert main([bad]) == 2
    assert "line 5 is not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])


def test_format_run_summary():
    text = format_run_summary({"steps": 12, "tokens_seen": 3072, "seconds": 11.7, "tokens_per_s": 262.1,
                               "best_eval_perplexity": 9644.44, "final_model": "/x/final", "world_size": 2,
                               "distributed_type": "MULTI_CPU"})
    assert "12 optimizer steps, 3,072 tokens in 11.7 s (262 tokens/s" in text
    assert "world size 2 (MULTI_CPU)" in text and "best eval perplexity: 9644.44" in text and "/x/final" in text
    staged = format_run_summary({"steps": 1, "tokens_seen": 290, "seconds": 1.0, "tokens_per_s": 290.0,
                                 "world_size": 4, "distributed_type": "FSDP", "parallelism": "pp 2 x dp 2"})
    assert "world size 4 (FSDP; pp 2 x dp 2)" in staged  # a pipeline's stages named, as a TP run's degree is


def test_dpo_reward_accuracy_and_margin_first_and_last(tmp_path):
    """A DPO run's held-out reward accuracy and margin (TRL's names in metrics.jsonl) from its first to its last
    evaluation, in the summary and the table; the end-of-run lines print the last evaluation's (summary.json)."""
    rows = [{"step": 0, "eval_loss": 0.6931, "eval_rewards/accuracies": 0.0, "eval_rewards/margins": 0.0},
            {"step": 20, "loss": 0.69, "eval_loss": 0.6826, "eval_rewards/accuracies": 0.4615,
             "eval_rewards/margins": 0.0351},
            {"step": 40, "loss": 0.68, "eval_loss": 0.6745, "eval_rewards/accuracies": 0.5385,
             "eval_rewards/margins": 0.0582}]
    dpo = summarize(load_run(write_run(tmp_path / "dpo", rows)))
    assert (dpo["first_reward_accuracy"], dpo["final_reward_accuracy"]) == (0.0, 0.5385)
    assert (dpo["first_reward_margin"], dpo["final_reward_margin"]) == (0.0, 0.0582)
    lm = summarize(load_run(write_run(tmp_path / "lm", synthetic_rows(), CONFIG)))
    assert lm["first_reward_accuracy"] is None and lm["final_reward_margin"] is None
    lines = [" ".join(line.split()) for line in table([dpo, lm]).splitlines()]
    assert "eval reward accuracy first -> last (DPO) 0.0000 -> 0.5385 ? -> ?" in lines, lines
    assert "eval reward margin first -> last (DPO) 0.0000 -> 0.0582 ? -> ?" in lines, lines
    printed = format_run_summary({"steps": 40, "tokens_seen": 100, "seconds": 1.0, "tokens_per_s": 100.0,
                                  "best_eval_loss": 0.6745, "eval_rewards/accuracies": 0.5385,
                                  "eval_rewards/margins": 0.0582})
    assert "last eval: rewards/accuracies 0.5385, rewards/margins 0.0582" in printed
    assert "best eval loss: 0.6745" in printed


def test_a_grpo_runs_mean_reward_first_and_last(tmp_path):
    """A GRPO run's mean reward (TRL's ``reward``, logged with each training row; its loss, the clipped surrogate, is
    near 0 by construction) from its first to its last logged row, in the summary and the table (before: no reward
    row); the end-of-run lines count its training rows in its row_unit and print its warnings."""
    rows = [{"step": s, "tokens_seen": 100 * s, "loss": 0.0, "reward": r, "loss_unit": "GRPO objective"}
            for s, r in ((1, 0.1875), (2, 0.25), (3, 0.9375))]
    grpo = summarize(load_run(write_run(tmp_path / "grpo", rows, summary={"row_unit": "completions"})))
    assert (grpo["first_reward"], grpo["final_reward"]) == (0.1875, 0.9375)
    lm = summarize(load_run(write_run(tmp_path / "lm", synthetic_rows(), CONFIG)))
    assert lm["first_reward"] is None
    lines = [" ".join(line.split()) for line in table([grpo, lm]).splitlines()]
    assert "mean reward first -> last (GRPO) 0.1875 -> 0.9375 ? -> ?" in lines, lines
    printed = format_run_summary({"steps": 3, "tokens_seen": 300, "seconds": 1.0, "tokens_per_s": 300.0,
                                  "train_rows": 64, "row_unit": "completions", "warnings": ["nothing learnt"]})
    assert "64 training completions" in printed and printed.endswith("\n  warning: nothing learnt")


def test_the_global_batch_is_counted_in_the_tasks_unit():
    """summary.json's row_unit (the task's: pairs for DPO) names what the report's global batch counts; a run written
    before the field existed reads as sequences."""
    from toolkit.reporting.report import _cell, summarize

    run = {"output_dir": "x", "rows": [], "config": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}}
    pairs = summarize({**run, "summary": {"world_size": 2, "row_unit": "pairs"}})
    older = summarize({**run, "summary": {"world_size": 2}})
    assert (pairs["global_batch"], pairs["row_unit"], older["row_unit"]) == (8, "pairs", "sequences")
    assert _cell(pairs, "global batch", "global_batch", "d") == "8 pairs"

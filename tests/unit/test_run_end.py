"""How a run ends, in process (``helpers.train_in_process``): whatever ends it (its steps done, a stream that runs out,
SIGTERM, a non-finite gradient, a resume of a run that had finished), the last step is logged, the bar closed,
loss.png drawn, and summary.json says how it ended and names ``final/`` only when this run wrote it."""

import json
import os
import shutil
import signal

import pytest
from safetensors.torch import load_file

from toolkit.errors import ConfigError, TrainingStopped

pytestmark = pytest.mark.slow  # in-process runs: ~2-3 s each alone, more beside other work


def _values(tiny_model, data, out, **fields) -> dict:
    return {"model_name_or_path": tiny_model, **data, "output_dir": str(out), "block_size": 32, "packing": False,
            "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "report_to": "none", "optim": "sgd",
            "learning_rate": 0.05, "logging_steps": 3, **fields}


def _on_disk(out) -> tuple[dict, list[dict]]:
    from toolkit.reporting.metrics import read_metrics

    return json.load(open(os.path.join(out, "summary.json"))), read_metrics(str(out))


def _weights(folder) -> dict:
    return load_file(os.path.join(folder, "model.safetensors"))


def test_a_stream_that_runs_out_before_max_steps_evaluates_exports_and_says_so(tiny_model, padded_data, tmp_path,
                                                                                 capsys):
    """Before the fix the loop broke before a step that never came: no final evaluation, no last log row, no final/,
    and a summary naming the final/ it had not written."""
    from helpers import train_in_process

    path = tmp_path / "short.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {i} of a short stream"}) for i in range(19)) + "\n")
    out = tmp_path / "out"
    data = {"train_file": str(path), "validation_file": padded_data["validation_file"]}
    values = _values(tiny_model, data, out, streaming=True, max_steps=50, eval_steps=100, save_steps=2)
    summary = train_in_process(values)
    printed = capsys.readouterr().out
    assert "the stream ended after step 2 of max_steps 50 (16 rows trained on): the run ends here" in printed
    on_disk, rows = _on_disk(out)
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["ended"] == "data_ran_out" and (summary["steps"], summary["total_steps"]) == (2, 50)
    # read to its end: one epoch of what it held (it said 0.04, steps / max_steps); unknown before its end
    assert summary["epochs"] == 1.0 and [row["epoch"] for row in rows] == [1.0]
    assert summary["final_model"] == str(out / "final") and os.path.isfile(out / "final" / "model.safetensors")
    assert "ended at step 2 of 50: the training data ran out" in printed
    # the last step is logged as a run's last: its loss (logging_steps 3 would skip step 2) and the final evaluation
    assert rows[-1]["step"] == 2 and "loss" in rows[-1] and "eval_loss" in rows[-1]
    assert summary["best_eval_perplexity"] == pytest.approx(rows[-1]["perplexity"])
    assert os.path.isfile(out / "loss.png")

    # relaunched after its final/ was lost: the stream ends where the checkpoint (its last step) resumes it, and the
    # run ends as one whose data ran out: its final evaluation again (the same weights: the same loss), the export.
    # Before the fix it said "nothing left to train" and evaluated nothing.
    shutil.rmtree(out / "final")
    again = train_in_process({**values, "resume_from_checkpoint": "latest"})
    printed = capsys.readouterr().out
    assert "the stream ended after step 2 of max_steps 50" in printed and "nothing left to train" not in printed
    assert again["ended"] == "data_ran_out" and again["final_model"] == str(out / "final") and again["epochs"] == 1.0
    assert os.path.isfile(out / "final" / "model.safetensors")
    after = _on_disk(out)[1]
    assert after[:-1] == rows and after[-1]["step"] == 2 and "loss" not in after[-1] and after[-1]["epoch"] == 1.0
    assert after[-1]["eval_loss"] == pytest.approx(rows[-1]["eval_loss"], abs=1e-6)
    assert again["best_eval_perplexity"] == pytest.approx(after[-1]["perplexity"])


def test_a_stream_without_one_global_batch_is_refused_before_a_step(tiny_model, tmp_path):
    from helpers import train_in_process

    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(5)) + "\n")
    with pytest.raises(ConfigError, match="stream ends before its first global batch .8 rows") as err:
        train_in_process(_values(tiny_model, {"train_file": str(path)}, tmp_path / "out", streaming=True,
                                 max_steps=5))
    assert err.value.field_name == "train_file" and not os.path.exists(tmp_path / "out" / "metrics.jsonl")


class _NanAt:
    """A non-finite gradient in the step after ``step`` (written into the model's first parameter's gradient)."""

    def __init__(self, step: int):
        self.step, self.model = step, None

    def on_prepared(self, accelerator, model, optimizer):
        self.model = model

    def on_micro_step(self, accelerator, state, micro_step):
        if state.step == self.step:
            next(self.model.parameters()).grad.fill_(float("nan"))


def test_a_stopped_run_writes_its_summary_and_plot_keeps_its_checkpoint_and_exports_nothing(tiny_model, padded_data,
                                                                                            tmp_path, capsys):
    """Before the fix a stopped run wrote no summary.json and no loss.png (the exception left train() first)."""
    from helpers import train_in_process

    out = tmp_path / "out"
    with pytest.raises(TrainingStopped, match="non-finite gradient norm .* at step 4"):
        train_in_process(_values(tiny_model, padded_data, out, max_steps=6, save_steps=3, logging_steps=2),
                         callbacks=[_NanAt(3)])
    summary, rows = _on_disk(out)
    assert summary["ended"] == "stopped" and "non-finite gradient norm" in summary["stop_reason"]
    assert summary["steps"] == 3 and summary["final_model"] is None and not os.path.exists(out / "final")
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-3"]  # the last good step's
    # the last good step is logged though logging_steps (2) would skip it, as a preempted run's last step is
    assert os.path.isfile(out / "loss.png") and [r["step"] for r in rows if "loss" in r] == [2, 3]
    # the checkpoint a relaunch continues from, named (a run stopped before any: test_grpo.py's failing reward)
    assert summary["latest_checkpoint"] == str(out / "checkpoints" / "step-3")
    assert f"model: not exported (training stopped; the latest checkpoint, {out}/checkpoints/step-3, holds step 3)" \
        in capsys.readouterr().out


class _SigtermAt:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, accelerator, state, row):
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler (toolkit.training.preemption) takes it


def test_preempted_resumed_and_finished_runs_name_only_the_final_they_wrote(tiny_model, padded_data, tmp_path,
                                                                             capsys):
    """One output_dir through every other ending. Map-style data with max_steps past its epochs (6 steps an
    epoch); a rerun from step 3 that is preempted (a final/ of the first run is there: the summary must not name
    it); its relaunch, which finishes; and a relaunch of the finished run after its final/ was lost (killed during
    the export): before the fix its summary named a final/ that did not exist; a relaunch whose max_steps is below its
    checkpoint's step is refused (before the fix it ended at once and called the checkpoint's weights its result)."""
    from helpers import train_in_process

    out = tmp_path / "out"
    values = _values(tiny_model, padded_data, out, max_steps=9, save_steps=3)
    whole = train_in_process(values)
    assert whole["ended"] == "completed" and (whole["steps"], whole["total_steps"]) == (9, 9)
    assert whole["epochs"] == pytest.approx(1.5) and whole["final_model"] == str(out / "final")
    _, rows = _on_disk(out)
    assert [r["epoch"] for r in rows if r["step"] in (6, 9)] == [1.0, 1.5] and rows[-1]["step"] == 9
    reference = _weights(out / "final")

    preempted = train_in_process({**values, "resume_from_checkpoint": str(out / "checkpoints" / "step-3"),
                                  "logging_steps": 2}, callbacks=[_SigtermAt(4)])
    assert preempted["ended"] == "preempted" and preempted["preempted"] and preempted["steps"] == 5
    # its last step is logged though 5 is no multiple of logging_steps (a resume starts after it: never logged else)
    assert [r["step"] for r in _on_disk(out)[1] if "loss" in r and r["step"] > 3] == [4, 5]
    assert preempted["final_model"] is None and os.path.isdir(out / "final")  # the first run's, not this one's
    assert "SIGTERM: saved checkpoint step-5" in capsys.readouterr().out

    finished = train_in_process({**values, "resume_from_checkpoint": "latest"})
    assert finished["ended"] == "completed" and finished["final_model"] == str(out / "final")
    assert all((reference[k] == w).all() for k, w in _weights(out / "final").items())

    shutil.rmtree(out / "final")
    again = train_in_process({**values, "resume_from_checkpoint": "latest"})
    assert "the checkpoint is at step 9 of 9: nothing left to train" in capsys.readouterr().out
    assert again["ended"] == "completed" and again["steps"] == 9 and again["final_model"] == str(out / "final")
    assert all((reference[k] == w).all() for k, w in _weights(out / "final").items())
    assert _on_disk(out)[0]["final_model"] == str(out / "final")
    with pytest.raises(ConfigError, match="step-9 is at step 9, past this run's 6 steps; raise max_steps") as err:
        train_in_process({**values, "max_steps": 6, "resume_from_checkpoint": "latest"})
    assert err.value.field_name == "max_steps"


def test_a_line_the_stream_cannot_read_mid_run_ends_it_with_its_summary_its_checkpoint_and_one_line(tiny_model,
                                                                                                    tmp_path, capsys):
    """A row its reader cannot parse in a later file of a stream (a CSV row with too many fields; a malformed JSON line
    is dropped and counted instead: test_stream.py): before the fix, pandas' or pyarrow's traceback mid-run (exit 1),
    no summary.json, the steps since the last checkpoint lost. Now the step before it is logged and saved (as a
    preempted run's), summary.json says the run stopped and why, and the error is one ConfigError line naming the file
    and the line (a resume meets it again as its first step is read: test_stream.py, without a model)."""
    from helpers import train_in_process

    good, bad = tmp_path / "part-0.csv", tmp_path / "part-1.csv"
    good.write_text("text\n" + "".join(f"row {i} of the first file\n" for i in range(64)))
    bad.write_text("text\na row\na row, with a comma\n")
    out = tmp_path / "out"
    values = _values(tiny_model, {"train_file": f"{good},{bad}"}, out, streaming=True, shuffle=False,
                     shuffle_buffer_size=8, max_steps=20, logging_steps=5, per_device_train_batch_size=8,
                     gradient_accumulation_steps=1, plot=False)
    with pytest.raises(ConfigError, match=f"train_file: cannot read .'{bad}'.: ParserError: .*line 3, saw 2"):
        train_in_process(values)  # 64 rows: 8 steps of 8, then part-1.csv
    assert "the stream cannot be read after step 8: saved checkpoint step-8" in capsys.readouterr().out
    summary, rows = _on_disk(out)
    assert summary["ended"] == "stopped" and summary["steps"] == 8 and summary["final_model"] is None
    assert f"{bad}" in summary["stop_reason"] and not os.path.exists(out / "final")
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-8"]
    assert rows[-1]["step"] == 8 and "loss" in rows[-1]  # logged though logging_steps is 5

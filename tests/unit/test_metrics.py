"""``metrics.jsonl``: what ``read_metrics`` accepts, and what ``MetricsLogger`` keeps when a run resumes.

A run killed mid-write leaves a last line cut short (no newline, not JSON): readers drop it with a warning. A complete
last line without its newline is kept. A bad line anywhere else is real damage and stops the read, naming the line.
On resume the logger keeps the rows up to the checkpoint's step and drops the interrupted attempt's later rows
(a cut-short tail included), then appends; a fresh run starts the file over; only the main process writes.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest

from toolkit import layout
from toolkit.reporting.metrics import MetricsLogger, read_metrics

ROWS = [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 6)]


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _lines(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


class FakeAccelerator:
    """The three attributes MetricsLogger uses. The logger is a single-process file writer (the main process writes,
    the others do nothing), so a stand-in tests it exactly; ``log`` records what would go to the trackers."""

    def __init__(self, is_main_process=True, trackers=()):
        self.is_main_process = is_main_process
        self.trackers = list(trackers)
        self.logged = []

    def log(self, values, step=None):
        self.logged.append((values, step))


def _logger(out, **kw) -> MetricsLogger:
    accelerator = kw.pop("accelerator", None) or FakeAccelerator()
    return MetricsLogger(accelerator, str(out), total_steps=10, **kw)


# ------------------------------------------------------------------------------------------------ reading
def test_reads_a_folder_or_the_file(tmp_path):
    path = _write(tmp_path / layout.METRICS, _lines(ROWS))
    assert read_metrics(str(tmp_path)) == read_metrics(path) == ROWS


def test_cut_short_last_line_is_dropped_with_a_warning(tmp_path):
    path = _write(tmp_path / "m.jsonl", _lines(ROWS) + '{"step": 6, "lo')
    with pytest.warns(UserWarning, match="cut short"):
        assert read_metrics(path) == ROWS


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = _write(tmp_path / "m.jsonl", _lines(ROWS) + json.dumps({"step": 6, "loss": 2.4}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning: nothing was lost
        rows = read_metrics(path)
    assert rows == ROWS + [{"step": 6, "loss": 2.4}]


def test_damaged_line_in_the_middle_raises_naming_it(tmp_path):
    lines = _lines(ROWS).splitlines(keepends=True)
    lines[2] = '{"step": 3, "loss": \n'  # line 3 of the file
    path = _write(tmp_path / "m.jsonl", "".join(lines))
    with pytest.raises(ValueError, match=r"line 3 is not JSON"):
        read_metrics(path)


def test_damaged_terminated_last_line_raises(tmp_path):
    """A last line that has its newline was written completely: if it is not JSON, it was damaged, not cut short."""
    path = _write(tmp_path / "m.jsonl", _lines(ROWS) + '{"step": 6, "lo\n')
    with pytest.raises(ValueError, match=r"line 6 is not JSON"):
        read_metrics(path)


# ------------------------------------------------------------------------------------------------ writing
def test_resume_keeps_rows_up_to_the_checkpoint_and_appends(tmp_path):
    _write(tmp_path / layout.METRICS, _lines(ROWS) + '{"step": 6, "lo')  # the attempt was killed writing step 6
    with pytest.warns(UserWarning, match="cut short"):
        logger = _logger(tmp_path, start_step=3, resume=True)
    assert read_metrics(str(tmp_path)) == ROWS[:3]  # steps 4, 5 and the torn 6 belonged to the interrupted attempt
    logger.log({"step": 4, "loss": 2.5})
    logger.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewrite left a clean file: no torn line any more
        assert read_metrics(str(tmp_path)) == ROWS[:3] + [{"step": 4, "loss": 2.5}]


def test_fresh_run_starts_the_file_over(tmp_path):
    _write(tmp_path / layout.METRICS, _lines(ROWS))
    logger = _logger(tmp_path, start_step=0, resume=False)
    logger.log({"step": 1, "loss": 9.0})
    logger.close()
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 9.0}]


def test_only_the_main_process_writes(tmp_path):
    path = _write(tmp_path / layout.METRICS, _lines(ROWS))
    other = FakeAccelerator(is_main_process=False, trackers=[object()])
    logger = _logger(tmp_path, accelerator=other, start_step=0, resume=False)
    logger.log({"step": 1, "loss": 9.0})
    logger.close()
    assert read_metrics(path) == ROWS and other.logged == []


def test_trackers_get_finite_scalars_at_the_row_step(tmp_path):
    accelerator = FakeAccelerator(trackers=[object()])
    logger = _logger(tmp_path, accelerator=accelerator)
    logger.log({"step": 7, "loss": 1.5, "grad_norm": math.nan, "tokens_seen": 640, "note": "x"})
    logger.close()
    # step is the x axis, not a scalar; NaN and strings are not plotted; the file keeps the whole row
    assert accelerator.logged == [({"loss": 1.5, "tokens_seen": 640}, 7)]
    assert read_metrics(str(tmp_path))[0]["note"] == "x"


def test_the_eval_line_shows_dpo_reward_accuracy_and_margin(tmp_path, capsys):
    """The line the progress bar prints at an evaluation: DPO's held-out reward accuracy and margin (TRL's names)
    beside the loss; a language model's line is unchanged."""
    logger = _logger(tmp_path)
    logger.log({"step": 20, "eval_loss": 0.68257, "eval_rewards/accuracies": 0.4615, "eval_rewards/margins": 0.0351,
                "eval_rewards/chosen": -0.01, "eval_pairs": 13})
    logger.log({"step": 30, "eval_loss": 3.0, "perplexity": 20.0855})
    logger.close()
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.startswith("step ")]
    assert lines == ["step 20: eval_loss 0.6826 eval_rewards/accuracies 0.4615 eval_rewards/margins 0.0351",
                     "step 30: eval_loss 3.0000 perplexity 20.0855"], lines


def test_rows_with_a_loss_name_the_task_unit(tmp_path):
    """metrics.jsonl's rows with a loss (training or evaluation) carry the task's loss unit, so that loss.png and
    ``toolkit report`` label a DPO run's loss per pair and a classifier's per example without knowing the task."""
    logger = _logger(tmp_path, loss_unit="per pair")
    logger.log({"step": 0, "eval_loss": 0.69})
    logger.log({"step": 1, "loss": 0.7, "lr": 0.1})
    logger.close()
    assert [r["loss_unit"] for r in read_metrics(str(tmp_path))] == ["per pair", "per pair"]

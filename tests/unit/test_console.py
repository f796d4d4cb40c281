"""What a user reads from the libraries underneath, in process: a load report without raw escape sequences when
stderr is not a terminal, and no warning about code the user does not own. The output of real 2-rank runs is checked
on launches the suite makes anyway (tests/launch/test_recipes.py::test_sft_on_two_ranks_equals_one_process: DDP;
tests/launch/test_verify.py::test_verify_zero3_passes: ZeRO-3 and one process)."""

import sys
import warnings

from toolkit.config import ModelArguments


class _Terminal:
    """sys.stdout as a terminal (isatty), writing where it wrote."""

    def __init__(self, stream):
        self.stream = stream

    def isatty(self):
        return True

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _encoder(tmp_path) -> str:
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16)).save_pretrained(tmp_path)
    return str(tmp_path)


def test_load_report_has_no_escape_sequences_when_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    """A classifier loaded from an encoder: transformers reports the new head's keys as MISSING, coloured when
    sys.stdout is a terminal, on sys.stderr (here not a terminal, as in ``accelerate launch ... 2> run.log``)."""
    import io
    import logging

    from transformers import AutoConfig

    from toolkit.models.loading import load_model

    folder = _encoder(tmp_path)
    config = AutoConfig.from_pretrained(folder, num_labels=3)
    library = logging.getLogger("transformers")  # the report's logger propagates here (transformers' own handler)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    monkeypatch.setattr(library, "level", logging.WARNING)
    library.addHandler(handler)
    monkeypatch.setattr(sys, "stdout", _Terminal(sys.stdout))
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # what the check reads: not a terminal
    try:
        load_model(ModelArguments(model_name_or_path=folder), config, auto_class="AutoModelForSequenceClassification")
    finally:
        library.removeHandler(handler)
    report = log.getvalue()
    assert "LOAD REPORT" in report and "classifier.weight" in report and "MISSING" in report
    assert "\x1b[" not in report


def test_lora_wraps_without_a_future_warning(tmp_path):
    """peft 0.21 calls transformers 5's deprecated ``is_gradient_checkpointing`` when it wraps a model."""
    from transformers import AutoModelForSequenceClassification

    from toolkit.models.lora import apply_lora

    folder = _encoder(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        apply_lora(model, ModelArguments(model_name_or_path=folder, use_peft=True), "SEQ_CLS", log=lambda *_: None)

"""A Hub name fails at once, with the clear message, when the Hub cannot be reached (toolkit/env/hub.py): the recipes'
model, tokenizer and dataset names and ``toolkit plan --model``, in process. Without it each took ~25 s of
huggingface_hub's retries (and the offline variables, set after import, were not seen at all)."""

import time

import pytest
from helpers import free_port

from toolkit.config import DataArguments, ModelArguments
from toolkit.env import hub
from toolkit.errors import ConfigError

MISSING = "toolkit-tests/no-such-model"  # a Hub id that no cache holds
FAST_S = 5.0  # "at once": retries alone took ~25 s


@pytest.fixture
def fresh_hub(monkeypatch):
    """The Hub libraries' offline switches and endpoint restored after the test; no probe answer remembered."""
    import datasets.config
    from huggingface_hub import constants
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (imported here: the timings are the calls')

    for var in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(constants, "ENDPOINT", constants.ENDPOINT)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    probe = hub._probe
    probe.cache_clear()
    yield monkeypatch
    probe.cache_clear()


def _each_hub_name_fails_at_once(words: str, capsys) -> None:
    from toolkit.cli import plan
    from toolkit.data import loading as data
    from toolkit.models import loading as model

    calls = {
        "model_name_or_path": lambda: model.load_config(ModelArguments(model_name_or_path=MISSING)),
        "tokenizer_name": lambda: model.load_tokenizer(ModelArguments(tokenizer_name=MISSING, config_name=MISSING)),
        "dataset_name": lambda: data.load_splits(DataArguments(dataset_name=MISSING + "-data"), {}),
    }
    for field, call in calls.items():
        start = time.perf_counter()
        with pytest.raises(ConfigError) as err:
            call()
        took = time.perf_counter() - start
        assert took < FAST_S, (field, took)
        assert str(err.value).startswith(f"{field}: cannot load ") and "the Hub is unreachable" in str(err.value)
        assert words in str(err.value) and "in the local cache" in str(err.value)
    start = time.perf_counter()
    assert plan.main(["--model", MISSING, "--gpus", "1", "--gpu-memory", "80GB"]) == 2
    assert time.perf_counter() - start < FAST_S
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"plan error: --model {MISSING}: not a local folder, and the Hub is unreachable")
    assert words in line


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_variables_fail_at_once(fresh_hub, capsys, var):
    fresh_hub.setenv(var, "1")  # set after the libraries were imported, as in a notebook
    _each_hub_name_fails_at_once(f"{var} is set", capsys)


def test_an_unreachable_endpoint_fails_at_once(fresh_hub, capsys):
    from huggingface_hub import constants

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    fresh_hub.setenv("HF_ENDPOINT", closed)
    fresh_hub.setattr(constants, "ENDPOINT", closed)  # what huggingface_hub read from HF_ENDPOINT at import
    _each_hub_name_fails_at_once(f"{closed} did not answer", capsys)


def test_local_paths_are_never_probed(fresh_hub, tmp_path):
    fresh_hub.setattr(hub, "_probe", lambda endpoint: pytest.fail("a local path made a request"))
    for name in (str(tmp_path), "./some/folder", "outputs/models/smollm2", "~/models/x"):
        assert hub.is_local(name) and hub.offline_if_unreachable(name) is None
    assert not hub.is_local("gpt2") and not hub.is_local("meta-llama/Llama-2-7b-hf")

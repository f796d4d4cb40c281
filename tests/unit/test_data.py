"""Data loading, packing and padding (in-process; the distributed order is tested in test_core.py)."""

import json

import pandas as pd
import pytest
import torch

from toolkit.config import ConfigError, DataArguments
from toolkit.data.loading import CausalLMCollator, load_raw_datasets, pydoc_dataset, tokenize_and_group
from toolkit.loss import count_targets, token_losses
from toolkit.models.offline import gpt2_tokenizer

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


def test_train_file_takes_a_glob_a_comma_list_or_a_yaml_list(tmp_path, tiny_model):
    """A corpus in shards: a glob (sorted), comma-separated paths or a YAML list read as one split, streamed or not
    (the stream reads the same list: toolkit.data.stream)."""
    import yaml

    from toolkit.config import parse_args

    for i in range(3):
        (tmp_path / f"part-{i}.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} {j}"}) for j in range(2)))
    expected = [f"doc {i} {j}" for i in range(3) for j in range(2)]
    by_glob = DataArguments(train_file=str(tmp_path / "part-*.jsonl"), validation_split_percentage=0)
    assert by_glob.data_files() == [str(tmp_path / f"part-{i}.jsonl") for i in range(3)]
    assert load_raw_datasets(by_glob)["train"]["text"][:] == expected
    listed = ",".join(str(tmp_path / f"part-{i}.jsonl") for i in (2, 0))
    assert load_raw_datasets(DataArguments(train_file=listed, validation_split_percentage=0))["train"]["text"][:] == expected[4:] + expected[:2]
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": tiny_model, "output_dir": str(tmp_path / "out"),
                                      "train_file": [str(tmp_path / "part-1.jsonl"), str(tmp_path / "part-2.jsonl")],
                                      "validation_file": str(tmp_path / "part-0.jsonl")}))
    cfg = parse_args(["--config", str(config)])
    assert cfg.data.data_files() == [str(tmp_path / "part-1.jsonl"), str(tmp_path / "part-2.jsonl")]


@pytest.mark.parametrize("value, words", [
    ("{tmp}/nothing-*.jsonl", "the pattern '{tmp}/nothing-*.jsonl' matches no file"),
    ("{tmp}/a.jsonl,{tmp}/missing.jsonl", "file not found: {tmp}/missing.jsonl"),
    ("{tmp}/a.jsonl,{tmp}/b.csv", "mixes formats (csv, json)"),
    (" , ", "names no file"),
])
def test_a_file_list_that_names_nothing_readable_is_refused_before_work(tmp_path, value, words):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.csv").write_text("text\nb\n")
    with pytest.raises(ConfigError) as err:
        DataArguments(train_file=value.format(tmp=tmp_path))
    assert err.value.field_name == "train_file" and words.format(tmp=tmp_path) in str(err.value)


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

    from toolkit.data import loading as data

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
    texts = ["one two three four five", "", "a", " ", "x y"]  # (a null text is dropped earlier: test_stream)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    raw = load_raw_datasets(DataArguments(train_file=str(path), validation_split_percentage=0))
    assert len(raw["train"]) == 4  # the empty text is dropped and counted at load (as a stream drops it)
    rows = tokenize_and_group(raw, tok, DataArguments(packing=False), block_size=4)["train"]["input_ids"]
    # 5 words + EOS cut to 4; "a" and " " are 1 token + EOS; "x y" 2 + EOS
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


# Texts the probe (toolkit.data.loading.PROBE_TEXTS) never shows: tokens added after loading, with and without stripping or
# normalization, text a normalizer changes (case, accents, a ligature, full-width forms), Metaspace's word starts.
ENCODER_TEXTS = ["a <new> b", "x<new>y <NEW>", "  <ctl>  hi  </ctl>x", "</ctl></ctl>", "Héllo WÖRLD Straße ﬁne ＡＢＣ",
                 "Python is\n  indented", "[SEP] [PAD] text [MASK]"]
ADDED = ["<new>", "<ctl>", "</ctl>"]


def _encoder_tokenizer(case: str, request):
    """The tokenizer of one case: byte-level BPE (GPT-2), Metaspace/SentencePiece (the Llama 2 kind, conftest.py),
    WordPiece with BERT's normalizer (all-MiniLM-L6-v2, whose tokenizer.json ships padding and truncation at 128)."""
    from tokenizers import AddedToken, normalizers
    from transformers import AutoTokenizer

    from toolkit.models.offline import minilm_path

    family, _, change = case.partition("+")
    kwargs = {"split_special_tokens": True} if change == "split-special-tokens" else {}
    if family == "bpe":
        tok = gpt2_tokenizer()
        if kwargs:  # what from_pretrained(..., split_special_tokens=True) does: the attribute and the backend's flag
            tok.split_special_tokens = tok.backend_tokenizer.encode_special_tokens = True
    elif family == "metaspace":
        tok = AutoTokenizer.from_pretrained(request.getfixturevalue("sentencepiece_tokenizer"), **kwargs)
    else:
        tok = AutoTokenizer.from_pretrained(minilm_path(), **kwargs)
    backend = tok.backend_tokenizer
    if family == "wordpiece" and change != "as-shipped":
        backend.no_padding()
        backend.no_truncation()
    if change == "added-tokens":  # a plain token, one stripping the spaces around it unnormalized, a special one
        tok.add_tokens(["<new>", AddedToken("<ctl>", lstrip=True, rstrip=True, normalized=False)])
        tok.add_special_tokens({"additional_special_tokens": ["</ctl>"]})
    elif change == "normalizer":
        backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    elif change == "padding":
        tok.pad_token = tok.eos_token or tok.unk_token
        backend.enable_padding(pad_id=tok.pad_token_id, pad_token=tok.pad_token)
    elif change == "padding-to-length":
        tok.pad_token = tok.eos_token or tok.unk_token
        backend.enable_padding(pad_id=tok.pad_token_id, pad_token=tok.pad_token, length=64)
    elif change == "truncation":
        backend.enable_truncation(8)
    return tok


# case -> what token_encoder must pick: the backend where it gives the tokenizer's ids, the tokenizer's own call where
# the backend carries padding or truncation (tokenizer() turns them off per call; the backend would apply them) or
# splits special tokens (a pickled backend forgets it: docs/pitfalls.md#pickled-split-special-tokens).
ENCODER_CASES = {
    "bpe": "backend", "bpe+added-tokens": "backend", "bpe+normalizer": "backend", "bpe+padding": "tokenizer",
    "bpe+truncation": "tokenizer", "bpe+split-special-tokens": "tokenizer",
    "metaspace": "backend", "metaspace+added-tokens": "backend", "metaspace+normalizer": "backend",
    "metaspace+padding-to-length": "tokenizer", "metaspace+split-special-tokens": "tokenizer",
    "wordpiece": "backend", "wordpiece+added-tokens": "backend", "wordpiece+as-shipped": "tokenizer",
}


@pytest.mark.parametrize("case", ENCODER_CASES)
def test_fast_encoder_gives_the_tokenizers_ids_and_falls_back_when_it_would_not(case, request):
    # The tokenize map calls the Rust backend directly (1.67x, bench/data_prep.py) only where that is the same thing
    # as tokenizer(texts): on the three tokenizer families, with added tokens, a normalizer, padding and truncation,
    # on texts beyond the probe (a special token's text, accents, CJK, empty and long strings, the added tokens).
    import dill

    from toolkit.data.loading import PROBE_TEXTS, token_encoder

    texts = PROBE_TEXTS + list(pydoc_dataset()["validation"]["text"]) + ENCODER_TEXTS
    tok = _encoder_tokenizer(case, request)
    encode, how = token_encoder(tok)
    assert how == ENCODER_CASES[case]
    ids = encode(texts)
    expected = _encoder_tokenizer(case, request)(texts, add_special_tokens=False)["input_ids"]  # a fresh tokenizer
    assert ids == expected
    # and as datasets' map hands it to its preprocessing_num_workers processes (multiprocess pickles it with dill)
    assert dill.loads(dill.dumps(encode))(texts) == expected
    # the texts exercise what the case changes: every added token is one id, and no row is padded or cut
    if case.endswith("added-tokens"):
        assert all(tok.convert_tokens_to_ids(t) in sum(ids, []) for t in ADDED)
    assert max(map(len, ids)) > 128 and len({len(x) for x in ids}) > 10


def test_a_tokenizer_that_splits_special_tokens_is_not_served_the_map_cache_of_one_that_does_not(tmp_path):
    # The tokenize map's cache fingerprint names a backend-encoded map by the backend's JSON, which has no
    # split_special_tokens (docs/pitfalls.md#pickled-split-special-tokens): before the fix, the second run here was
    # served the rows the first one cached, '<|endoftext|>' as the EOS id, in one process.
    text = "a <|endoftext|> b"
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    args = DataArguments(train_file=str(path), validation_file=str(path), packing=False)
    for split in (False, True):
        tok = gpt2_tokenizer()
        tok.split_special_tokens = tok.backend_tokenizer.encode_special_tokens = split  # from_pretrained's kwarg
        rows = list(tokenize_and_group(load_raw_datasets(args), tok, args, block_size=64)["train"]["input_ids"])
        assert rows == [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def test_a_chat_map_is_cached_under_the_tokenizers_whole_state(tmp_path):
    """chat, preference and classification maps give datasets their fingerprint (data.map_with_tokenizer) instead of
    letting it dill-pickle the tokenizer for every split on every rank (0.35 s each with GPT-2's). On file-backed
    splits, where maps are cached: the same tokenizer loaded again gets the same fingerprint (another rank reads the
    cache the first one wrote), and another chat template or a moved special token gets its own rows, never the
    cached ones."""
    from toolkit.data.chat import set_chat_template
    from toolkit.tasks.sft import load_raw_chats, tokenize_chats

    chat = [{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "A mutable sequence."}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": chat}) + "\n")
    args = DataArguments(train_file=str(path), validation_file=str(path), packing=False)
    templates = {
        "roles": "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}",
        "plain": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}",
    }

    def run(template, eos=None):
        t = gpt2_tokenizer()
        set_chat_template(t, templates[template])
        if eos is not None:
            t.eos_token = eos
        out = tokenize_chats(load_raw_chats(args), t, args, block_size=64)["train"]
        return out._fingerprint, out["input_ids"][0], t.apply_chat_template(chat, tokenize=True, return_dict=False)

    first, again = run("roles"), run("roles")
    assert again[0] == first[0] and again[1] == first[1] == first[2]
    for other in (run("plain"), run("roles", eos="\n")):
        assert other[0] != first[0]
        assert other[1] == other[2] != first[1]


def test_a_malformed_json_line_is_one_line_naming_the_file_and_the_line_before_work(tmp_path):
    """A cut line in a JSON-lines file was reported as datasets' generation error, without the file's line (and a
    validation file's as train_file's)."""
    lines = [json.dumps(r) for r in ROWS]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:3] + ['{"text": "a line cut sho'] + lines[3:]) + "\n")
    good = _write(tmp_path / "good.jsonl", "jsonl")
    for args, field in ((DataArguments(train_file=str(bad)), "train_file"),
                        (DataArguments(train_file=good, validation_file=str(bad)), "validation_file")):
        with pytest.raises(ConfigError) as err:
            load_raw_datasets(args)
        assert err.value.field_name == field
        assert err.value.message.startswith(f"{bad} line 4 is not a JSON object (")
        assert err.value.message.endswith("fix or remove that line")


def test_empty_and_non_string_texts_are_dropped_and_counted_like_null_ones(tmp_path, bpe_2048):
    """An empty text was dropped without a word (the tokenizer made no token of it), and a file with a text that is
    not a string was refused whole, while a stream dropped that row: both paths drop and count them now."""
    from toolkit.tasks.lm import CausalLM

    texts = ["one two three", "", 5, None, "four five six", [1, 2], "seven eight"]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    task, said = CausalLM(), []
    task.log = said.append
    raw = task.load_raw(DataArguments(train_file=str(path), validation_split_percentage=0))
    assert raw["train"]["text"] == ["one two three", "four five six", "seven eight"]
    assert raw["train"].features["text"].dtype == "string"
    assert task.data_record["dropped_rows"] == {"train": 4}
    assert said == ["dropped the rows with no text (null, empty or not a string) in column 'text': 4 of 7 in the "
                    "train split"]
    keep, _ = task.stream_rows(bpe_2048, DataArguments(), 16)  # the stream's rule is the same
    assert [keep({"text": t}) for t in texts] == [True, None, None, None, True, None, True]


def test_a_validation_file_with_other_columns_is_one_line_naming_it(tmp_path):
    """The splits were read in one load_dataset call: a validation file whose columns differ from the training
    file's failed inside datasets ("cannot read {...}: DatasetGenerationError: ...")."""
    from toolkit.tasks.lm import CausalLM

    train = _write(tmp_path / "train.jsonl", "jsonl")
    other = tmp_path / "valid.jsonl"
    other.write_text("".join(json.dumps({"body": r["text"], "id": i}) + "\n" for i, r in enumerate(ROWS)))
    with pytest.raises(ConfigError) as err:
        CausalLM().load_raw(DataArguments(train_file=train, validation_file=str(other)))
    assert err.value.field_name == "validation_file"
    assert err.value.message.startswith(f"{other}: the validation split has the columns ['body', 'id'], which fit "
                                        "none of the formats this recipe takes: text (text)")
    # a validation file with extra columns beside the text is read as it is
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"text": r["text"], "id": i}) + "\n" for i, r in enumerate(ROWS)))
    raw = CausalLM().load_raw(DataArguments(train_file=train, validation_file=str(extra)))
    assert raw["validation"]["text"] == [r["text"] for r in ROWS]

"""Dataset formats (toolkit/data/formats.py) and mixtures (toolkit/data/mixture.py): each format's rows tokenized against a
hand-built expectation (the prompt's and the completion's ids tokenized apart, where the shipped BPE splits them at
the boundary, with -100 on the prompt), TRL's ``extract_prompt`` as the oracle of implicit-prompt pairs, detection and
its refusals, and a mixture's rows against the sets' converted rows."""

from __future__ import annotations

import json

import pytest

from toolkit.config import DataArguments, config_from_dict
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok(bpe_2048):
    from toolkit.data.chat import set_chat_template

    set_chat_template(bpe_2048, TEMPLATE)
    return bpe_2048


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _expect(tok, *pieces: tuple[str, bool]) -> tuple[list[int], list[int]]:
    """Ids and labels built by hand: each piece tokenized alone, a target piece labelled with its ids."""
    ids, labels = [], []
    for text, target in pieces:
        piece = _ids(tok, text)
        ids += piece
        labels += piece if target else [IGNORE_INDEX] * len(piece)
    return ids, labels


def _write(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _tokenized(tmp_path, tok, rows, block_size=256, **fields):
    from toolkit.tasks.sft import load_raw_chats, tokenize_chats

    args = DataArguments(train_file=_write(tmp_path / "train.jsonl", rows), validation_split_percentage=0, **fields)
    return tokenize_chats(load_raw_chats(args), tok, args, block_size)["train"]


def test_alpaca_rows_are_a_user_turn_and_an_assistant_turn(tmp_path, tok, capsys):
    rows = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Name a colour.", "input": "", "output": "Blue", "system": "Be brief."}]
    out = _tokenized(tmp_path, tok, rows)
    assert "dataset format: train: alpaca" in capsys.readouterr().out  # one line naming the format found
    first = _expect(tok, (f"<|user|>\nAdd the numbers.\n\n2 and 3{EOS}\n<|assistant|>\n", False), (f"5{EOS}", True),
                    ("\n", False))
    second = _expect(tok, (f"<|system|>\nBe brief.{EOS}\n<|user|>\nName a colour.{EOS}\n<|assistant|>\n", False),
                     (f"Blue{EOS}", True), ("\n", False))
    assert (out[0]["input_ids"], out[0]["labels"]) == first
    assert (out[1]["input_ids"], out[1]["labels"]) == second


def test_sharegpt_rows_map_their_speakers_to_roles(tmp_path, tok):
    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Hello"},
                               {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "See you"}]}]
    out = _tokenized(tmp_path, tok, rows, sharegpt_roles="{bot: assistant}")
    expected = _expect(tok, (f"<|user|>\nHi{EOS}\n<|assistant|>\n", False), (f"Hello{EOS}", True),
                       (f"\n<|user|>\nBye{EOS}\n<|assistant|>\n", False), (f"See you{EOS}", True), ("\n", False))
    assert (out[0]["input_ids"], out[0]["labels"]) == expected
    with pytest.raises(ConfigError, match=r"sharegpt_roles: the train split, row 0: the speaker 'bot' has no role"):
        _tokenized(tmp_path, tok, rows)


def test_standard_prompt_completion_is_plain_text_with_eos_and_the_loss_on_the_completion(tmp_path, tok):
    rows = [{"prompt": "The sky is", "completion": " blue"}, {"prompt": "Grass is", "completion": f" green{EOS}"}]
    out = _tokenized(tmp_path, tok, rows)
    # TRL's SFT: no chat template, EOS appended unless there (add_eos), completion-only loss
    assert (out[0]["input_ids"], out[0]["labels"]) == _expect(tok, ("The sky is", False), (f" blue{EOS}", True))
    assert (out[1]["input_ids"], out[1]["labels"]) == _expect(tok, ("Grass is", False), (f" green{EOS}", True))


def test_conversational_prompt_completion_learns_the_completion_only(tmp_path, tok):
    prompt = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
              {"role": "user", "content": "Q2"}]
    out = _tokenized(tmp_path, tok, [{"prompt": prompt, "completion": [{"role": "assistant", "content": "A2"}]}])
    # the prompt's assistant turn is context, not a target (as a messages row's would be)
    expected = _expect(tok, (f"<|user|>\nQ1{EOS}\n<|assistant|>\nA1{EOS}\n<|user|>\nQ2{EOS}\n<|assistant|>\n", False),
                       (f"A2{EOS}", True), ("\n", False))
    assert (out[0]["input_ids"], out[0]["labels"]) == expected


def test_messages_rows_keep_every_assistant_turn_as_a_target(tmp_path, tok):
    messages = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    out = _tokenized(tmp_path, tok, [{"messages": messages}])
    expected = _expect(tok, (f"<|user|>\nQ1{EOS}\n<|assistant|>\n", False), (f"A1{EOS}", True),
                       (f"\n<|user|>\nQ2{EOS}\n<|assistant|>\n", False), (f"A2{EOS}", True), ("\n", False))
    assert (out[0]["input_ids"], out[0]["labels"]) == expected


def test_implicit_prompt_pairs_split_as_trl_extract_prompt(tmp_path):
    from trl.data_utils import extract_prompt

    from toolkit.tasks.dpo import load_raw_pairs

    user = {"role": "user", "content": "What colour is the sky?"}
    rows = [{"chosen": [user, {"role": "assistant", "content": "Blue."}],
             "rejected": [user, {"role": "assistant", "content": "Green."}]},
            {"chosen": [user, {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "Sure?"},
                        {"role": "assistant", "content": "Yes."}],
             "rejected": [user, {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "Sure?"},
                          {"role": "assistant", "content": "No."}]}]
    args = DataArguments(train_file=_write(tmp_path / "c.jsonl", rows), validation_split_percentage=0)
    assert list(load_raw_pairs(args)["train"]) == [extract_prompt(r) for r in rows]
    texts = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
             {"chosen": "Two plus two is four", "rejected": "Two plus two is five"}]
    args = DataArguments(train_file=_write(tmp_path / "t.jsonl", texts), validation_split_percentage=0)
    assert list(load_raw_pairs(args)["train"]) == [extract_prompt(r) for r in texts]
    assert extract_prompt(texts[0])["chosen"] == " blue."  # the space before the difference starts the completion


def test_explicit_preference_rows_pass_through(tmp_path):
    from toolkit.tasks.dpo import load_raw_pairs

    rows = [{"prompt": "The sky is", "chosen": " blue", "rejected": " green", "id": 3}]
    args = DataArguments(train_file=_write(tmp_path / "p.jsonl", rows), validation_split_percentage=0)
    assert list(load_raw_pairs(args)["train"]) == [{"prompt": "The sky is", "chosen": " blue", "rejected": " green"}]


@pytest.mark.parametrize("columns, fields, fmt", [
    (["messages"], {}, "messages"), (["conversations", "id"], {}, "sharegpt"),
    (["prompt", "completion"], {}, "prompt_completion"), (["instruction", "input", "output"], {}, "alpaca"),
    (["chat", "prompt", "completion"], {"text_column_name": "chat"}, "messages"),
    (["messages", "prompt", "completion"], {"dataset_format": "prompt_completion"}, "prompt_completion"),
])
def test_the_format_is_detected_from_the_columns_or_forced(columns, fields, fmt):
    from toolkit.data.formats import detect

    assert detect(columns, "chat", DataArguments(dataset_name="x", **fields), "the train split") == fmt


def test_columns_that_fit_no_format_are_refused_naming_the_columns_and_the_formats():
    from toolkit.data.formats import detect

    with pytest.raises(ConfigError, match=r"^dataset_format: the train split has the columns \['question', 'answer'\],"
                                          r" which fit none of the formats this recipe takes: messages \(messages\); "
                                          r"sharegpt \(conversations\); prompt_completion \(prompt, completion\); "
                                          r"alpaca \(instruction, output\)"):
        detect(["question", "answer"], "chat", DataArguments(dataset_name="x"), "the train split")
    with pytest.raises(ConfigError, match=r"^dataset_format: 'alpaca' is not a format this recipe trains on; it "
                                          r"takes preference \(prompt, chosen, rejected\); implicit_preference"):
        detect(["instruction", "output"], "preference", DataArguments(dataset_name="x", dataset_format="alpaca"), "")
    with pytest.raises(ConfigError, match=r"^dataset_format: alpaca needs the column\(s\) \['output'\]"):
        detect(["instruction"], "chat", DataArguments(dataset_name="x", dataset_format="alpaca"), "the train split")


def test_a_value_of_the_wrong_type_is_refused_naming_its_row(tmp_path, tok):
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": None}]
    with pytest.raises(ConfigError, match=r"^dataset_format: the train split, row 1: column 'output' holds NoneType"):
        _tokenized(tmp_path, tok, rows)


# ---------------------------------------------------------------------------------------------------- mixtures
def _mixture_files(tmp_path):
    alpaca = [{"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}."} for i in range(10)]
    chats = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": f"Yo {i}"}]}
             for i in range(20)]
    return _write(tmp_path / "alpaca.jsonl", alpaca), _write(tmp_path / "chats.jsonl", chats)


def _mixture(alpaca, chats, weight=0.5, seed=0, test=None) -> dict:
    return {"datasets": [{"id": alpaca}, {"id": chats, "columns": ["messages"], "weight": weight}], "seed": seed,
            "test_split_size": test}


def test_a_mixture_converts_each_set_and_draws_its_weight_of_rows(tmp_path):
    import random

    from toolkit.data.mixture import load_mixture

    alpaca, chats = _mixture_files(tmp_path)
    args = DataArguments(dataset_mixture=_mixture(alpaca, chats))
    raw, record = load_mixture(args, "chat", {})
    taken = sorted(random.Random(0).sample(range(20), 10))  # data.sample_rows' draw: seeded, in file order
    expected = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
                for i in range(10)]
    expected += [[{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": f"Yo {i}"}] for i in taken]
    assert raw["train"]["messages"] == expected and list(raw) == ["train"]
    assert record == {"datasets": [{"id": alpaca, "split": "train", "format": "alpaca", "rows": 10, "of": 10},
                                   {"id": chats, "split": "train", "format": "messages", "rows": 10, "of": 20}],
                      "train_rows": 20, "validation_rows": 0}
    again, _ = load_mixture(args, "chat", {})
    assert again["train"]["messages"] == expected  # no process state: the same rows every time, on every rank
    other, _ = load_mixture(DataArguments(dataset_mixture=_mixture(alpaca, chats, seed=1)), "chat", {})
    assert other["train"]["messages"] != expected
    held, record = load_mixture(DataArguments(dataset_mixture=_mixture(alpaca, chats, test=0.25)), "chat", {})
    assert (len(held["train"]), len(held["validation"])) == (15, 5) and record["validation_rows"] == 5
    assert sorted(map(json.dumps, list(held["train"]["messages"]) + list(held["validation"]["messages"]))) == \
        sorted(map(json.dumps, expected))


def test_a_mixture_field_is_read_from_yaml_and_from_the_command_line(tmp_path):
    alpaca, chats = _mixture_files(tmp_path)
    base = {"model_name_or_path": "gpt2", "output_dir": str(tmp_path / "out")}
    cfg = config_from_dict({**base, "dataset_mixture": _mixture(alpaca, chats, test=0.1)})
    assert cfg.data.dataset_mixture == {"datasets": [
        {"id": alpaca, "config": None, "split": "train", "columns": None, "weight": 1.0},
        {"id": chats, "config": None, "split": "train", "columns": ["messages"], "weight": 0.5}],
        "seed": 0, "test_split_size": 0.1}
    again = config_from_dict({**base, "dataset_mixture": json.dumps(_mixture(alpaca, chats, test=0.1))})
    assert again.data.dataset_mixture == cfg.data.dataset_mixture
    assert config_from_dict({**base, **cfg.as_dict()}).data.dataset_mixture == cfg.data.dataset_mixture  # config.yaml


@pytest.mark.parametrize("change, words", [
    ({"weight": 0}, r"datasets\[1\] \(.*chats.jsonl\): weight is the fraction of the set's rows to take, in \(0, 1\]"),
    ({"weight": 1.5}, r"datasets\[1\] .* in \(0, 1\]; got 1.5"),
    ({"id": "/no/such/file.jsonl"}, r"datasets\[1\]: no file matches '/no/such/file.jsonl'"),
    ({"colums": ["x"]}, r"datasets\[1\] has unknown key\(s\) \['colums'\]"),
])
def test_a_bad_mixture_is_refused_at_parse_time(tmp_path, change, words):
    alpaca, chats = _mixture_files(tmp_path)
    mixture = _mixture(alpaca, chats)
    mixture["datasets"][1].update(change)
    with pytest.raises(ConfigError, match="^dataset_mixture: " + words):
        config_from_dict({"model_name_or_path": "gpt2", "output_dir": str(tmp_path / "o"), "dataset_mixture": mixture})


def test_a_mixture_with_other_data_fields_or_missing_columns_is_refused(tmp_path):
    from toolkit.data.mixture import load_mixture

    alpaca, chats = _mixture_files(tmp_path)
    with pytest.raises(ConfigError, match="^dataset_mixture: replaces dataset_name, train_file and validation_file; "
                                          "unset train_file"):
        config_from_dict({"model_name_or_path": "gpt2", "output_dir": str(tmp_path / "o"), "train_file": chats,
                          "dataset_mixture": _mixture(alpaca, chats)})
    mixture = _mixture(alpaca, chats)
    mixture["datasets"][0]["columns"] = ["instruction", "response"]
    with pytest.raises(ConfigError, match=r"^dataset_mixture: dataset_mixture datasets\[0\] \(.*\): no column\(s\) "
                                          r"\['response'\]; it has \['instruction', 'input', 'output'\]"):
        load_mixture(DataArguments(dataset_mixture=mixture), "chat", {})


def test_a_mixture_of_text_sets_trains_the_causal_lm(tmp_path):
    from toolkit.tasks.lm import CausalLM

    a = _write(tmp_path / "a.jsonl", [{"text": f"alpha {i}", "id": i} for i in range(4)])
    b = _write(tmp_path / "b.jsonl", [{"text": f"beta {i}", "source": "b"} for i in range(4)])
    task = CausalLM()
    raw = task.load_raw(DataArguments(dataset_mixture={"datasets": [{"id": a}, {"id": b, "weight": 0.5}]}))
    assert raw["train"].column_names == ["text"] and len(raw["train"]) == 6
    assert task.summary(None, None)["dataset_mixture"]["datasets"][1]["rows"] == 2


def test_a_stream_converts_each_row_as_a_loaded_set_does(tmp_path, tok):
    from toolkit.tasks.sft import ChatSFT

    rows = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"prompt": "The sky is", "completion": " blue"},
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]
    keep, encode = ChatSFT().stream_rows(tok, DataArguments(train_file=_write(tmp_path / "s.jsonl", rows[:1])), 256)
    loaded = [_tokenized(tmp_path, tok, [row])[0] for row in rows]
    assert all(keep(row) for row in rows) and encode(rows) == loaded
    assert keep({"answer": "x"}) is None  # mid-run, a row that fits no format is dropped and counted (test_stream)


def test_the_converted_splits_keep_a_fingerprint_so_the_tokenize_cache_is_hit(tmp_path, tok):
    from toolkit.tasks.sft import load_raw_chats

    rows = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}]
    args = DataArguments(train_file=_write(tmp_path / "a.jsonl", rows), validation_split_percentage=0)
    first, again = load_raw_chats(args)["train"], load_raw_chats(args)["train"]
    assert first._fingerprint == again._fingerprint and again.cache_files == first.cache_files
    roles = DataArguments(train_file=args.train_file, validation_split_percentage=0, sharegpt_roles="{bot: user}")
    assert load_raw_chats(roles)["train"]._fingerprint != first._fingerprint  # a setting of the conversion changed


def test_a_validation_file_in_another_format_of_the_task_is_converted_on_its_own(tmp_path, capsys):
    """train_file and validation_file were read in one load_dataset call: files with different columns failed inside
    datasets. Each is read and detected apart: both fit chat SFT here (messages, alpaca); one that fits no format is
    refused naming validation_file, its columns and the formats expected."""
    from toolkit.tasks.sft import load_raw_chats

    chat = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    train = _write(tmp_path / "train.jsonl", [{"messages": chat}] * 3)
    valid = _write(tmp_path / "valid.jsonl", [{"instruction": "Say hi.", "output": "Hi."}] * 2)
    raw = load_raw_chats(DataArguments(train_file=train, validation_file=valid))
    assert "dataset format: train: messages, validation: alpaca" in capsys.readouterr().out
    assert raw["validation"][0]["messages"] == [{"role": "user", "content": "Say hi."},
                                                {"role": "assistant", "content": "Hi."}]
    odd = _write(tmp_path / "odd.jsonl", [{"question": "Say hi.", "answer": "Hi."}])
    with pytest.raises(ConfigError) as err:
        load_raw_chats(DataArguments(train_file=train, validation_file=odd))
    assert err.value.field_name == "validation_file"
    assert err.value.message.startswith(f"{odd}: the validation split has the columns ['question', 'answer'], which "
                                        "fit none of the formats this recipe takes: messages (messages);")


def test_chats_with_no_assistant_token_within_block_size_are_dropped_counted_and_recorded(tmp_path, tok):
    """docs/recipes.md said the run logs how many such chats it drops; it dropped them without a word, and
    summary.json (the task's summary) had no dropped_rows for them."""
    from toolkit.tasks.sft import ChatSFT

    short = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    long = [{"role": "user", "content": "a long question " * 10}, {"role": "assistant", "content": "Yes."}]
    args = DataArguments(train_file=_write(tmp_path / "t.jsonl", [{"messages": short}] * 3 + [{"messages": long}] * 2),
                         validation_file=_write(tmp_path / "v.jsonl", [{"messages": long}, {"messages": short}]))
    task, said = ChatSFT(), []
    task.log = said.append
    out = task.tokenize(task.load_raw(args), tok, args, 32)
    assert (len(out["train"]), len(out["validation"])) == (3, 1)
    assert said == ["dropped the chats with no assistant token within block_size 32: 2 of 5 in the train split, 1 of "
                    "2 in the validation split (summary.json's dropped_rows)"]
    assert task.summary(None, None)["dropped_rows"] == {"train": 2, "validation": 1}


def test_a_mixture_on_a_stream_is_refused_naming_the_fields_that_were_set(tmp_path):
    """It was refused with "streams local files: set train_file (...), not dataset_name", a field the user never
    set."""
    a = _write(tmp_path / "a.jsonl", [{"text": "alpha"}])
    with pytest.raises(ConfigError) as err:
        DataArguments(dataset_mixture={"datasets": [{"id": a}]}, streaming=True)
    assert err.value.field_name == "dataset_mixture" and "dataset_name" not in err.value.message
    assert err.value.message.startswith("a mixture is drawn from whole sets, which a stream does not have: set "
                                        "streaming: false, or stream the files as train_file")

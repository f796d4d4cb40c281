"""Chat SFT and sequence classification, the units: the assistant-only label mask token by token, the chat checks,
labels from names or ids, the stratified split, class weights and the metrics against scikit-learn's definitions.
The multi-process runs of both recipes (and LoRA) are in test_recipes.py."""

from __future__ import annotations

import pytest
import torch
from datasets import ClassLabel, Dataset

from toolkit.data.chat import check_messages, set_chat_template, tokenize_chat
from toolkit.data.loading import CausalLMCollator
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX, count_targets
from toolkit.tasks.classification import (
    ClassificationCollator,
    encode_labels,
    resolve_class_weights,
    row_losses,
    scores,
)

# A template in the ChatML style whose end of turn is the tokenizer's EOS (GPT-2's <|endoftext|>).
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does pass do?"},
        {"role": "assistant", "content": "Nothing at all."},
        {"role": "user", "content": "And break?"},
        {"role": "assistant", "content": "It leaves the loop."}]


@pytest.fixture(scope="module")
def tokenizer():
    from toolkit.models.offline import gpt2_tokenizer

    tok = gpt2_tokenizer()
    set_chat_template(tok, TEMPLATE)
    return tok


def test_only_assistant_turns_and_their_end_of_turn_are_targets(tokenizer):
    ids, labels = tokenize_chat(tokenizer, CHAT)
    eos = tokenizer.eos_token
    # the whole rendering, token for token: the ids an inference call on the whole chat gives
    assert ids == tokenizer.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    targets = [(i, tok) for i, (tok, lab) in enumerate(zip(ids, labels)) if lab != IGNORE_INDEX]
    assert all(labels[i] == ids[i] for i, _ in targets)  # a target's label is its own id (the loss shifts)
    # the targets are exactly the two answers, each ending with its EOS; then nothing else
    runs, run = [], []
    for k, (i, tok) in enumerate(targets):
        run.append(tok)
        if k + 1 == len(targets) or targets[k + 1][0] != i + 1:
            runs.append(tokenizer.decode(run))
            run = []
    assert runs == [f"Nothing at all.{eos}", f"It leaves the loop.{eos}"]
    # every token before the first answer is prompt: system, user and the template's markers
    first = targets[0][0]
    assert tokenizer.decode(ids[:first]) == tokenizer.apply_chat_template(CHAT[:2], tokenize=False,
                                                                          add_generation_prompt=True)
    assert all(lab == IGNORE_INDEX for lab in labels[:first])
    # the newline the template writes after each EOS is formatting, not a target
    assert tokenizer.decode(ids[-1]) == "\n" and labels[-1] == IGNORE_INDEX


def test_the_collator_keeps_a_chat_mask_and_counts_its_targets(tokenizer):
    rows = [dict(zip(("input_ids", "labels"), tokenize_chat(tokenizer, CHAT))),
            dict(zip(("input_ids", "labels"), tokenize_chat(tokenizer, CHAT[:3])))]
    batch = CausalLMCollator(tokenizer.eos_token_id)(rows)  # GPT-2 has no pad token; load_tokenizer uses EOS
    assert batch["labels"][1, len(rows[1]["labels"]):].eq(IGNORE_INDEX).all()  # pads are no targets
    assert batch["num_targets"] == int(count_targets(batch["labels"]))
    assert batch["num_targets"] == sum(sum(1 for x in r["labels"][1:] if x != IGNORE_INDEX) for r in rows)


# The three tokenizer families: SentencePiece (Metaspace: Llama 2, Mistral, Gemma, T5), byte-level BPE (GPT-2),
# WordPiece (BERT, uncased: all-MiniLM-L6-v2; [CLS] and [SEP] as BOS and end of turn).
FAMILIES = ("sentencepiece", "byte-level-bpe", "wordpiece")


@pytest.fixture
def gpt2():
    """A GPT-2 tokenizer of the test's own, for a test that sets another chat template."""
    from toolkit.models.offline import gpt2_tokenizer

    return gpt2_tokenizer()


@pytest.fixture(params=FAMILIES)
def family_tokenizer(request):
    from transformers import AutoTokenizer

    from toolkit.models.offline import gpt2_tokenizer, minilm_path

    if request.param == "sentencepiece":
        tok = AutoTokenizer.from_pretrained(request.getfixturevalue("sentencepiece_tokenizer"))
    elif request.param == "byte-level-bpe":
        tok = gpt2_tokenizer()
    else:
        tok = AutoTokenizer.from_pretrained(minilm_path())
        tok.bos_token, tok.eos_token = "[CLS]", "[SEP]"
    return request.param, tok


def _target_runs(labels) -> list[tuple[int, int]]:
    """[first, last] token index of each run of consecutive targets."""
    runs = []
    for i, label in enumerate(labels):
        if label != IGNORE_INDEX:
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
    return [tuple(r) for r in runs]


@pytest.mark.parametrize("template", [TEMPLATE, "{{ bos_token }}" + TEMPLATE], ids=["no-bos", "bos"])
def test_chat_ids_are_apply_chat_templates_and_the_targets_are_the_answers(family_tokenizer, template):
    """Before the fix, the SentencePiece chats failed the first assertion: each piece tokenized alone started with a
    '▁' (``'▁No'`` where the whole chat has ``'No'``, a ``'▁'`` before each newline after an answer)."""
    family, tok = family_tokenizer
    tok.chat_template = template
    ids, labels = tokenize_chat(tok, CHAT)
    assert ids == tok.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    assert all(label in (IGNORE_INDEX, i) for i, label in zip(ids, labels))
    if template.startswith("{{ bos_token }}"):
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # written once, by the template
    # the target tokens cover exactly each answer and its end of turn, and nothing else is a target
    full = tok.apply_chat_template(CHAT, tokenize=False)
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    answers = [m["content"] + tok.eos_token for m in CHAT if m["role"] == "assistant"]
    runs = _target_runs(labels)
    assert [full[offsets[i][0]:offsets[j][1]] for i, j in runs] == answers
    decoded = [tok.decode(ids[i:j + 1]) for i, j in runs]
    if family == "wordpiece":  # uncased, and decode puts spaces around punctuation
        assert [d.replace(" ", "") for d in decoded] == [(m["content"].lower() + tok.eos_token).replace(" ", "")
                                                         for m in CHAT if m["role"] == "assistant"]
    else:
        assert decoded == answers


# A generation prompt that ends with a space: the answer's first token takes that space along ('ĠNothing', '▁No').
SPACED = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# One that ends inside a word the answer completes: 'Answ' + 'er: ...' is the one token 'Answer', mostly prompt.
WORD_SPLIT = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\nAnsw{% generation %}"
              "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
              "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\nAnsw{% endif %}")


def test_a_token_straddling_the_prompt_and_the_answer_is_a_target_when_at_least_half_of_it_is_answer(gpt2):
    chat = CHAT[:2] + [{"role": "assistant", "content": "Nothing at all."}, {"role": "user", "content": "And?"},
                       {"role": "assistant", "content": "I stop."}]
    tok, eos = gpt2, gpt2.eos_token
    tok.chat_template = SPACED
    ids, labels = tokenize_chat(tok, chat)
    assert ids == tok.apply_chat_template(chat, tokenize=True)["input_ids"]
    # 'ĠNothing': 1 prompt character (the space), 7 answer ones; 'ĠI': 1 and 1, a tie: both targets
    assert [tok.convert_ids_to_tokens(ids[i]) for i, _ in _target_runs(labels)] == ["ĠNothing", "ĠI"]
    assert [tok.decode(ids[i:j + 1]) for i, j in _target_runs(labels)] == [f" Nothing at all.{eos}", f" I stop.{eos}"]
    # 'Answer': 4 prompt characters, 2 answer ones: prompt. HF's return_assistant_tokens_mask (any overlap) takes it.
    chat = CHAT[:2] + [{"role": "assistant", "content": "er: nothing."}]
    tok.chat_template = WORD_SPLIT
    ids, labels = tokenize_chat(tok, chat)
    hf = tok.apply_chat_template(chat, tokenize=True, return_assistant_tokens_mask=True)
    assert ids == hf["input_ids"]
    (first, last), = _target_runs(labels)
    assert tok.convert_ids_to_tokens(ids[first - 1]) == "Answer" and tok.decode(ids[first:last + 1]) == f": nothing.{eos}"
    mine = [int(label != IGNORE_INDEX) for label in labels]
    assert [k for k, (a, b) in enumerate(zip(mine, hf["assistant_masks"])) if a != b] == [first - 1]


def _generation_template(end: str) -> str:
    """TEMPLATE with each assistant turn's content + EOS (+ ``end``) in a ``{% generation %}`` block."""
    after = "" if end else "{{ '\\n' }}"  # a newline right after a block tag would be trimmed
    return ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }}{{ eos_token }}" + end + "{% endgeneration %}" + after + "{% else %}{{ m['content'] }}"
            "{{ eos_token }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_the_mask_is_return_assistant_tokens_masks_where_generation_marks_content_and_end_of_turn(family_tokenizer):
    family, tok = family_tokenizer
    tok.chat_template = TEMPLATE
    plain = tok.apply_chat_template(CHAT, tokenize=False)
    tok.chat_template = _generation_template("")
    assert tok.apply_chat_template(CHAT, tokenize=False) == plain
    ids, labels = tokenize_chat(tok, CHAT)
    hf = tok.apply_chat_template(CHAT, tokenize=True, return_assistant_tokens_mask=True)
    assert ids == hf["input_ids"]
    assert [int(label != IGNORE_INDEX) for label in labels] == hf["assistant_masks"]
    # with the newline after the EOS inside the block, HF's mask takes the newline token too; ours stops at the EOS
    tok.chat_template = _generation_template("\n")
    assert tok.apply_chat_template(CHAT, tokenize=False) == plain
    hf = tok.apply_chat_template(CHAT, tokenize=True, return_assistant_tokens_mask=True)
    ids, labels = tokenize_chat(tok, CHAT)
    differ = [k for k, label in enumerate(labels) if int(label != IGNORE_INDEX) != hf["assistant_masks"][k]]
    ends = [j + 1 for _, j in _target_runs(labels)]
    assert differ == ([] if family == "wordpiece" else ends)  # WordPiece drops the newline: no token
    assert all(tok.decode(ids[k]) == "\n" for k in differ)


def test_a_template_that_rewrites_earlier_turns_is_refused(gpt2):
    gpt2.chat_template = "{{ messages | length }}\n" + TEMPLATE  # the count changes as the chat grows
    with pytest.raises(ConfigError, match="^chat_template: .*renders earlier turns differently"):
        tokenize_chat(gpt2, CHAT)


class _WithoutOffsets:
    """A tokenizer seen as a Python (slow) one: no character offsets."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, **kwargs):
        assert "return_offsets_mapping" not in kwargs
        return self._tok(text, **kwargs)


def test_a_tokenizer_without_offsets_is_cut_at_the_turns_and_refused_where_that_changes_the_ids(
        tokenizer, sentencepiece_tokenizer):
    from transformers import AutoTokenizer

    assert tokenize_chat(_WithoutOffsets(tokenizer), CHAT) == tokenize_chat(tokenizer, CHAT)  # byte-level: same ids
    sp = AutoTokenizer.from_pretrained(sentencepiece_tokenizer)
    sp.chat_template = TEMPLATE
    with pytest.raises(ConfigError, match="^tokenizer_name: .*no character offsets"):
        tokenize_chat(_WithoutOffsets(sp), CHAT)


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ([{"role": "assistant", "content": "hi"}], "starts with an assistant turn"),
    ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}], "unknown role"),
    ("just text", "expected a list"),
])
def test_bad_chats_are_refused_by_row(messages, message):
    with pytest.raises(ConfigError, match=message):
        check_messages(messages, "row 3")


def test_a_tokenizer_without_a_chat_template_is_refused():
    from toolkit.models.offline import gpt2_tokenizer

    with pytest.raises(ConfigError, match="chat_template"):
        set_chat_template(gpt2_tokenizer(), None)


def test_labels_from_names_and_ids():
    names = Dataset.from_dict({"label": ["b", "a", "b", "c"]})
    encoded, classes = encode_labels(names, "label", None, "train")
    assert classes == ["a", "b", "c"] and list(encoded["label"]) == [1, 0, 1, 2]
    assert isinstance(encoded.features["label"], ClassLabel)
    with pytest.raises(ConfigError, match="never"):
        encode_labels(Dataset.from_dict({"label": ["d"]}), "label", classes, "validation")
    ids, classes = encode_labels(Dataset.from_dict({"label": [0, 2, 1, 2]}), "label", None, "train")
    assert classes == ["0", "1", "2"]
    with pytest.raises(ConfigError, match="one class"):
        encode_labels(Dataset.from_dict({"label": ["a", "a"]}), "label", None, "train")


def test_balanced_class_weights_are_scikit_learns():
    train, names = encode_labels(Dataset.from_dict({"label": ["a"] * 6 + ["b"] * 2}), "label", None, "train")
    weights = resolve_class_weights(["balanced"], train, names)
    assert torch.allclose(weights, torch.tensor([8 / (2 * 6), 8 / (2 * 2)]))
    with pytest.raises(ConfigError, match="3 weights for 2 classes"):
        resolve_class_weights(["1", "2", "3"], train, names)


def test_weighted_loss_is_the_mean_over_examples_of_weighted_cross_entropy():
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 2, 0])
    weights = torch.tensor([1.0, 2.0, 0.5])
    plain = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    assert torch.allclose(row_losses(logits, labels, weights), plain * weights[labels])


def test_accuracy_and_macro_f1_match_their_definitions():
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    predictions = torch.tensor([0, 1, 1, 1, 2, 0, 3])  # class 3 only predicted: it counts (F1 0), as in sklearn
    got = scores(predictions, labels)
    f1 = {0: 2 * 1 / (2 * 1 + 1 + 1), 1: 2 * 2 / (2 * 2 + 1 + 0), 2: 2 * 1 / (2 * 1 + 0 + 2), 3: 0.0}
    assert got["accuracy"] == pytest.approx(4 / 7)
    assert got["macro_f1"] == pytest.approx(sum(f1.values()) / 4)


def test_classification_collator_counts_examples():
    batch = ClassificationCollator(0)([{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [5], "labels": 0}])
    assert batch["labels"].tolist() == [1, 0] and batch["num_targets"] == 2 and batch["num_tokens"] == 4
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize("recipe, task_class", [("gpt2.py", "CausalLM"), ("sft.py", "ChatSFT"),
                                                ("classify.py", "SequenceClassification")])
def test_each_recipe_runs_its_defaults_with_only_model_data_and_output(recipe, task_class, tiny_model, padded_data,
                                                                       tmp_path):
    """A new user's first command names only the model, the data and the output folder: every recipe's task must
    accept its own defaults (chat SFT once refused the default packing: true). Unset packing is the task's default;
    an explicit packing: true packs whole chats for chat SFT (bfd; wrapped refused) and stays refused for the
    classifier (one example per row)."""
    import os

    from helpers import RECIPE

    from toolkit.config import parse_args
    from toolkit.tasks.classification import SequenceClassification
    from toolkit.tasks.lm import CausalLM
    from toolkit.tasks.sft import ChatSFT

    source = open(os.path.join(os.path.dirname(RECIPE), recipe)).read()
    assert f"{task_class}()" in source or (task_class == "CausalLM" and "build(cfg, accelerator)" in source)
    task = {"CausalLM": CausalLM, "ChatSFT": ChatSFT, "SequenceClassification": SequenceClassification}[task_class]()
    argv = ["--model_name_or_path", tiny_model, "--train_file", padded_data["train_file"],
            "--output_dir", str(tmp_path / "out")]
    cfg = parse_args(argv)
    task.check(cfg)
    assert cfg.data.packing is (task_class == "CausalLM")
    explicit = parse_args([*argv, "--packing", "true"])
    if task_class == "SequenceClassification":
        for extra in (["--packing", "true"], ["--packing_strategy", "bfd"]):
            with pytest.raises(ConfigError, match="one example per row"):
                task.check(parse_args([*argv, *extra]))
    else:
        task.check(explicit)
        assert explicit.data.packing is True
        assert explicit.data.packing_strategy == ("wrapped" if task_class == "CausalLM" else "bfd")
    if task_class == "ChatSFT":
        with pytest.raises(ConfigError, match="packing_strategy: chat SFT packs whole chats only"):
            task.check(parse_args([*argv, "--packing", "true", "--packing_strategy", "wrapped"]))
        implied = parse_args([*argv, "--packing_strategy", "bfd"])
        task.check(implied)
        assert implied.data.packing is True


def test_a_set_too_small_for_a_stratified_holdout_is_one_line_naming_the_field(tmp_path):
    """datasets' ValueError from train_test_split(stratify_by_column=...) reached the user raw."""
    import json

    from toolkit.config import DataArguments
    from toolkit.tasks.classification import load_raw_labelled

    path = tmp_path / "few.jsonl"
    rows = [("a fine day", "good"), ("a bad day", "bad"), ("so so", "meh"), ("great", "good"), ("awful", "bad")]
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    with pytest.raises(ConfigError) as err:
        load_raw_labelled(DataArguments(train_file=str(path), validation_split_percentage=20))
    assert err.value.field_name == "validation_split_percentage"
    assert err.value.message.startswith("a stratified validation split of 20% of the 5 training rows (1 rows, ")
    assert err.value.message.endswith("class 'meh' of column 'label' has 1 row, and each class needs one in each "
                                      "part; give more rows of it, give a validation_file, or "
                                      "validation_split_percentage: 0 to train without evaluation")
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows + rows))  # 10 rows
    with pytest.raises(ConfigError, match="2 held-out row.s. cannot hold each of the 3 classes of column 'label'; "
                                          "raise validation_split_percentage to at least 30"):
        load_raw_labelled(DataArguments(train_file=str(path), validation_split_percentage=20))


def test_a_classifiers_validation_file_without_its_columns_is_one_line_naming_it(tmp_path):
    import json

    from toolkit.config import DataArguments
    from toolkit.tasks.classification import load_raw_labelled

    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("".join(json.dumps({"text": f"row {i}", "label": i % 2}) + "\n" for i in range(6)))
    valid.write_text("".join(json.dumps({"text": f"row {i}", "topic": i % 2}) + "\n" for i in range(4)))
    with pytest.raises(ConfigError) as err:
        load_raw_labelled(DataArguments(train_file=str(train), validation_file=str(valid)))
    assert (err.value.field_name, err.value.message) == (
        "validation_file", f"{valid} has the columns ['text', 'topic'], without ['label']: this recipe reads "
                           "['text', 'label'] (train_file has ['text', 'label']); give the validation rows those "
                           "columns")

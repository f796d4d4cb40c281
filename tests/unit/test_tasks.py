"""Chat SFT and sequence classification, the units: the assistant-only label mask token by token, the chat checks,
labels from names or ids, the stratified split, class weights and the metrics against scikit-learn's definitions.
The multi-process runs of both recipes (and LoRA) are in test_recipes.py."""

from __future__ import annotations

import pytest
import torch
from datasets import ClassLabel, Dataset

from toolkit.chat import check_messages, set_chat_template, tokenize_chat
from toolkit.classification import ClassificationCollator, encode_labels, resolve_class_weights, row_losses, scores
from toolkit.data import CausalLMCollator
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX, count_targets

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
    from toolkit.offline import gpt2_tokenizer

    tok = gpt2_tokenizer()
    set_chat_template(tok, TEMPLATE)
    return tok


def test_only_assistant_turns_and_their_end_of_turn_are_targets(tokenizer):
    ids, labels = tokenize_chat(tokenizer, CHAT)
    eos = tokenizer.eos_token
    # the whole rendering, token for token
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
    from toolkit.offline import gpt2_tokenizer

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

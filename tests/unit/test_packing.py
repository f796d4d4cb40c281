"""Padding-free packing (``packing_strategy: bfd``, toolkit/data/packing.py), in process: the bins, a packed micro-batch
against the same documents unpacked (GPT-2 and Llama, sdpa and eager), the guard against transformers' silent
fallbacks, and chat SFT's per-chat masks in packed rows. The 2-rank runs are in tests/launch/test_strategies.py."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset, DatasetDict

from toolkit.config import DataArguments
from toolkit.data.loading import CausalLMCollator, tokenize_and_group
from toolkit.data.order import GlobalBatchSampler
from toolkit.data.packing import (
    ROW_LENGTHS,
    SEQ_LENGTHS,
    best_fit_decreasing,
    check_packed_attention,
    collate_packed,
)
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX, token_losses
from toolkit.tasks.base import model_inputs
from toolkit.tasks.lm import CausalLM


def test_best_fit_decreasing_puts_each_item_where_it_fills_a_bin_most():
    lengths = [3, 7, 5, 2, 6, 4, 1, 4]
    bins = best_fit_decreasing(lengths, 10)
    # longest first: 7 -> bin 0 (3 left), 6 -> bin 1 (4 left), 5 -> bin 2 (5 left), 4 (index 5) -> bin 1, the fullest
    # that fits (0 left), 4 (index 7) -> bin 2 (1 left), 3 -> bin 0 (0 left), 2 -> new bin 3, 1 -> bin 2 (0 left)
    assert bins == [[1, 0], [4, 5], [2, 7, 6], [3]]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert best_fit_decreasing(lengths, 10) == bins  # a function of the lengths alone
    with pytest.raises(ValueError, match="exceeds"):
        best_fit_decreasing([11], 10)


def test_bins_fill_and_cover_every_document_once():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 120, (2000,), generator=g).tolist()
    bins = best_fit_decreasing(lengths, 256)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    assert sum(lengths) / (256 * len(bins)) > 0.97  # padded per batch of 4, the same lengths fill ~55%


@pytest.fixture(scope="module")
def tok(bpe_2048):
    return bpe_2048  # the tiny models' tokenizer (conftest.py)


def _texts(n: int) -> list[str]:
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)[:10]).split()
    out, at = [], 0
    for i in range(n):
        size = 1 + (i * 5) % 23
        out.append(" ".join(words[at:at + size]))
        at += size
    return out


def test_bfd_rows_are_whole_documents_the_same_on_any_world_size(tok):
    """The rows are the unpacked run's documents (truncated to block_size as unpacked, EOS-ended), whole, a few per row;
    built twice they are identical, and the global batches of 1 process x 8 and 2 ranks x 2 x 2 hold the same rows."""
    raw = DatasetDict({"train": Dataset.from_dict({"text": _texts(60)})})
    bfd = tokenize_and_group(raw, tok, DataArguments(packing=True, packing_strategy="bfd"), block_size=48)["train"]
    docs = tokenize_and_group(raw, tok, DataArguments(packing=False), block_size=48)["train"]["input_ids"]
    assert tokenize_and_group(raw, tok, DataArguments(packing=True, packing_strategy="bfd"),
                              block_size=48)["train"].to_dict() == bfd.to_dict()
    pieces = []
    for row in bfd:
        assert len(row["input_ids"]) == sum(row[SEQ_LENGTHS]) <= 48
        at = 0
        for n in row[SEQ_LENGTHS]:
            pieces.append(row["input_ids"][at:at + n])
            at += n
    assert sorted(pieces) == sorted(docs)
    assert len(bfd) < len(docs) / 2
    one = GlobalBatchSampler(len(bfd), 8, 1, 1, seed=3)
    two = GlobalBatchSampler(len(bfd), 2, 2, 2, seed=3)
    assert [one.global_batch(0, s) for s in range(one.steps_per_epoch)] == [
        sorted(two.global_batch(0, s), key=one.global_batch(0, s).index) for s in range(two.steps_per_epoch)]


def test_the_packed_collator_flattens_the_rows_restarts_positions_and_cuts_targets_at_each_document():
    """One row of every document side by side (transformers' DataCollatorWithFlattening's layout, its ids, labels
    and positions exactly), no padding: the counts are the three documents' unpacked, every position a real token."""
    from transformers import DataCollatorWithFlattening

    rows = [{"input_ids": [5, 6, 7, 8, 9], SEQ_LENGTHS: [3, 2]}, {"input_ids": [1, 2], SEQ_LENGTHS: [2]}]
    b = collate_packed(rows)
    assert "attention_mask" not in b
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert b["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 2]]
    assert b[ROW_LENGTHS].tolist() == [5, 2]
    # targets: 2 + 1 in row 0, 1 in row 1, as the three documents unpacked; 7 real tokens in 7 positions
    assert (b["num_targets"], b["num_tokens"], b["num_slots"]) == (4, 7, 7)
    theirs = DataCollatorWithFlattening()([{"input_ids": d} for d in ([5, 6, 7], [8, 9], [1, 2])])
    assert {k: theirs[k].tolist() for k in theirs} == {k: b[k].tolist() for k in theirs}
    assert CausalLMCollator(0)(rows)["position_ids"].tolist() == b["position_ids"].tolist()


def test_the_flattened_micro_batch_gives_flash_attention_the_documents():
    """What transformers' flash-attention path (modeling_flash_attention_utils) derives from a micro-batch without an
    attention mask, by its own functions: for the flattened row, packed sequences with ``cu_seqlens`` at every
    document of every row; for the same rows as a 2-row batch (the layout before flattening), no packed sequence at
    all (flash would run plain causal attention over each row: the documents attending to each other)."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    rows = [{"input_ids": list(range(1, 10)), SEQ_LENGTHS: [4, 3, 2]}, {"input_ids": [7, 8, 9, 10], SEQ_LENGTHS: [4]},
            {"input_ids": [3, 4, 5, 6, 7, 8], SEQ_LENGTHS: [1, 5]}]
    positions = collate_packed(rows)["position_ids"]
    assert _is_packed_sequence(positions, batch_size=positions.shape[0])
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(positions)
    assert cu_q.tolist() == cu_k.tolist() == [0, 4, 7, 9, 13, 14, 19]
    assert int(max_q) == int(max_k) == 5
    two_rows = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3, 4]])  # rows 0 and 2, side by side
    assert not _is_packed_sequence(two_rows, batch_size=2)


MODELS = ["gpt2", "llama"]
IMPLEMENTATIONS = ["sdpa", "eager"]


def _model(request, family: str, attn: str):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue("tiny_model" if family == "gpt2" else "tiny_llama")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    assert model.config.use_cache, "the default that builds a cache in the forward: what packed_inputs turns off"
    return model


def _documents(tok, n: int = 7) -> list[list[int]]:
    return [tok(t)["input_ids"][:30] + [tok.eos_token_id] for t in _texts(n + 3)[3:]]


@pytest.mark.parametrize("attn", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", MODELS)
def test_a_packed_micro_batch_trains_like_its_documents_unpacked(request, tok, family, attn):
    """Per-document summed losses equal, and the gradient of the summed loss equals, to 1e-6 of the largest gradient
    component: a micro-batch of two bfd rows (different lengths, so one is padded) against every document alone in a
    padded batch. The same check with transformers' defaults (a 2D mask, or the config's use_cache) fails (the
    guard's tests below)."""
    model = _model(request, family, attn)
    docs = _documents(tok)
    lengths = [len(d) for d in docs]
    bins = best_fit_decreasing(lengths, 64)
    assert len(bins) >= 2 and any(len(b) > 1 for b in bins)
    rows = [{"input_ids": [t for i in b for t in docs[i]], SEQ_LENGTHS: [lengths[i] for i in b]} for b in bins]

    def run(batch):
        model.zero_grad(set_to_none=True)
        logits = model(**model_inputs(batch)).logits  # the tasks' forward
        targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                               reduction="none").view(targets.shape)
        ce.sum().backward()
        return ce.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, logits.detach()

    packed_batch = collate_packed(rows)
    assert packed_batch["input_ids"].shape == (1, sum(lengths))
    packed_ce, packed_grads, packed_logits = run(packed_batch)
    per_doc_packed, per_row, at = {}, [], 0
    for b in bins:
        per_row.append(0.0)
        for i in b:
            per_doc_packed[i] = float(packed_ce[0, at:at + lengths[i]].sum())
            per_row[-1] += per_doc_packed[i]
            at += lengths[i]
    row_loss, row_targets = token_losses(packed_logits, packed_batch["labels"], packed_batch[ROW_LENGTHS])
    assert row_loss.tolist() == pytest.approx(per_row, rel=1e-5)  # the task's loss per packed row (evaluation's)
    assert row_targets.tolist() == [sum(lengths[i] - 1 for i in b) for b in bins]
    alone_batch = CausalLMCollator(tok.eos_token_id)([{"input_ids": d} for d in docs])
    alone_ce, alone_grads, _ = run(alone_batch)
    assert packed_batch["num_targets"] == alone_batch["num_targets"] == sum(n - 1 for n in lengths)
    for i in range(len(docs)):
        assert per_doc_packed[i] == pytest.approx(float(alone_ce[i].sum()), rel=1e-6, abs=1e-6)
    largest = max(float(g.abs().max()) for g in alone_grads.values())
    worst = max(float((packed_grads[n] - g).abs().max()) for n, g in alone_grads.items())
    print(f"{family} {attn}: max |dgrad| {worst:.2e} of largest {largest:.2e}")
    assert worst <= 1e-6 * largest


@pytest.mark.parametrize("family", MODELS)
def test_the_guard_passes_a_model_that_honours_packed_positions(request, tok, family):
    model = _model(request, family, "sdpa")
    docs = _documents(tok, 2)
    row = {"input_ids": docs[0] + docs[1], SEQ_LENGTHS: [len(docs[0]), len(docs[1])]}
    model.train()
    assert check_packed_attention(model, row) < 1e-5
    assert model.training  # the mode is given back


@pytest.mark.parametrize("default", ["a 2D attention mask", "a cache"])
@pytest.mark.parametrize("family", MODELS)
def test_the_guard_refuses_transformers_silent_fallbacks(request, tok, family, default, monkeypatch):
    """What transformers' defaults do to a packed row: an all-ones 2D mask (what a padding collator passes), or the
    config's use_cache=True (a DynamicCache is built in the forward) turns packed-sequence detection off, silently:
    the documents attend to each other. The guard sees it on the real model and refuses, naming the field."""
    model = _model(request, family, "sdpa")
    forward = model.forward

    def defaults(**kwargs):
        if default == "a cache":
            kwargs.pop("use_cache")  # the config's default: True
        else:
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        return forward(**kwargs)

    monkeypatch.setattr(model, "forward", defaults)
    docs = _documents(tok, 2)
    row = {"input_ids": docs[0] + docs[1], SEQ_LENGTHS: [len(docs[0]), len(docs[1])]}
    with pytest.raises(ConfigError, match="packing_strategy: .*does not honour packed position_ids"):
        check_packed_attention(model, row)


def test_chat_sft_packs_whole_chats_each_with_its_assistant_only_mask(tok):
    """Chats packed bfd are the unpacked chats (ids and label masks) side by side; the collated labels are each
    chat's mask, whose first token is a prompt token anyway: the targets are the assistant tokens of every chat."""
    from toolkit.data.chat import set_chat_template
    from toolkit.data.formats import convert_splits
    from toolkit.tasks.sft import tokenize_chats

    set_chat_template(tok, "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                           "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    texts = _texts(24)
    chats = [[{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 1]}]
             + ([{"role": "user", "content": "and?"}, {"role": "assistant", "content": texts[i + 2]}] if i % 3 else [])
             for i in range(0, 21)]
    raw = convert_splits(DatasetDict({"train": Dataset.from_dict({"messages": chats})}), "chat", DataArguments())
    alone = tokenize_chats(raw, tok, DataArguments(packing=False), block_size=256)["train"]
    packed = tokenize_chats(raw, tok, DataArguments(packing=True, packing_strategy="bfd"), block_size=256)["train"]
    assert len(packed) < len(alone)
    pieces = []
    for row in packed:
        at = 0
        for n in row[SEQ_LENGTHS]:
            pieces.append((row["input_ids"][at:at + n], row["labels"][at:at + n]))
            at += n
    assert sorted(pieces) == sorted(zip(alone["input_ids"], alone["labels"]))
    batch = CausalLMCollator(tok.eos_token_id)(list(packed))
    flat = 0
    for row in packed:
        at = 0
        for n in row[SEQ_LENGTHS]:
            assert row["labels"][at] == IGNORE_INDEX  # a chat starts with its prompt
            assert batch["labels"][0, flat:flat + n].tolist() == row["labels"][at:at + n]
            at, flat = at + n, flat + n
    assert batch["num_targets"] == sum(sum(x != IGNORE_INDEX for x in labels[1:]) for labels in alone["labels"])


def test_the_chunked_loss_of_a_packed_micro_batch_is_the_plain_one(request, tok):
    """``loss_chunk_size`` replaces the forward (toolkit.models.loading.enable_chunked_loss): it must pass the packed rows'
    position_ids on, or every document after the first would attend to the ones before it."""
    from toolkit.models.loading import enable_chunked_loss

    docs = _documents(tok, 4)
    lengths = [len(d) for d in docs]
    rows = [{"input_ids": [t for i in b for t in docs[i]], SEQ_LENGTHS: [lengths[i] for i in b]}
            for b in best_fit_decreasing(lengths, 64)]
    batch = collate_packed(rows)
    model = _model(request, "gpt2", "sdpa")
    with torch.no_grad():
        plain = CausalLM().row_losses(model, batch)
        enable_chunked_loss(model, 24, max_positions=batch["input_ids"].numel())
        chunked = CausalLM().row_losses(model, batch, chunked=True)
    assert torch.allclose(chunked, plain, rtol=1e-6, atol=1e-5)


def test_the_guard_refuses_a_model_that_ignores_packed_positions(request, tok, monkeypatch):
    """A model whose mask honours the packed position_ids but whose position embeddings count on from the row's start:
    no document sees another (the documents before it changing changes nothing), but the one after the first sits at
    the wrong positions, unlike the same document alone."""
    model = _model(request, "gpt2", "sdpa")
    wpe = model.transformer.wpe.forward
    monkeypatch.setattr(model.transformer.wpe, "forward",
                        lambda ids: wpe((torch.arange(ids.shape[-1]) % model.config.n_positions).expand_as(ids)))
    docs = _documents(tok, 2)
    row = {"input_ids": docs[0] + docs[1], SEQ_LENGTHS: [len(docs[0]), len(docs[1])]}
    with pytest.raises(ConfigError, match="differ by .* from the document run alone"):
        check_packed_attention(model, row)


def _pieces(rows) -> list[list[int]]:
    out = []
    for row in rows:
        at = 0
        for n in row[SEQ_LENGTHS]:
            out.append(list(row["input_ids"][at:at + n]))
            at += n
    return sorted(out)


def _long_docs(tok, block: int):
    """60 EOS-ended documents of the pydoc text, a few of them longer than ``block``, and their unpacked rows."""
    raw = DatasetDict({"train": Dataset.from_dict({"text": [" ".join([t] * (1 + i % 4)) for i, t in
                                                            enumerate(_texts(60))]})})
    docs = tokenize_and_group(raw, tok, DataArguments(packing=False), block_size=10_000)["train"]["input_ids"]
    assert sum(len(d) > block for d in docs) >= 5
    return raw, docs


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_bfd_cuts_and_bfd_split_keeps_long_documents_as_trl_packs_them_and_says_how_much(tok, strategy):
    """TRL's pack_dataset (the oracle) on the same documents gives the same pieces and as many rows: bfd keeps each
    document's first block_size tokens, bfd_split cuts a longer one into block_size pieces and a remainder (every
    token kept: the ids' multiset is the documents'). The log line counts the long documents and the cut tokens."""
    from trl.data_utils import pack_dataset

    from toolkit.data.packing import PACKING_REPORT

    block = 16
    raw, docs = _long_docs(tok, block)
    packed = tokenize_and_group(raw, tok, DataArguments(packing=True, packing_strategy=strategy), block_size=block)
    rows = packed["train"]
    assert all(len(r["input_ids"]) == sum(r[SEQ_LENGTHS]) <= block for r in rows)
    theirs = pack_dataset(Dataset.from_dict({"input_ids": docs}), block, strategy)
    assert _pieces(rows) == _pieces(theirs) and len(rows) == len(theirs)
    over = [len(d) for d in docs if len(d) > block]
    tokens = sorted(t for r in rows for t in r["input_ids"])
    if strategy == "bfd_split":
        assert tokens == sorted(t for d in docs for t in d)
        assert getattr(packed, PACKING_REPORT) == (
            f"packing_strategy bfd_split: {len(over)} of {len(docs)} training documents are longer than block_size "
            f"{block}: split into {sum(-(-n // block) for n in over)} pieces, each packed as a document of its own; "
            "no token dropped")
    else:
        assert tokens == sorted(t for d in docs for t in d[:block])
        cut, total = sum(n - block for n in over), sum(len(d) for d in docs)
        assert getattr(packed, PACKING_REPORT).startswith(
            f"packing_strategy bfd: {len(over)} of {len(docs)} training documents are longer than block_size {block}: "
            f"cut to it, {cut} of {total} tokens dropped ({100 * cut / total:.1f}%)")


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_a_stream_cuts_or_splits_long_documents_per_micro_batch_and_says_so(tiny_model, tmp_path, strategy):
    """A stream (toolkit.data.stream) packs each micro-batch's documents as the map-style data is packed: under bfd each
    cut to block_size, under bfd_split every token kept; the build logs the cut of the stream's first documents. The
    micro-batches are flattened into one row."""
    import json

    from transformers import AutoTokenizer

    from toolkit.config import config_from_dict
    from toolkit.training.build import build

    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = [" ".join([t] * (1 + i % 4)) for i, t in enumerate(_texts(24))]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = config_from_dict({"model_name_or_path": tiny_model, "train_file": str(path), "streaming": True,
                            "packing_strategy": strategy, "block_size": 16, "shuffle_buffer_size": 24,
                            "per_device_train_batch_size": 6, "gradient_accumulation_steps": 4, "max_steps": 1,
                            "output_dir": str(tmp_path / "out")})
    lines = []
    parts = build(cfg, log=lines.append)
    docs = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    over = [len(d) for d in docs if len(d) > 16]
    assert over
    report = [line for line in lines if line.startswith(f"packing_strategy {strategy}:")]
    assert len(report) == 1 and f"{len(over)} of 24 first documents of the stream are longer than block_size 16" in \
        report[0], lines
    batches = next(parts.train_dataset.steps())
    assert all(b["input_ids"].shape[0] == 1 and b["num_slots"] == b["num_tokens"] for b in batches)
    tokens = sorted(t for b in batches for t in b["input_ids"][0].tolist())
    assert tokens == sorted(t for d in docs for t in (d if strategy == "bfd_split" else d[:16]))


def _varlen_probe(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
    """A CPU stand-in for transformers' flash-attention dispatch (``_flash_attention_forward`` without a mask): the
    varlen kernel over the ``cu_seqlens`` transformers derives from ``position_ids``, by its own functions, only when
    ``_is_packed_sequence`` finds packed sequences; otherwise plain causal attention over each row (``flash_fn``)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    if attention_mask is None and _is_packed_sequence(position_ids, query.shape[0]):
        (cu, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)
        cu = cu.tolist()
        out = torch.cat([sdpa(query[:, :, a:e], key[:, :, a:e], value[:, :, a:e], is_causal=True, scale=scaling,
                              enable_gqa=True) for a, e in zip(cu, cu[1:])], dim=2)
    else:
        out = sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def test_the_guard_passes_flash_style_attention_on_the_flattened_layout_which_several_rows_would_break(request, tok):
    """Llama with an attention that dispatches as transformers' flash-attention does (``_varlen_probe``; its name
    must not hold "flash", which sends transformers to the real kernels): the guard passes, a flattened micro-batch
    gives sdpa's logits; the same documents as a micro-batch of 2 rows (the layout before flattening) attend across
    their documents, by far more than the guard's tolerance."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register("varlen_probe", _varlen_probe)
    ALL_MASK_ATTENTION_FUNCTIONS.register("varlen_probe", flash_attention_mask)  # flash's: no mask when causal
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue("tiny_llama"), attn_implementation="varlen_probe")
    sdpa = _model(request, "llama", "sdpa")
    docs = _documents(tok, 4)
    row = {"input_ids": docs[0] + docs[1], SEQ_LENGTHS: [len(docs[0]), len(docs[1])]}
    assert check_packed_attention(model, row) < 1e-5
    lengths = [len(d) for d in docs]
    rows = [{"input_ids": [t for i in b for t in docs[i]], SEQ_LENGTHS: [lengths[i] for i in b]}
            for b in best_fit_decreasing(lengths, 64)]
    batch = collate_packed(rows)
    with torch.no_grad():
        flat = model(**model_inputs(batch)).logits
        assert torch.allclose(flat, sdpa(**model_inputs(batch)).logits, atol=1e-5)
        two = {"input_ids": torch.tensor([row["input_ids"]] * 2), "use_cache": False,
               "position_ids": torch.tensor([list(range(len(docs[0]))) + list(range(len(docs[1])))] * 2)}
        alone = model(input_ids=torch.tensor([docs[1]]), use_cache=False).logits[0]
        leaked = model(**two).logits[0, len(docs[0]):]
    assert float((leaked - alone).abs().max()) > 100 * 1e-3 * max(float(alone.abs().max()), 1.0)


def test_attn_implementation_reaches_the_model_and_one_that_cannot_run_is_refused(tiny_model):
    from toolkit.config import ModelArguments
    from toolkit.models.loading import load_config, load_model

    args = ModelArguments(model_name_or_path=tiny_model, attn_implementation="eager")
    assert load_model(args, load_config(args)).config._attn_implementation == "eager"
    with pytest.raises(ConfigError, match="attn_implementation: .*needs its flash-attn package and a CUDA GPU"):
        load_config(ModelArguments(model_name_or_path=tiny_model, attn_implementation="flash_attention_2"))
    with pytest.raises(ConfigError, match="attn_implementation: unknown value 'sdpa2'; choose one of eager, sdpa"):
        ModelArguments(model_name_or_path=tiny_model, attn_implementation="sdpa2")

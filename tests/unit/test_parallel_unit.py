"""Tensor parallelism without a process: which checkpoint layouts a TP run may resume (``resume.load_plan``); a
sequence-parallel rank's part of a row (``toolkit.parallel.sequence.shard``), the ring's chunks and steps
(``toolkit.parallel.ring``). The real HSDP, TP and sequence-parallel runs are in tests/launch/test_parallel.py."""

import pytest

pytestmark = pytest.mark.slow  # as in tests/launch/test_parallel.py, where these tests were


@pytest.mark.parametrize("wrote, world, strategy, ranks, field", [
    ("tp", 2, "ddp", 2, "resume_from_checkpoint"),
    ("tp", 2, "tp", 4, "parallelism_config_tp_size"),
    ("ddp", 2, "tp", 2, "resume_from_checkpoint"),
])
def test_tensor_parallel_checkpoint_refused_on_another_layout(wrote, world, strategy, ranks, field):
    """A TP checkpoint loads only under TP with its tp_size (and no other strategy's under TP): refused before the
    weights load, naming the field and the launch that resumes it (the same check refused a real TP checkpoint under
    ddp.yaml before its weights loaded)."""
    from toolkit.checkpointing.resume import load_plan
    from toolkit.errors import ConfigError

    assert load_plan("ck", {"strategy": "tp", "loop": {"world_size": 2}}, "tp", 2) is None
    with pytest.raises(ConfigError) as e:
        load_plan("ck", {"strategy": wrote, "loop": {"world_size": world}}, strategy, ranks)
    config = "tp.yaml --num_processes 2 --parallelism_config_tp_size 2" if wrote == "tp" else "ddp.yaml"
    assert e.value.field_name == field and f"--config_file accelerate_configs/{config} <recipe>" in str(e.value)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sequence_parallel_shard_cuts_shifted_labels_and_pads_to_a_multiple(n):
    """The ranks' parts of a right-padded micro-batch (7 positions: padded to a multiple of n) put together are the
    whole row: the ids, the global positions, and the next-token targets shifted on the whole row before the cut (the
    target at each cut is kept once: shifting each part alone would lose it), the padding no target and at position 0
    (a row that fills a learned position table gets no position past it)."""
    import torch

    from toolkit.loss import IGNORE_INDEX, shift_labels
    from toolkit.parallel.sequence import SequenceGroup, shard

    ids = torch.arange(1, 15).view(2, 7)
    labels = ids.clone()
    labels[1, 4:] = IGNORE_INDEX  # the second row is 4 tokens, right-padded
    parts = [shard({"input_ids": ids, "labels": labels}, SequenceGroup(size=n, rank=r, group=None)) for r in range(n)]
    length = -(-7 // n) * n
    pad = length - 7
    assert {p[0].shape for p in parts} == {(2, length // n)}
    assert torch.equal(torch.cat([p[0] for p in parts], 1), torch.nn.functional.pad(ids, (0, pad)))
    # the split's padding at position 0: numbered on, it ran past GPT-2's position table when a row filled it
    assert torch.equal(torch.cat([p[1] for p in parts], 1),
                       torch.nn.functional.pad(torch.arange(7), (0, pad)).expand(2, -1))
    targets = torch.cat([p[2] for p in parts], 1)
    assert torch.equal(targets, torch.nn.functional.pad(shift_labels(labels), (0, pad), value=IGNORE_INDEX))
    assert (targets != IGNORE_INDEX).sum() == 6 + 3  # every target once: 6 in the full row, 3 in the short one
    assert all(p[3] is None for p in parts)  # padded rows: causal attention, no document mask


def test_sequence_parallel_packed_row_keeps_its_documents_apart():
    """A flattened packed row (documents of 3, 2 and 2 tokens, positions restarting): each rank gets its part of the
    row's own positions, and every rank the whole row's document ids (the padding: documents of their own), from
    which the attention's mask lets a position see only earlier positions of its document."""
    import torch

    from toolkit.data.packing import collate_packed
    from toolkit.parallel.sequence import SequenceGroup, _block_causal, shard

    batch = collate_packed([{"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]}, {"input_ids": [1, 2],
                                                                                    "seq_lengths": [2]}])
    parts = [shard(batch, SequenceGroup(size=3, rank=r, group=None)) for r in range(3)]
    assert torch.equal(torch.cat([p[1] for p in parts], 1), torch.tensor([[0, 1, 2, 0, 1, 0, 1, 0, 0]]))
    documents = parts[0][3]
    assert all(torch.equal(p[3], documents) for p in parts)
    assert documents.tolist() == [[1, 1, 1, 2, 2, 3, 3, 4, 5]]
    mask = _block_causal(documents)[0, 0]
    assert mask[2].tolist() == [True, True, True] + [False] * 6  # the first document's last token
    assert mask[4].tolist() == [False] * 3 + [True, True] + [False] * 4  # the second's: not the first document
    assert mask[8].tolist() == [False] * 8 + [True]  # a pad position sees itself only


@pytest.mark.parametrize("n", [2, 3])
def test_ring_shard_holds_a_head_and_a_tail_chunk(n):
    """Ring attention (``context_parallel_size``): the row is padded to a multiple of 2n and rank j keeps chunks j and
    2n-1-j (``ring.order``), with their global positions and the targets shifted on the whole row; the ranks' parts,
    put back in that order, are the whole padded row."""
    import torch

    from toolkit.loss import IGNORE_INDEX, shift_labels
    from toolkit.parallel.ring import order
    from toolkit.parallel.sequence import SequenceGroup, shard

    ids = torch.arange(1, 15).view(2, 7)
    parts = [shard({"input_ids": ids, "labels": ids.clone()}, SequenceGroup(size=n, rank=r, group=None, ring=True))
             for r in range(n)]
    length = -(-7 // (2 * n)) * 2 * n
    where = torch.cat([torch.arange(*span) for span in order(length, n)])  # the whole row's places, rank by rank
    positions = torch.nn.functional.pad(torch.arange(7), (0, length - 7))  # the split's padding at position 0
    assert torch.equal(torch.cat([p[1] for p in parts], 1), positions[where].expand(2, -1))
    assert torch.equal(torch.cat([p[0] for p in parts], 1), torch.nn.functional.pad(ids, (0, length - 7))[:, where])
    targets = torch.nn.functional.pad(shift_labels(ids), (0, length - 7), value=IGNORE_INDEX)
    assert torch.equal(torch.cat([p[2] for p in parts], 1), targets[:, where])
    assert order(8, 2) == [(0, 2), (6, 8), (2, 4), (4, 6)]  # rank 0: head 0 and tail 3; rank 1: chunks 1 and 2


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_steps_cover_the_causal_mask_once_with_equal_work(n):
    """Over its n steps each rank computes every (query, key) pair of the causal mask exactly once and no masked pair
    (the fully masked blocks skipped), and every rank computes as many pairs as every other at every step: the head
    and tail chunks balance the causal work."""
    from toolkit.parallel.ring import _blocks, order

    c = 3
    spans = order(2 * n * c, n)
    held = [[p for span in spans[2 * j:2 * j + 2] for p in range(*span)] for j in range(n)]  # rank j's positions
    seen, work = {}, [[0] * n for _ in range(n)]
    for rank in range(n):
        for step in range(n):
            keys = held[(rank - step) % n]
            for qs, ks, causal in _blocks(step, rank, n, c):
                for qi, q in enumerate(held[rank][qs]):
                    for ki, k in enumerate(keys[ks]):
                        if not causal or ki <= qi:
                            seen[q, k] = seen.get((q, k), 0) + 1
                            work[step][rank] += 1
    length = 2 * n * c
    assert seen == {(q, k): 1 for q in range(length) for k in range(q + 1)}
    assert all(len(set(row)) == 1 for row in work)


def _split_config(field: str):
    """What ``toolkit.parallel.sequence.check_run`` reads of a run's config: ``field`` (the ring's or Ulysses' size)
    2, the other 1, map-style padded data, the attention implementation left to the model."""
    from types import SimpleNamespace

    sizes = {"context_parallel_size": 1, "sequence_parallel_size": 1, field: 2}
    return SimpleNamespace(train=SimpleNamespace(split_size=2, split_field=field, **sizes),
                           data=SimpleNamespace(streaming=False, padding_free=False),
                           model=SimpleNamespace(attn_implementation=None))


def test_sequence_split_refuses_a_sliding_window_before_work():
    """A model whose layers attend within a sliding window (Qwen2's use_sliding_window, the capability matrix's Qwen2)
    is refused before any work under the ring or Ulysses, naming the field: both attend causally over the whole
    sequence (before, the run stopped in its first step with a RuntimeError)."""
    from types import SimpleNamespace

    from transformers import Qwen2Config

    from toolkit.errors import ConfigError
    from toolkit.parallel.sequence import check_run

    for field in ("context_parallel_size", "sequence_parallel_size"):
        cfg = _split_config(field)
        task = SimpleNamespace(name="causal-lm")
        windowed = Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               use_sliding_window=True, sliding_window=8, max_window_layers=0)
        with pytest.raises(ConfigError) as refused:
            check_run(cfg, task, windowed)
        assert str(refused.value).startswith(f"{field}: the model attends within a sliding window (8 positions)")
        check_run(cfg, task, Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


def test_sequence_split_refuses_chunked_attention_before_work():
    """Llama 4's chunked attention (``attention_chunk_size``: its "chunked_attention" layers, built into the mask) is
    refused before any work under the ring or Ulysses, naming the field: both attend causally over the whole
    sequence. Before, it ran and silently attended across the chunks (a tiny Llama 4 with chunks of 8, Ulysses 2
    against one process: 0.04 apart after 3 steps, its first loss the one of chunks of 64)."""
    from types import SimpleNamespace

    from transformers import Llama4TextConfig

    from toolkit.errors import ConfigError
    from toolkit.parallel.sequence import check_run

    small = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, attention_chunk_size=8)
    for field in ("context_parallel_size", "sequence_parallel_size"):
        cfg = _split_config(field)
        with pytest.raises(ConfigError) as refused:
            check_run(cfg, SimpleNamespace(name="causal-lm"), Llama4TextConfig(**small))
        assert str(refused.value) == (f"{field}: the model attends within chunks of 8 positions "
                                      f"(attention_chunk_size), which sequence parallelism does not: set {field} 1")
        check_run(cfg, SimpleNamespace(name="causal-lm"), Llama4TextConfig(**small, layer_types=["full_attention"] * 4))


def test_ring_refuses_attention_dropout_before_work():
    """GPT-2's default attention dropout (attn_pdrop 0.1: recipes/configs/gpt2.yaml's model, docs/strategies.md's ring
    command) under the ring is refused before any work, naming disable_dropout (before, the ranks stopped at the first
    step with a RuntimeError from the ring's attention, after the weights loaded); Ulysses runs it (its SDPA takes
    dropout), and so does the ring once the rate is 0 (what disable_dropout makes of the config: load_config)."""
    from types import SimpleNamespace

    from transformers import GPT2Config, LlamaConfig

    from toolkit.errors import ConfigError
    from toolkit.parallel.sequence import check_run

    task = SimpleNamespace(name="causal-lm")
    small = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    for dropped, name in ((GPT2Config(n_layer=1, n_head=2), "attn_pdrop 0.1"),
                          (LlamaConfig(**small, attention_dropout=0.1), "attention_dropout 0.1")):
        with pytest.raises(ConfigError) as refused:
            check_run(_split_config("context_parallel_size"), task, dropped)
        assert str(refused.value).startswith(f"disable_dropout: the model's attention dropout ({name}")
        check_run(_split_config("sequence_parallel_size"), task, dropped)
    check_run(_split_config("context_parallel_size"), task, GPT2Config(n_layer=1, n_head=2, attn_pdrop=0.0))
    check_run(_split_config("context_parallel_size"), task, LlamaConfig(**small))


def test_sequence_split_refuses_a_model_without_attention_interface_before_work():
    """A causal LM whose attention does not go through transformers' AttentionInterface (Falcon, Bloom: its
    ``_supports_attention_backend`` false) is refused before any work under the ring or Ulysses, naming the field.
    Before, ``set_attn_implementation`` only warned and kept SDPA, so each rank attended within its own part of the
    sequence: a tiny Falcon under the ring on 2 ranks ended 0.019 from one process after 3 steps, silently."""
    from types import SimpleNamespace

    from transformers import BloomConfig, FalconConfig, GPT2Config, LlamaConfig

    from toolkit.errors import ConfigError
    from toolkit.parallel.sequence import check_run

    for field in ("context_parallel_size", "sequence_parallel_size"):
        cfg = _split_config(field)
        task = SimpleNamespace(name="causal-lm")
        for config, name in ((FalconConfig(num_attention_heads=4), "FalconForCausalLM"),
                             (BloomConfig(n_head=4), "BloomForCausalLM")):
            with pytest.raises(ConfigError) as refused:
                check_run(cfg, task, config)
            assert str(refused.value).startswith(f"{field}: {name} does not route its attention through "
                                                 "transformers' AttentionInterface")
        check_run(cfg, task, GPT2Config(n_head=2, attn_pdrop=0.0))
        check_run(cfg, task, LlamaConfig(num_attention_heads=4, num_key_value_heads=2))

"""The global sample order is a function of (seed, epoch, step) only: the same on any world size and accumulation."""

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, prepare_data_loader
from accelerate.state import PartialState
from torch.utils.data import DataLoader

from toolkit.data.order import GlobalBatchSampler


def _per_step(world, micro, accum, epoch=0, n=70, seed=3):
    s = GlobalBatchSampler(n, micro, world, accum, seed=seed, shuffle=True)
    s.use_epoch(epoch)
    batches = list(s)
    per_step = world * accum
    return [sorted(i for b in batches[j : j + per_step] for i in b) for j in range(0, len(batches), per_step)]


def test_same_global_batches_for_any_layout():
    ref = _per_step(1, 8, 1)
    assert len(ref) == 70 // 8
    assert _per_step(2, 2, 2) == ref
    assert _per_step(1, 2, 4) == ref
    assert _per_step(4, 1, 2) == ref


def test_epochs_differ_and_cover_without_repeats():
    e0, e1 = _per_step(2, 2, 2, epoch=0), _per_step(2, 2, 2, epoch=1)
    assert e0 != e1
    flat = [i for step in e0 for i in step]
    assert len(flat) == len(set(flat)) == 8 * (70 // 8)


def test_rank_interleaving_matches_accelerate_sharding():
    """BatchSamplerShard gives micro-batch i to rank i % world; our emission order makes those disjoint slices."""
    s = GlobalBatchSampler(16, 2, 2, 2, seed=0, shuffle=False)
    batches = list(s)
    assert batches[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # step 0: (m0 r0) (m0 r1) (m1 r0) (m1 r1)
    assert len(s) == len(batches) == 8


def _rank_batches(sampler, world):
    """Each rank's micro-batches as accelerate deals them: ``prepare_data_loader`` wraps a DataLoader built with
    ``batch_sampler=`` in ``BatchSamplerShard(batch_sampler, num_processes, process_index, split_batches=False,
    even_batches=accelerator.even_batches)``; even_batches defaults to True and the toolkit leaves it so (with our
    drop_last=True it would change nothing either way)."""
    shards = [BatchSamplerShard(sampler, num_processes=world, process_index=r, split_batches=False, even_batches=True)
              for r in range(world)]
    return [list(shard) for shard in shards], [len(shard) for shard in shards]


@pytest.mark.parametrize("world,micro,accum", [(2, 2, 2), (4, 1, 2), (3, 2, 2)])
def test_accelerate_sharding_gives_each_rank_its_slice_of_the_global_batch(world, micro, accum):
    """Through accelerate's real BatchSamplerShard: rank r's m-th micro-batch of step s is rows
    [(m * world + r) * micro, +micro) of global_batch(epoch, s), and the ranks together cover the global batch."""
    sampler = GlobalBatchSampler(70, micro, world, accum, seed=3, shuffle=True)
    seen = []
    for epoch in (0, 1):
        sampler.use_epoch(epoch)
        per_rank, lengths = _rank_batches(sampler, world)
        assert lengths == [len(b) for b in per_rank] == [sampler.steps_per_epoch * accum] * world
        for step in range(sampler.steps_per_epoch):
            rows = sampler.global_batch(epoch, step)
            got = []
            for r in range(world):
                for m in range(accum):
                    start = (m * world + r) * micro
                    assert per_rank[r][step * accum + m] == rows[start : start + micro], (epoch, step, r, m)
                    got += per_rank[r][step * accum + m]
            assert sorted(got) == sorted(rows) and len(set(got)) == len(rows) == sampler.global_batch_size
        seen.append([i for b in per_rank[0] for i in b])
    assert seen[0] != seen[1]  # use_epoch really changed what the shards deal out


@pytest.mark.parametrize("dp,sp,micro,accum", [(1, 2, 4, 2), (2, 2, 2, 2), (1, 4, 4, 2)])
def test_sequence_parallel_copies_give_a_groups_ranks_the_same_rows(dp, sp, micro, accum):
    """``copies``: each micro-batch emitted sp times in a row, so through accelerate's BatchSamplerShard over all
    dp x sp ranks the sp consecutive ranks of a group (rank = replica x sp + j) take the same micro-batches, and the
    groups take what dp plain ranks would (the global batches unchanged)."""
    plain = GlobalBatchSampler(70, micro, dp, accum, seed=3, shuffle=True)
    split = GlobalBatchSampler(70, micro, dp, accum, seed=3, shuffle=True, copies=sp)
    want, _ = _rank_batches(plain, dp)
    got, lengths = _rank_batches(split, dp * sp)
    assert lengths == [len(b) for b in got] == [plain.steps_per_epoch * accum] * (dp * sp)
    assert got == [want[rank // sp] for rank in range(dp * sp)]
    assert split.global_batch_size == plain.global_batch_size and len(split) == len(plain) * sp


def test_prepare_data_loader_uses_the_same_sharding():
    """The stand-in above is what accelerate's own prepare_data_loader builds and yields (for 2 ranks, on CPU,
    without a process group: process_index is passed in)."""
    sampler = GlobalBatchSampler(70, 2, 2, 2, seed=3, shuffle=True)
    dl = DataLoader(list(range(70)), batch_sampler=sampler, collate_fn=list)
    fresh = not PartialState._shared_state
    try:
        for epoch in (0, 1):
            sampler.use_epoch(epoch)
            expected, _ = _rank_batches(sampler, 2)
            for r in range(2):
                prepared = prepare_data_loader(dl, device=torch.device("cpu"), num_processes=2, process_index=r,
                                               put_on_device=False)
                shard = prepared.batch_sampler
                assert isinstance(shard, BatchSamplerShard) and shard.batch_sampler is sampler
                assert (shard.split_batches, shard.even_batches, shard.drop_last) == (False, True, True)
                assert list(prepared) == expected[r]
    finally:
        if fresh:  # prepare_data_loader initialised accelerate's process-wide state: leave none to later tests
            PartialState._reset_state()

"""The global sample order: which rows each rank sees in each micro-step. Owned here, not by the DataLoader.

Why: with ``shuffle=True`` and the same seed, accelerate's prepared DataLoader gives one process and two processes
different global batches (docs/pitfalls.md#sample-order). Training that is "the same on any world size" and a resume
that is exact need the order to be a pure function of (seed, epoch, position), independent of the world size and of
the accumulation. So:

    epoch e:  perm = randperm(N, seed + e)        (or arange(N) with shuffle off)
    step s:   global batch  G_s = perm[s*B : (s+1)*B],   B = world * micro * accum
    the tail  N mod B rows of the epoch are left out (every optimizer step sees exactly B rows)
    repeats r: each row of perm listed r times in a row (GRPO: a prompt's group of num_generations completions; the
              epoch is then N*r rows)
    copies c:  each micro-batch emitted c times in a row, so that the c consecutive ranks of a sequence-parallel group
              (``toolkit.parallel.sequence``) take the same rows; ``num_processes`` is then the data-parallel size

Each global batch is cut into ``accum * world`` micro-batches of ``micro`` rows, emitted in the order
(micro-step 0: rank 0, rank 1, ..., micro-step 1: rank 0, ...). accelerate's ``BatchSamplerShard`` (split_batches=False)
hands micro-batch i to rank i % world, so rank r's k-th micro-batch of step s is exactly our slice for (s, k, r), and
``accelerator.prepare`` / ``skip_first_batches`` keep working on our sampler unchanged.

Which rank gets which rows within a step does not change the step's gradient: the loss of a step is normalised by the
target tokens of the whole global batch (see ``toolkit.loss``), so any partition of G_s gives the same update.
"""

from __future__ import annotations

import torch
from torch.utils.data import Sampler

from toolkit.errors import ConfigError


def require_one_global_batch(num_samples: int, micro_batch_size: int, num_processes: int, accumulation: int) -> None:
    """Refuse a training set smaller than one global batch (every step must see exactly one full global batch)."""
    global_batch = micro_batch_size * num_processes * accumulation
    if num_samples < global_batch:
        raise ConfigError(
            "per_device_train_batch_size",
            f"the training set has {num_samples} rows, fewer than one global batch ({num_processes} ranks x "
            f"{micro_batch_size} x {accumulation} accumulation = {global_batch}); lower the batch or accumulation",
        )


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields every rank's micro-batches for one epoch, interleaved so that ``BatchSamplerShard`` can deal them out."""

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        num_processes: int,
        gradient_accumulation_steps: int,
        seed: int,
        shuffle: bool = True,
        repeats: int = 1,
        copies: int = 1,
    ):
        self.num_samples = num_samples
        self.batch_size = micro_batch_size  # accelerate reads .batch_size to know the per-rank batch
        self.num_processes = num_processes
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = True  # accelerate: no wrap-around padding; every rank gets full micro-batches
        self.epoch = 0
        self.repeats = repeats  # each row listed this many times in a row (GRPO: a prompt's group of completions)
        self.copies = copies  # each micro-batch emitted this many times in a row (a sequence-parallel group's ranks)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_processes * self.gradient_accumulation_steps

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples * self.repeats // self.global_batch_size

    # Deliberately not called ``set_epoch``: accelerate's DataLoaderShard calls ``set_epoch(self.iteration)`` on
    # every ``__iter__`` with its own counter, which restarts at 0 on the loader ``skip_first_batches`` builds for a
    # resume (docs/pitfalls.md#set-epoch). Our epoch is the loop's state, set only by the loop.
    def use_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            order = torch.arange(self.num_samples)
        else:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g)
        return order.repeat_interleave(self.repeats) if self.repeats > 1 else order

    def global_batch(self, epoch: int, step: int) -> list[int]:
        """The rows of optimizer step ``step`` (0-based, within ``epoch``), whatever the world size."""
        b = self.global_batch_size
        return self.epoch_order(epoch)[step * b : (step + 1) * b].tolist()

    def __iter__(self):
        order = self.epoch_order(self.epoch)
        b, micro = self.global_batch_size, self.batch_size
        for step in range(self.steps_per_epoch):
            rows = order[step * b : (step + 1) * b].tolist()
            for i in range(0, b, micro):  # micro-step-major, rank-minor: see the module docstring
                for _ in range(self.copies):
                    yield rows[i : i + micro]

    def __len__(self) -> int:
        return self.steps_per_epoch * self.gradient_accumulation_steps * self.num_processes * self.copies

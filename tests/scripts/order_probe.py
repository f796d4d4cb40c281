"""Which rows each rank sees per micro-step, through accelerate's prepared DataLoader and our sampler.

Usage: order_probe.py OUT_JSON N MICRO ACCUM SEED [SKIP_STEPS [OUT_JSON SKIP_STEPS ...]]
Runs 2 epochs; with SKIP_STEPS it starts epoch 0 at that step via skip_first_batches, as a resume does. Each further
OUT_JSON SKIP_STEPS pair is one more pass in the same ranks, with a DataLoader and sampler of its own (as a resumed
process builds them), so that one launch serves several orders.
"""

import json
import sys

from torch.utils.data import DataLoader

from toolkit.config import TrainingArguments
from toolkit.data.order import GlobalBatchSampler
from toolkit.parallel.accelerator import make_accelerator

out, n, micro, accum, seed = sys.argv[1], *map(int, sys.argv[2:6])
passes = [(out, int(sys.argv[6]) if len(sys.argv) > 6 else 0)]
rest = sys.argv[7:]
passes += [(rest[i], int(rest[i + 1])) for i in range(0, len(rest), 2)]
accelerator = make_accelerator(TrainingArguments(output_dir="/tmp/order_probe", report_to="none",
                                         gradient_accumulation_steps=accum))
from accelerate.utils import gather_object  # noqa: E402

for out, skip in passes:
    sampler = GlobalBatchSampler(n, micro, accelerator.num_processes, accum, seed=seed, shuffle=True)
    dl = accelerator.prepare(DataLoader(list(range(n)), batch_sampler=sampler))
    seen = []  # [epoch][step] -> rows of this rank, by micro-step
    for epoch in range(2):
        sampler.use_epoch(epoch)
        start = skip if epoch == 0 else 0
        it = iter(accelerator.skip_first_batches(dl, start * accum) if start else dl)
        steps = []
        for _ in range(start, sampler.steps_per_epoch):
            steps.append([next(it).tolist() for _ in range(accum)])
        seen.append(steps)
    everyone = gather_object([seen])
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"ranks": everyone, "num_processes": accelerator.num_processes}, f)

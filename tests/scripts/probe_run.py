"""The real recipe (recipes/gpt2.py), plus two test probes passed as callbacks:

- counts DDP gradient all-reduces per micro-step with a DDP communication hook (proves no_sync skips them);
- records the trained model's logits on a fixed input, to compare with what final/ loads back.
Writes ``probe/comm_rank{R}.json`` and ``probe/logits.pt`` into output_dir.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipes"))
import gpt2  # noqa: E402  the recipe itself, unchanged

PROBE_IDS = torch.arange(100, 124).view(2, 12)


class Probe:
    def __init__(self):
        self.calls = 0
        self.per_micro_step = []  # (step, micro_step, all-reduce calls during that backward)
        self.output_dir = None

    def on_prepared(self, accelerator, model, optimizer):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):
                self.calls += 1
                return allreduce_hook(state, bucket)

            model.register_comm_hook(None, counting_hook)

    def on_micro_step(self, accelerator, state, micro_step):
        self.per_micro_step.append((state.step, micro_step, self.calls))
        self.calls = 0

    def on_end(self, accelerator, model, summary):
        out = os.path.join(summary["final_model"], "..", "probe")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"comm_rank{accelerator.process_index}.json"), "w") as f:
            json.dump({"per_micro_step": self.per_micro_step, "distributed_type": summary["distributed_type"],
                       "num_processes": accelerator.num_processes, "model_type": type(model).__name__}, f)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=PROBE_IDS.to(accelerator.device)).logits.float().cpu()
        if accelerator.is_main_process:
            torch.save(logits, os.path.join(out, "logits.pt"))


if __name__ == "__main__":
    from toolkit.config import cli

    cli(lambda: gpt2.main(callbacks=[Probe()]))

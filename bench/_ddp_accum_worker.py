"""One rank of ``bench/ddp_accumulation.py``: the toolkit's real loop (``toolkit.training.loop.train``, as recipes/gpt2.py runs
it) with a callback that counts and times every all-reduce.

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 bench/_ddp_accum_worker.py \\
        --bench_out OUT.json [--bench_alternate_no_sync] <any toolkit field, e.g. --gradient_accumulation_steps 4>

- DDP's gradient all-reduces: a communication hook registered on the prepared DDP model counts each bucket, its bytes,
  and the time from the bucket being handed over to its (asynchronous, gloo) all-reduce completing, then does what
  DDP does by default (``allreduce_hook``: all-reduce, divide by the world size).
- Every other all-reduce (the loop's one small all-reduce of the step's token counts; metrics on logging steps):
  ``torch.distributed.all_reduce`` wrapped, counted and timed.
- ``--bench_alternate_no_sync``: on every even-numbered optimizer step (2, 4, ...) the DDP model's ``no_sync`` is
  replaced by a null context, so accelerate's ``accumulate`` cannot skip the all-reduce of the first k-1 micro-steps
  (what accumulation costs without no_sync); odd steps run as the toolkit runs them. Each step's record says which.
Each rank writes ``OUT.json`` with ``.rank{R}`` before the suffix.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class CommCounter:
    def __init__(self, alternate_no_sync: bool):
        self.alternate_no_sync = alternate_no_sync
        self.lock = threading.Lock()
        self.steps = []  # one dict per optimizer step
        self.micro = []  # bucket all-reduces issued during each micro-step's backward, this step
        self._reset()
        self.last_end = None
        self.other_sites = {}  # where the non-bucket all-reduces come from (toolkit file:line:function), all steps

    def _reset(self):
        self.buckets = self.bucket_bytes = self.other = 0
        self.bucket_s, self.other_s = [], 0.0
        self.first_start = self.last_done = None

    def on_prepared(self, accelerator, model, optimizer):
        self.model = model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):
                started = time.perf_counter()
                with self.lock:
                    self.buckets += 1
                    self.bucket_bytes += bucket.buffer().numel() * bucket.buffer().element_size()
                    self.first_start = self.first_start or started
                self._in_hook = True
                try:
                    fut = allreduce_hook(state, bucket)
                finally:
                    self._in_hook = False

                def done(f):
                    now = time.perf_counter()
                    with self.lock:
                        self.bucket_s.append(now - started)
                        self.last_done = now
                    return f.value()

                return fut.then(done)

            model.register_comm_hook(None, counting_hook)
        self._in_hook = False
        original = dist.all_reduce

        def all_reduce(*args, **kwargs):  # the hook's own all-reduce goes through here too: not counted twice
            if self._in_hook:
                return original(*args, **kwargs)
            started = time.perf_counter()
            out = original(*args, **kwargs)
            site = _call_site()
            self.other_sites[site] = self.other_sites.get(site, 0) + 1
            self.other += 1
            self.other_s += time.perf_counter() - started
            return out

        dist.all_reduce = all_reduce
        torch.distributed.all_reduce = all_reduce
        self.last_end = time.perf_counter()

    def on_micro_step(self, accelerator, state, micro_step):
        self.micro.append(self.buckets - sum(self.micro))

    def on_step_end(self, accelerator, state, row):
        now = time.perf_counter()
        with self.lock:
            self.steps.append({
                "step": state.step, "step_s": now - self.last_end, "bucket_allreduces": self.buckets,
                "bucket_allreduces_per_micro_step": self.micro, "bucket_bytes": self.bucket_bytes,
                "bucket_allreduce_s": sum(self.bucket_s),
                "bucket_allreduce_span_s": (self.last_done - self.first_start) if self.buckets else 0.0,
                "other_allreduces": self.other, "other_allreduce_s": self.other_s, "logged": row is not None,
                "no_sync": "no_sync" not in vars(self.model),
            })
            self._reset()
        self.micro = []
        if self.alternate_no_sync:  # the next step (state.step + 1) without no_sync when it is even
            if (state.step + 1) % 2 == 0:
                self.model.no_sync = contextlib.nullcontext  # accelerate's accumulate() reads model.no_sync
            else:
                vars(self.model).pop("no_sync", None)  # DDP's own again
        self.last_end = time.perf_counter()

    def on_end(self, accelerator, model, summary):
        path = os.environ["BENCH_OUT"]
        root, ext = os.path.splitext(path)
        with open(f"{root}.rank{accelerator.process_index}{ext}", "w") as f:
            json.dump({"rank": accelerator.process_index, "world": accelerator.num_processes,
                       "model_type": type(model).__name__, "threads": torch.get_num_threads(),
                       "alternate_no_sync": self.alternate_no_sync, "steps": self.steps,
                       "other_allreduce_sites": self.other_sites, "tokens_per_s": summary["tokens_per_s"]}, f)


def _call_site() -> str:
    """The innermost caller in toolkit/ (else the outermost non-library frame)."""
    import traceback

    frames = traceback.extract_stack()[:-2]
    for fr in reversed(frames):
        if f"{os.sep}toolkit{os.sep}" in fr.filename:
            return f"toolkit/{os.path.basename(fr.filename)}:{fr.lineno}:{fr.name}"
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}:{frames[-1].name}"


def main():
    alternate = "--bench_alternate_no_sync" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--bench_alternate_no_sync"]
    if "--bench_out" in sys.argv:
        i = sys.argv.index("--bench_out")
        os.environ["BENCH_OUT"] = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    from toolkit.config import parse_args
    from toolkit.parallel.accelerator import make_accelerator
    from toolkit.training.build import build
    from toolkit.training.loop import train

    cfg = parse_args()
    accelerator = make_accelerator(cfg.train)
    parts = build(cfg, accelerator)
    return train(cfg, accelerator, **parts.train_kwargs(), callbacks=[CommCounter(alternate)])


if __name__ == "__main__":
    from toolkit.cli.recipe import cli

    cli(main)

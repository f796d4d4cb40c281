"""Optimizer-step time: toolkit's ``train_step`` vs a bare accelerate loop vs transformers' ``Trainer``.

    python bench/step_speed.py [--rounds 3 --steps 4 --layers 4 --width 256 --seq 256 --micro 4 --accum 2]

The same job for all: a GPT-2 shape (vocab 50257) built from a config with one seed, the same packed pydoc rows,
micro batch x accumulation x sequence, the same AdamW implementation (``--optim``: adamw_torch, torch's foreach kernel,
or adamw_torch_fused, Trainer's default since 4.x; lr 1e-4), clipping at 1.0, fp32, one process.

Across processes, each system as a user runs it: ``toolkit`` keeps freed host memory for reuse as ``train`` does on a
CPU (``toolkit/env/host_memory.py``), ``bare`` and ``trainer`` run with glibc's defaults, and ``toolkit_glibc`` is the
toolkit without that setting. Each (system, round) runs in a fresh process, the systems interleaved round by round so
that a slow moment of the machine hits all of them; one warm-up step, then ``--steps`` timed optimizer steps.
Reported: each system's median step time over all rounds and the ratios to the toolkit.

In one process, the step itself (``--paired-steps``, all with freed memory kept, which also removes most of the
noise): toolkit and the bare loop on two copies of the model, alternating step by step; and toolkit and ``Trainer``,
the toolkit's step run from Trainer's own ``on_step_begin``/``on_step_end`` callbacks (alternately before and after
Trainer's timed step) with Trainer's accelerator. Writes ``bench/results/step_speed_<optim>.json``, ``.md`` and
``.png``. Trainer gets ``model.loss_type = "ForCausalLM"``: without it transformers 5.24 divides GPT-2's summed loss by
the wrong count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
SYSTEMS = ("toolkit", "toolkit_glibc", "bare", "trainer")


def _setup(opts):
    sys.path.insert(0, ROOT)
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.config import DataArguments
    from toolkit.data.loading import CausalLMCollator, load_raw_datasets, tokenize_and_group
    from toolkit.models.offline import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    args = DataArguments(dataset_name="pydoc", packing=True)
    rows = tokenize_and_group(load_raw_datasets(args), tokenizer, args, opts.seq)["train"]
    n = opts.micro * (opts.steps + 1) * opts.accum
    rows = rows.select(range(n))
    torch.manual_seed(0)
    config = GPT2Config(n_layer=opts.layers, n_embd=opts.width, n_head=max(1, opts.width // 64), n_positions=opts.seq,
                        vocab_size=50257)
    model = GPT2LMHeadModel(config)
    return model, rows, CausalLMCollator(tokenizer.eos_token_id)


def _micro_batches(rows, collator, micro):
    return [collator([rows[i + j] for j in range(micro)]) for i in range(0, len(rows), micro)]


def bare_step(accelerator, model, optimizer, scheduler, micro) -> None:
    """The bare loop every accelerate example writes: the model's own loss, accumulate, clip, step."""
    for batch in micro:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"]).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def _trainer(model, rows, collator, opts, steps: int, callback):
    """Trainer on the same job: steps + 1 optimizer steps (the first a warm-up), no logging or saving."""
    from transformers import Trainer, TrainingArguments

    model.loss_type = "ForCausalLM"
    targs = TrainingArguments(output_dir=os.path.join(opts.workdir, "trainer"), per_device_train_batch_size=opts.micro,
                              gradient_accumulation_steps=opts.accum, max_steps=steps + 1, learning_rate=1e-4,
                              max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=10**6, save_strategy="no",
                              report_to=[], use_cpu=True, dataloader_drop_last=True, disable_tqdm=True,
                              remove_unused_columns=False, optim=opts.optim, weight_decay=0.0)
    return Trainer(model=model, args=targs, train_dataset=rows, data_collator=collator, callbacks=[callback])


def run_one(system: str, opts) -> list[float]:
    """In this (fresh) process: the step times of one system."""
    import torch

    model, rows, collator = _setup(opts)  # puts the repository on sys.path
    if system == "toolkit":
        from toolkit.env.host_memory import keep_freed_memory

        keep_freed_memory()  # as toolkit.training.loop.train does on a CPU (cpu_memory_reuse)
    times = []
    if system == "trainer":
        from transformers import TrainerCallback

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                times.append(time.perf_counter() - self.t)

        _trainer(model, rows, collator, opts, opts.steps, Clock()).train()
        return times[1:]

    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=opts.accum, sync_with_dataloader=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                                  fused=True if opts.optim == "adamw_torch_fused" else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    batches = _micro_batches(rows, collator, opts.micro)
    model.train()
    for step in range(opts.steps + 1):
        micro = batches[step * opts.accum:(step + 1) * opts.accum]
        started = time.perf_counter()
        if system.startswith("toolkit"):
            from toolkit.training.loop import train_step

            train_step(accelerator, model, optimizer, scheduler, micro, step=step, data_parallel_size=1,
                       max_grad_norm=1.0)
        else:
            bare_step(accelerator, model, optimizer, scheduler, micro)
        times.append(time.perf_counter() - started)
    return times[1:]


def paired(opts) -> dict:
    """The step itself, in one process with freed memory kept (so that which step lands on fresh pages does not decide
    the ratio): toolkit against the bare loop, then toolkit against Trainer. Who goes first alternates step by step."""
    import copy

    import torch
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    model, rows, collator = _setup(opts)  # puts the repository on sys.path
    from toolkit.env.host_memory import keep_freed_memory
    from toolkit.training.loop import train_step

    keep_freed_memory()
    # Four copies of the same weights: toolkit and bare, then Trainer and the toolkit beside it.
    bare_model, trainer_model, toolkit_beside_trainer = (copy.deepcopy(model) for _ in range(3))
    fused = True if opts.optim == "adamw_torch_fused" else None
    batches = _micro_batches(rows, collator, opts.micro)
    per_step = len(batches) // opts.accum

    def micro_of(step):
        return batches[(step % per_step) * opts.accum:(step % per_step + 1) * opts.accum]

    def prepared(accelerator, m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.0, fused=fused)
        return accelerator.prepare(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0))

    def timed(accelerator, step_fn, *args) -> float:
        accelerator.step = 0  # accelerate's micro-step counter: k micro-steps from a boundary
        started = time.perf_counter()
        step_fn(accelerator, *args)
        return time.perf_counter() - started

    def toolkit_step(accelerator, parts, step):
        return timed(accelerator, lambda acc: train_step(acc, *parts, micro_of(step), step=step, data_parallel_size=1,
                                                         max_grad_norm=1.0))

    # toolkit vs bare: one accelerator, two copies of the model.
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=opts.accum, sync_with_dataloader=False))
    toolkit_parts, bare_parts = prepared(accelerator, model), prepared(accelerator, bare_model)
    times = {"toolkit": [], "bare": [], "toolkit_in_trainer": [], "trainer": []}
    for step in range(opts.paired_steps + 1):
        for name in ("toolkit", "bare") if step % 2 else ("bare", "toolkit"):
            if name == "toolkit":
                took = toolkit_step(accelerator, toolkit_parts, step)
            else:
                took = timed(accelerator, bare_step, *bare_parts, micro_of(step))
            if step:  # the first is a warm-up
                times[name].append(took)

    # toolkit vs Trainer: Trainer runs its own loop; the toolkit's step runs from its callbacks, on Trainer's
    # accelerator. Trainer sets accelerate's accumulation count to 1 and flags the boundary itself; the toolkit's step
    # asks accelerate for the boundary, so while it runs the count is k and the end of Trainer's loader is no boundary.
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        step = 0

        def toolkit(self):
            gradient_state = trainer.accelerator.gradient_state
            trainers = gradient_state.plugin_kwargs
            gradient_state.plugin_kwargs = {**trainers, "num_steps": opts.accum, "sync_with_dataloader": False}
            took = toolkit_step(trainer.accelerator, self.parts, self.step)
            gradient_state.plugin_kwargs = trainers
            if self.step:
                times["toolkit_in_trainer"].append(took)

        def on_train_begin(self, *args, **kwargs):
            self.parts = prepared(trainer.accelerator, toolkit_beside_trainer)
            self.parts[0].train()

        def on_step_begin(self, *args, **kwargs):
            if self.step % 2 and self.step <= opts.paired_steps:
                self.toolkit()
            self.started = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            if self.step:
                times["trainer"].append(time.perf_counter() - self.started)
            if not self.step % 2 and self.step <= opts.paired_steps:
                self.toolkit()
            self.step += 1

    trainer = _trainer(trainer_model, rows, collator, opts, opts.paired_steps, Alternate())
    trainer.train()
    return times


def write_results(results: dict, opts, pair: dict | None = None) -> None:
    medians = {s: statistics.median(t) for s, t in results.items() if t}
    out = {"job": vars(opts) | {"workdir": None}, "step_times": results, "median_step_s": medians}
    if pair:
        out["paired_step_times"] = pair
        med = {k: statistics.median(v) for k, v in pair.items()}
        out["paired_toolkit_over_bare"] = med["toolkit"] / med["bare"]
        out["paired_trainer_over_toolkit"] = med["trainer"] / med["toolkit_in_trainer"]
    if "toolkit" in medians:
        for other in ("bare", "trainer", "toolkit_glibc"):
            out[f"{other}_over_toolkit"] = medians[other] / medians["toolkit"] if other in medians else None
    os.makedirs(RESULTS, exist_ok=True)
    name = f"step_speed_{opts.optim}"
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(out, f, indent=2)
    tokens = opts.micro * opts.accum * opts.seq
    lines = ["| system | median optimizer step | tokens/s | vs toolkit |", "| --- | --- | --- | --- |"]
    for s, m in medians.items():
        lines.append(f"| {s} | {m:.3f} s | {tokens / m:,.0f} | {m / medians['toolkit']:.3f}x |")
    if pair:
        lines.append(f"\nIn one process, freed memory kept, alternating step by step ({len(pair['toolkit'])} steps "
                     f"each): toolkit / bare = {out['paired_toolkit_over_bare']:.3f}, Trainer / toolkit = "
                     f"{out['paired_trainer_over_toolkit']:.3f}")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in out.items() if k.endswith("bare") or k.endswith("toolkit")}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.boxplot([results[s] for s in medians], tick_labels=list(medians))
    ax.set_ylabel("optimizer step (s)")
    ax.set_title(f"{opts.layers}x{opts.width} GPT-2, {opts.micro}x{opts.accum}x{opts.seq} tokens, {opts.optim}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch")
    parser.add_argument("--paired-steps", type=int, default=20, help="steps of each in-process pairing")
    parser.add_argument("--workdir", default="/tmp/toolkit-bench")
    parser.add_argument("--one", choices=SYSTEMS + ("paired",), help=argparse.SUPPRESS)  # the child mode
    opts = parser.parse_args()
    if opts.one:
        print("TIMES " + json.dumps(paired(opts) if opts.one == "paired" else run_one(opts.one, opts)))
        return
    child = [a for a in sys.argv[1:]]
    results = {s: [] for s in opts.systems.split(",")}
    for r in range(opts.rounds):
        for system in results:
            proc = subprocess.run([sys.executable, __file__, *child, "--one", system], capture_output=True, text=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("TIMES ")), None)
            if line is None:
                raise SystemExit(f"{system} failed:\n{proc.stderr[-4000:]}")
            results[system] += json.loads(line[6:])
            print(f"round {r + 1} {system}: {statistics.median(json.loads(line[6:])):.3f} s/step", flush=True)
    pair = None
    if {"toolkit", "bare"} <= set(results) and opts.paired_steps:
        proc = subprocess.run([sys.executable, __file__, *child, "--one", "paired"], capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        line = next((x for x in proc.stdout.splitlines() if x.startswith("TIMES ")), None)
        if line is None:
            raise SystemExit(f"paired run failed:\n{proc.stderr[-4000:]}")
        pair = json.loads(line[6:])
    write_results(results, opts, pair)


if __name__ == "__main__":
    main()

"""Achieved FLOP/s of a GPT-2 124M training step on this CPU, against the machine's fp32 GEMM rate.

    python bench/flops.py [--rounds 3 --batch 2 --seq 256 --gemm 2048,4096 --sweep-steps 2] [--no-sweep]

One process, fp32, GPT-2 124M built from ``GPT2Config()`` (12 x 768, vocab 50257, dropout as the config has it), the
same random tokens for every step. Two systems on two copies of the same weights:

- bare: ``model(input_ids, labels=input_ids).loss.backward()``, clip at 1.0, ``torch.optim.AdamW.step()``;
- toolkit: ``toolkit.training.loop.train_step`` (the toolkit's loss ``toolkit.loss.token_losses`` + ``micro_step_loss``, clip at
  1.0, the optimizer from ``toolkit.training.loop.build_optimizer``, ``adamw_torch``) on an Accelerator from
  ``toolkit.parallel.accelerator.make_accelerator``.

FLOPs per step: ``toolkit.reporting.accounting.flops_per_token`` (6N + 12 L d T; N without the position table) x tokens; the
FLOP/s of a step is that over its wall time. The reference: ``torch.mm`` of square fp32 matrices (``--gemm`` sizes,
the best size counts) with the same threads, measured in every round between the steps. The systems and the GEMM
are interleaved round by round (who goes first alternates), and each step's FLOP/s is divided by the GEMM rate of
its own round, so a slow moment of the machine shows in both (reported: median and min-max over rounds). The same
share is also computed from the fastest step and GEMM of the run ("best"), and from CPU time (FLOPs per CPU second
of this process, all threads, of the step over those of the GEMM), which other processes' load distorts less.

The sweep (``--no-sweep`` to skip; ``--sweep`` picks settings by name) changes one setting of the toolkit step at a
time and runs it alternately with the unchanged toolkit step (``--sweep-steps`` pairs after a warm-up): threads,
optimizer, dropout, GELU kernel, batch shape, and the helpful ones together. Reported: each setting's step FLOP/s as a
share of the GEMM rate, and its wall and CPU time per token against the unchanged step's. The process keeps freed
memory for reuse as ``train`` does on a CPU (``toolkit/env/host_memory.py``; ``--glibc-malloc`` leaves glibc's defaults),
for every system alike. Writes
``bench/results/flops.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
TMP = tempfile.mkdtemp(prefix="flops-")  # the output_dir TrainingArguments asks for; nothing is written there; removed at exit



def sweep_settings(batch: int, seq: int) -> dict:
    """One change at a time against the toolkit's unchanged step; the last combines the ones expected to help."""
    return {
        "1 thread": {"threads": 1},
        "adamw_torch_fused": {"optim": "adamw_torch_fused"},
        "dropout 0": {"dropout": 0.0},
        "gelu_pytorch_tanh": {"activation": "gelu_pytorch_tanh"},
        f"batch {2 * batch} x {seq}": {"batch": 2 * batch},
        f"batch {max(1, batch // 2)} x {2 * seq}": {"batch": max(1, batch // 2), "seq": 2 * seq},
        "fused + dropout 0 + gelu_pytorch_tanh": {"optim": "adamw_torch_fused", "dropout": 0.0,
                                                  "activation": "gelu_pytorch_tanh"},
    }


def gemm_rate(sizes: list[int], reps: int = 3) -> tuple[float, float]:
    """FLOP/s of ``torch.mm`` on square fp32 matrices, per wall second and per CPU second of this process (all
    threads): for each size the median of ``reps`` products after a warm-up; the best size counts."""
    import torch

    best_wall = best_cpu = 0.0
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        c = torch.mm(a, b)
        wall, cpu = [], []
        for _ in range(reps):
            started, cpu0 = time.perf_counter(), time.process_time()
            torch.mm(a, b, out=c)
            wall.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu0)
        best_wall = max(best_wall, 2 * n**3 / statistics.median(wall))
        best_cpu = max(best_cpu, 2 * n**3 / statistics.median(cpu))
        del a, b, c
    return best_wall, best_cpu


def build_model(setting: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    kwargs = {}
    if "dropout" in setting:
        kwargs.update(resid_pdrop=setting["dropout"], embd_pdrop=setting["dropout"], attn_pdrop=setting["dropout"])
    if "activation" in setting:
        kwargs["activation_function"] = setting["activation"]
    config = GPT2Config(**kwargs)
    if "attn" in setting:
        config._attn_implementation = setting["attn"]
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class Step:
    """One system's model, optimizer and step function on a fixed batch."""

    def __init__(self, system: str, model, setting: dict, accelerator, batch: int, seq: int):
        import torch
        from transformers import get_scheduler

        from toolkit.config import TrainingArguments
        from toolkit.data.loading import CausalLMCollator
        from toolkit.reporting.accounting import count_parameters, flops_per_token, model_shape
        from toolkit.training.loop import build_optimizer

        self.system, self.setting = system, setting
        self.threads = setting.get("threads")
        layers, width = model_shape(model.config)
        self.tokens = batch * seq
        self.flops = flops_per_token(count_parameters(model), layers, width, seq) * self.tokens
        g = torch.Generator().manual_seed(1)
        rows = [{"input_ids": torch.randint(0, 50257, (seq,), generator=g).tolist()} for _ in range(batch)]
        self.batch = CausalLMCollator(50256)(rows)
        optim = setting.get("optim", "adamw_torch")
        if system == "bare":
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=optim == "adamw_torch_fused" or None)
        else:
            args = TrainingArguments(output_dir=TMP, optim=optim, learning_rate=1e-4,
                             report_to="none", lr_scheduler_type="constant")
            optimizer = build_optimizer(model, args)
            scheduler = get_scheduler("constant", optimizer)
            self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
            self.accelerator = accelerator
        self.model.train()
        self.count = 0

    def __call__(self) -> tuple[float, float]:
        """One optimizer step; its wall seconds and this process's CPU seconds (all threads)."""
        import torch

        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        started, cpu = time.perf_counter(), time.process_time()
        if self.system == "bare":
            loss = self.model(input_ids=self.batch["input_ids"], labels=self.batch["labels"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            from toolkit.training.loop import train_step

            train_step(self.accelerator, self.model, self.optimizer, self.scheduler, [self.batch], step=self.count,
                       data_parallel_size=1, max_grad_norm=1.0)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        torch.set_num_threads(before)
        self.count += 1
        return seconds, cpu


def make_accelerator():
    from toolkit.config import TrainingArguments
    from toolkit.parallel.accelerator import make_accelerator as make

    return make(TrainingArguments(output_dir=TMP, report_to="none"))


def main_comparison(opts, accelerator, sizes) -> dict:
    """bare vs toolkit vs GEMM, interleaved over rounds."""
    base = build_model({})
    steps = {"bare": Step("bare", copy.deepcopy(base), {}, accelerator, opts.batch, opts.seq),
             "toolkit": Step("toolkit", base, {}, accelerator, opts.batch, opts.seq)}
    for _ in range(3):  # warm-up: optimizer state, and the kept heap growing to its plateau (a few steps)
        for s in steps.values():
            s()
    rounds = []
    for r in range(opts.rounds):
        before = gemm_rate(sizes)
        row = {}
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            row[f"{name}_s"], row[f"{name}_cpu_s"] = steps[name]()
        after = gemm_rate(sizes)
        row["gemm_flops"], row["gemm_flops_per_cpu_s"] = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        for name in steps:
            row[f"{name}_flops"] = steps[name].flops / row[f"{name}_s"]
            row[f"{name}_of_gemm"] = row[f"{name}_flops"] / row["gemm_flops"]
            row[f"{name}_of_gemm_cpu"] = steps[name].flops / row[f"{name}_cpu_s"] / row["gemm_flops_per_cpu_s"]
        rounds.append(row)
        print(f"round {r + 1}: GEMM {row['gemm_flops'] / 1e9:.0f} GFLOP/s, bare {row['bare_s']:.2f} s "
              f"({row['bare_of_gemm']:.1%}; CPU time {row['bare_of_gemm_cpu']:.1%}), toolkit {row['toolkit_s']:.2f} s "
              f"({row['toolkit_of_gemm']:.1%}; CPU time {row['toolkit_of_gemm_cpu']:.1%})", flush=True)
    flops = steps["toolkit"].flops
    del steps, base
    accelerator.free_memory()  # the prepared models and optimizers it still references
    gc.collect()
    return {"flops_per_step": flops, "rounds": rounds}


def sweep(opts, accelerator, sizes) -> dict:
    """Each setting's toolkit step alternating with the unchanged toolkit step (one model, warmed up once)."""
    out = {}
    default = Step("toolkit", build_model({}), {}, accelerator, opts.batch, opts.seq)
    default()
    wanted = opts.sweep.split(",") if opts.sweep else None
    for name, setting in sweep_settings(opts.batch, opts.seq).items():
        if wanted and not any(w.strip() and w.strip() in name for w in wanted):
            continue
        batch, seq = setting.get("batch", opts.batch), setting.get("seq", opts.seq)
        steps = {"default": default, name: Step("toolkit", build_model(setting), setting, accelerator, batch, seq)}
        steps[name]()  # its warm-up
        gemm, cpu_gemm = gemm_rate(sizes)
        pairs = []
        for i in range(opts.sweep_steps):
            t = {k: steps[k]() for k in (list(steps) if i % 2 else list(steps)[::-1])}  # the setting goes first first
            pairs.append({"default_s": t["default"][0], "default_cpu_s": t["default"][1], "setting_s": t[name][0],
                          "setting_cpu_s": t[name][1]})
        med = {k: statistics.median(p[k] for p in pairs) for k in pairs[0]}
        per_token = steps["default"].tokens / steps[name].tokens
        out[name] = {"setting": setting, "tokens": steps[name].tokens, "flops_per_step": steps[name].flops,
                     "pairs": pairs, "gemm_flops": gemm, "gemm_flops_per_cpu_s": cpu_gemm,
                     "default_of_gemm": steps["default"].flops / med["default_s"] / gemm,
                     "setting_of_gemm": steps[name].flops / med["setting_s"] / gemm,
                     "setting_of_gemm_cpu": steps[name].flops / med["setting_cpu_s"] / cpu_gemm,
                     "time_per_token_vs_default": statistics.median(
                         p["setting_s"] / p["default_s"] * per_token for p in pairs),
                     "cpu_time_per_token_vs_default": statistics.median(
                         p["setting_cpu_s"] / p["default_cpu_s"] * per_token for p in pairs)}
        print(f"sweep {name}: {out[name]['setting_of_gemm']:.1%} of GEMM (unchanged {out[name]['default_of_gemm']:.1%}),"
              f" time/token x{out[name]['time_per_token_vs_default']:.2f}, CPU time/token "
              f"x{out[name]['cpu_time_per_token_vs_default']:.2f}", flush=True)
        del steps
        accelerator.free_memory()  # drops its references to the setting's model and optimizer (default keeps its own)
        gc.collect()
    return out


def _stats(values) -> dict:
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write_results(main: dict, sw: dict | None, opts) -> None:
    import torch

    rounds = main["rounds"]
    gemm = _stats(r["gemm_flops"] for r in rounds)
    summary = {"gemm_flops": gemm, "gemm_flops_per_cpu_s": _stats(r["gemm_flops_per_cpu_s"] for r in rounds),
               "flops_per_step": main["flops_per_step"]}
    for name in ("bare", "toolkit"):
        summary[name] = {"step_s": _stats(r[f"{name}_s"] for r in rounds),
                         "cpu_s": _stats(r[f"{name}_cpu_s"] for r in rounds),
                         "flops": _stats(r[f"{name}_flops"] for r in rounds),
                         "of_gemm": _stats(r[f"{name}_of_gemm"] for r in rounds),
                         "of_gemm_cpu": _stats(r[f"{name}_of_gemm_cpu"] for r in rounds),
                         # the least disturbed estimate: the fastest step over the fastest GEMM of the run
                         "best_of_gemm": main["flops_per_step"] / min(r[f"{name}_s"] for r in rounds)
                         / max(r["gemm_flops"] for r in rounds)}
    summary["toolkit_over_bare_step_time"] = _stats(r["toolkit_s"] / r["bare_s"] for r in rounds)
    summary["toolkit_over_bare_cpu_time"] = _stats(r["toolkit_cpu_s"] / r["bare_cpu_s"] for r in rounds)
    out = {"job": {k: v for k, v in vars(opts).items() if k != "from_json"} | {"threads": torch.get_num_threads(), "torch": torch.__version__},
           "summary": summary, "rounds": rounds, "sweep": sw}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "flops.json"), "w") as f:
        json.dump(out, f, indent=2)

    def mm(s, scale=1.0, fmt="{:.2f}"):
        return f"{fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})"

    tokens = opts.batch * opts.seq
    lines = [f"GPT-2 124M, fp32, {opts.batch} x {opts.seq} tokens per step, {torch.get_num_threads()} threads; "
             f"{main['flops_per_step'] / 1e12:.3f} TFLOP per step (6N + 12 L d T); fp32 GEMM (torch.mm, "
             f"{opts.gemm}): {mm(gemm, 1e-9, '{:.0f}')} GFLOP/s; {opts.rounds} rounds, median (min-max); freed memory "
             f"{'returned to the kernel (glibc defaults)' if getattr(opts, 'glibc_malloc', False) else 'kept for reuse'}"
             " for both systems. The CPU-time "
             "column divides FLOPs per CPU second of the step by those of the GEMM (other processes' load "
             "distorts it less); best: the fastest step over the fastest GEMM of the run.", "",
             "| system | step time, s | tokens/s | GFLOP/s | share of GEMM rate | share, by CPU time | share, best "
             "| step time vs bare |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("bare", "toolkit"):
        s = summary[name]
        ratio = "1.00x" if name == "bare" else mm(summary["toolkit_over_bare_step_time"], 1, "{:.2f}x")
        lines.append(f"| {name} | {mm(s['step_s'])} | {tokens / s['step_s']['median']:,.0f} | "
                     f"{mm(s['flops'], 1e-9, '{:.0f}')} | {mm(s['of_gemm'], 100, '{:.1f}%')} | "
                     f"{mm(s['of_gemm_cpu'], 100, '{:.1f}%')} | {100 * s['best_of_gemm']:.1f}% | {ratio} |")
    if sw:
        lines += ["", "Sweep: one setting changed in the toolkit step, run alternately with the unchanged step "
                  f"({opts.sweep_steps} pairs each; medians):", "",
                  "| setting | tokens / step | share of GEMM rate | unchanged step's share | time per token vs unchanged "
                  "| CPU time per token vs unchanged |", "| --- | --- | --- | --- | --- | --- |"]
        for name, s in sw.items():
            lines.append(f"| {name} | {s['tokens']} | {s['setting_of_gemm']:.1%} | {s['default_of_gemm']:.1%} | "
                         f"{s['time_per_token_vs_default']:.2f}x | {s['cpu_time_per_token_vs_default']:.2f}x |")
    with open(os.path.join(RESULTS, "flops.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["bare", "toolkit"] + (list(sw) if sw else [])
    main_shares = [summary["bare"]["of_gemm"], summary["toolkit"]["of_gemm"]]
    med = [100 * s["median"] for s in main_shares] + [100 * sw[n]["setting_of_gemm"] for n in (sw or {})]
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.34 * len(names)))
    ax.barh(range(len(names)), med, color=["C0", "C1"] + ["C2"] * (len(names) - 2))
    ax.errorbar(med[:2], range(2), xerr=[[m - 100 * s["min"] for m, s in zip(med, main_shares)],
                                         [100 * s["max"] - m for m, s in zip(med, main_shares)]],
                fmt="none", ecolor="k", capsize=3)
    if sw:  # the unchanged step it was paired with: how far apart two runs of the same step land
        ax.plot([100 * sw[n]["default_of_gemm"] for n in sw], range(2, len(names)), "kx", ms=5,
                label="unchanged step, same pairs")
        ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(range(len(names)), [n if i < 2 else f"toolkit, {n}" for i, n in enumerate(names)], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(35, color="k", ls="--", lw=0.8)
    ax.text(35.5, -0.6, "aim 35%", fontsize=8)
    ax.set_xlabel("step FLOP/s, % of fp32 torch.mm rate (median; bars: min-max over rounds)", fontsize=8)
    ax.set_title(f"GPT-2 124M fp32 training step, {opts.batch}x{opts.seq} tokens, CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "flops.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--gemm", default="2048,4096", help="square matrix sizes for the GEMM rate")
    parser.add_argument("--sweep-steps", type=int, default=2, help="pairs (setting, unchanged) per sweep setting")
    parser.add_argument("--sweep", default=None, help="comma-separated substrings of the sweep settings to run")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--glibc-malloc", action="store_true",
                        help="leave glibc's allocator as it is (by default freed memory is kept, as train does on a CPU)")
    parser.add_argument("--from-json", action="store_true",
                        help="rewrite the .md and .png from bench/results/flops.json without running")
    opts = parser.parse_args()
    if opts.from_json:
        with open(os.path.join(RESULTS, "flops.json")) as f:
            saved = json.load(f)
        job = argparse.Namespace(**{k: v for k, v in saved["job"].items() if k in vars(opts) and k != "from_json"})
        write_results({"rounds": saved["rounds"], "flops_per_step": saved["summary"]["flops_per_step"]},
                      saved["sweep"], job)
        shutil.rmtree(TMP, ignore_errors=True)
        return
    sys.path.insert(0, ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sizes = [int(x) for x in opts.gemm.split(",")]
    if not opts.glibc_malloc:
        from toolkit.env.host_memory import keep_freed_memory

        keep_freed_memory()  # as toolkit.training.loop.train does on a CPU: no fresh zero-filled pages per step, for both systems
    accelerator = make_accelerator()
    main_result = main_comparison(opts, accelerator, sizes)
    sw = None if opts.no_sweep else sweep(opts, accelerator, sizes)
    write_results(main_result, sw, opts)
    shutil.rmtree(TMP, ignore_errors=True)


if __name__ == "__main__":
    main()

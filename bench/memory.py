"""Peak memory and step time of each memory switch: plain, gradient_checkpointing, loss_chunk_size, both, and bf16.

    python bench/memory.py [--layers 4 --width 256 --seq 1024 --micro 8 --steps 2 --chunk 4096]

One process, a GPT-2 shape built from a config (vocab 50257: at micro 8 x 1024 positions its fp32 logits alone are
1.6 GB, and their gradient as much again), AdamW, toolkit's ``train_step``. Each setting runs in a fresh process
(peak RSS, ``ru_maxrss``, is per process) after a warm-up step; on a GPU the same script reports
``torch.cuda.max_memory_allocated``. On a CPU the settings run with glibc's defaults; the last row is the plain run
with freed memory kept for reuse (``cpu_memory_reuse``, toolkit/env/host_memory.py: faster steps, a fragmented heap kept
at its peak), which ``train`` applies to a CPU run without a memory switch unless told otherwise. Writes
``bench/results/memory.json``, ``.md`` and ``.png``; ``python bench/memory.py --plot-only`` redraws the PNG from the
JSON without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
SETTINGS = {
    "plain": {},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "loss_chunk_size": {"loss_chunk_size": True},
    "both": {"gradient_checkpointing": True, "loss_chunk_size": True},
    "bf16 mixed precision": {"mixed_precision": "bf16"},
    "plain + cpu_memory_reuse": {"cpu_memory_reuse": True},
    # bitsandbytes (pip install '.[qlora]'): adapters on a full-precision and on a 4-bit base, AdamW's state in 8 bits
    "LoRA r=16": {"lora": True},
    "LoRA r=16 on a 4-bit base": {"lora": True, "load_in_4bit": True},
    "8-bit AdamW": {"optim": "adamw_bnb_8bit"},
}


def run_one(name: str, opts) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.data.loading import CausalLMCollator
    from toolkit.models.loading import enable_activation_checkpointing, enable_chunked_loss
    from toolkit.training.loop import train_step

    setting = SETTINGS[name]
    if setting.get("cpu_memory_reuse") and not torch.cuda.is_available():
        from toolkit.env.host_memory import keep_freed_memory

        keep_freed_memory()  # as toolkit.training.loop.train does on a CPU
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=opts.layers, n_embd=opts.width, n_head=max(1, opts.width // 64),
                                       n_positions=opts.seq, vocab_size=50257))
    if setting.get("gradient_checkpointing"):
        enable_activation_checkpointing(model)
    if setting.get("loss_chunk_size"):
        enable_chunked_loss(model, opts.chunk)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=setting.get("mixed_precision", "no"))
    model = _adapted(model, setting, accelerator.device)
    optimizer = _optimizer(model, setting)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    collate = CausalLMCollator(0)
    g = torch.Generator().manual_seed(0)
    batch = collate([{"input_ids": torch.randint(0, 50257, (opts.seq,), generator=g).tolist()}
                     for _ in range(opts.micro)])
    batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    times = []
    for step in range(opts.steps + 1):
        started = time.perf_counter()
        result = train_step(accelerator, model, optimizer, scheduler, [batch], step=step, data_parallel_size=1,
                            max_grad_norm=1.0, chunked_loss=bool(setting.get("loss_chunk_size")))
        times.append(time.perf_counter() - started)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 1e9
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    from toolkit.models.quantization import optimizer_state_bytes

    trained = [p for p in model.parameters() if p.requires_grad]
    state = optimizer_state_bytes(getattr(optimizer, "optimizer", optimizer), trained)  # accelerate's wrapper
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
    return {"setting": name, "peak_gb": round(peak, 3), "step_s": round(statistics.median(times[1:]), 3),
            "loss": float(result.loss_sum) / max(result.targets, 1), "weights_gb": round(weights / 1e9, 4),
            "trained_params": sum(p.numel() for p in trained),
            "state_bytes_per_trained_param": round(state / sum(p.numel() for p in trained), 3)}


def _adapted(model, setting: dict, device):
    """LoRA r=16 on every linear layer (``lora``), on the same weights loaded back in 4 bits (``load_in_4bit``, NF4,
    double quantization, as toolkit.models.loading loads them)."""
    if not setting.get("lora"):
        return model
    import tempfile

    from toolkit.config import ModelArguments
    from toolkit.models.loading import load_model
    from toolkit.models.lora import apply_lora

    folder = tempfile.mkdtemp()
    args = ModelArguments(model_name_or_path=folder, use_peft=True, lora_r=16, lora_dropout=0.0,
                          lora_target_modules=["all-linear"], load_in_4bit=bool(setting.get("load_in_4bit")),
                          use_bnb_nested_quant=True)
    if args.load_in_4bit:
        model.save_pretrained(folder)
        model = load_model(args, device=device)
    return apply_lora(model, args, "CAUSAL_LM", log=lambda *_: None)


def _optimizer(model, setting: dict):
    import types

    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if setting.get("optim") == "adamw_bnb_8bit":
        from toolkit.models.quantization import eight_bit_adamw

        args = types.SimpleNamespace(learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8)
        return eight_bit_adamw([{"params": params, "weight_decay": 0.0}], args, paged=False)
    return torch.optim.AdamW(params, lr=1e-4)


def plot(rows: list[dict], job: dict, name: str = "memory") -> str:
    """Peak memory and step time per setting, as bars beside each other: ``bench/results/memory.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["setting"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, label in ((axes[0], "peak_gb", "peak memory (GB)"), (axes[1], "step_s", "step time (s)")):
        values = [r[key] for r in rows]
        ax.barh(range(len(names)), values, color=["C0"] + ["C1"] * (len(names) - 1))
        for i, v in enumerate(values):
            ax.text(v, i, f" {v / values[0]:.2f}x", va="center", fontsize=8)
        ax.set_yticks(range(len(names)), names if ax is axes[0] else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.2)
        ax.set_xlabel(label)
    fig.suptitle(f"GPT-2 {job['layers']}x{job['width']}, vocab 50257, micro batch {job['micro']} x {job['seq']}, "
                 "AdamW, one process", fontsize=9)
    fig.tight_layout()
    path = os.path.join(RESULTS, f"{name}.png")
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--plot-only", action="store_true", help="redraw memory.png from bench/results/memory.json")
    parser.add_argument("--name", default="memory", help="the results' file names: bench/results/NAME.json, .md, .png")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.plot_only:
        with open(os.path.join(RESULTS, f"{opts.name}.json")) as f:
            saved = json.load(f)
        print(plot(saved["rows"], saved["job"], opts.name))
        return
    if opts.one:
        print("RESULT " + json.dumps(run_one(opts.one, opts)))
        return
    rows = []
    for name in opts.settings.split(","):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", name], capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
        rows.append(json.loads(line[7:]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    table = ["| setting | peak memory | vs plain | step time | vs plain | last step loss | weights | optimizer state "
             "/ trained parameter |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        table.append(f"| {r['setting']} | {r['peak_gb']:.2f} GB | {r['peak_gb'] / base['peak_gb']:.2f}x | "
                     f"{r['step_s']:.2f} s | {r['step_s'] / base['step_s']:.2f}x | {r['loss']:.4f} | "
                     f"{r['weights_gb'] * 1000:.1f} MB | {r['state_bytes_per_trained_param']:.2f} B |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{opts.name}.json"), "w") as f:
        json.dump({"job": {k: v for k, v in vars(opts).items() if k != "plot_only"}, "rows": rows}, f, indent=2)
    with open(os.path.join(RESULTS, f"{opts.name}.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    print("\n".join(table))
    plot(rows, vars(opts), opts.name)


if __name__ == "__main__":
    main()

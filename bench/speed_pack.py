"""The speed pack of issue 50, each switch on and off: the loss without materialised logits, asynchronous checkpoints.

    python bench/speed_pack.py loss  [--positions 2048 --hidden 576 --vocab 49152 --chunks 256,1024 --repeats 3]
    python bench/speed_pack.py grpo-loss  [the same options]
    python bench/speed_pack.py save  [--steps 12]
    python bench/speed_pack.py switches  [--steps 12]

``loss``: one token loss over ``positions`` positions of a head ``hidden`` x ``vocab`` (SmolLM2-135M's: 576 x 49152),
forward and backward, in a fresh process per setting: the materialised logits (``toolkit.loss.token_losses``), the
checkpointed chunks that ``loss_chunk_size`` computed before issue 50 (``chunked_token_losses(..., fused=False)``),
and torch's ``F.linear_cross_entropy`` in chunks (``fused=True``, what ``loss_chunk_size`` runs now). Peak memory is
the growth of the process's peak RSS (``ru_maxrss``) over what it held before the first step (weights, hidden states
and the head's gradient buffer allocated), on a GPU ``torch.cuda.max_memory_allocated`` over the same baseline.
``grpo-loss``: the same for GRPO's completion log-probs and entropy metric over ``positions`` completion tokens, from
the logits (``toolkit.tasks.grpo.loss.completion_logps``) against ``loss_chunk_size``'s fused log-probs and chunked
entropy (``toolkit.loss.chunked_completion_logps``); also the entropies' largest relative difference.

``save``: recipes/gpt2.py on 2 gloo ranks (DDP and FSDP2) with a checkpoint every step, synchronous against
``async_save: true``; the loop's stall per save is read from the run's log (``checkpoint stall``).

``switches``: each switch on against all off in one table (2 DDP ranks): step time, peak memory per rank, the
compile (the first step's excess), the stall per save.

Writes ``bench/results/speed_pack.json`` and ``.md``.
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
LOSS_SETTINGS = ("materialised logits", "checkpointed chunks", "linear_cross_entropy chunks")
# GRPO's log-probs and entropy metric (``grpo-loss``): from the logits, or with loss_chunk_size
GRPO_SETTINGS = ("GRPO materialised logits", "GRPO linear_cross_entropy + chunked entropy")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def loss_one(setting: str, chunk: int, opts) -> dict:
    """One setting, in this (fresh) process: median seconds of forward + backward, peak memory growth, the loss and
    the gradients' largest difference from the materialised loss's (computed after the timed steps)."""
    sys.path.insert(0, ROOT)
    import torch

    from toolkit.loss import chunked_token_losses, token_losses

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    head = torch.nn.Linear(opts.hidden, opts.vocab, bias=False, device=device)
    hidden = torch.randn(1, opts.positions, opts.hidden, device=device, requires_grad=True)
    labels = torch.randint(0, opts.vocab, (1, opts.positions), device=device)
    labels[0, : opts.positions // 10] = -100  # a prompt's worth of positions without a target

    entropies = {}

    def step(which):
        if which in GRPO_SETTINGS:  # a completion's log-probs (their sum the loss here) and the entropy metric
            return _grpo_step(which, hidden, head, labels, chunk, entropies)
        if which == LOSS_SETTINGS[0]:
            sums, _ = token_losses(head(hidden), labels)
        else:
            sums, _ = chunked_token_losses(hidden, head, labels, chunk, fused=which == LOSS_SETTINGS[2])
        sums.sum().backward()
        return float(sums.sum())

    # the first call imports what the setting runs (linear_cross_entropy's custom ops pull in ~100 MB of modules):
    # made on 8 positions of a 64-token head before the baseline, so that the growth is the loss's memory alone
    small = torch.nn.Linear(opts.hidden, 64, bias=False, device=device)
    few = torch.randn(1, 8, opts.hidden, device=device, requires_grad=True)
    few_labels = torch.randint(0, 64, (1, 8), device=device)
    for fused in (False, True):
        chunked_token_losses(few, small, few_labels, 4, fused=fused)[0].sum().backward()
    token_losses(small(few), few_labels)[0].sum().backward()
    for which in GRPO_SETTINGS:
        _grpo_step(which, few, small, few_labels, 4, {})
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_mib()
    times = []
    for _ in range(opts.repeats):
        head.weight.grad = hidden.grad = None  # as a training step starts (zero_grad(set_to_none=True))
        started = time.perf_counter()
        loss = step(setting)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else _rss_mib()
    grads = head.weight.grad, hidden.grad
    head.weight.grad = hidden.grad = None
    got_entropy = entropies.get(setting)
    want = step(GRPO_SETTINGS[0] if setting in GRPO_SETTINGS else LOSS_SETTINGS[0])
    head_grad_mib = head.weight.numel() * 4 / 2**20  # the step's gradient of the head, which every setting keeps
    return {"setting": setting, "chunk": chunk, "step_s": round(statistics.median(times), 3),
            "peak_growth_mib": round(peak - base, 1), "beyond_head_grad_mib": round(peak - base - head_grad_mib, 1),
            "loss": loss, "loss_diff": abs(loss - want),
            "weight_grad_diff": float((grads[0] - head.weight.grad).abs().max()),
            "input_grad_diff": float((grads[1] - hidden.grad).abs().max()),
            "entropy_rel_diff": (float(((got_entropy - entropies[GRPO_SETTINGS[0]]) / entropies[GRPO_SETTINGS[0]])
                                       .abs().max()) if got_entropy is not None else None),
            "logits_mib": round(opts.positions * opts.vocab * 4 / 2**20, 1), "device": device}


def _grpo_step(which: str, hidden, head, labels, chunk: int, entropies: dict) -> float:
    """GRPO's per-token log-probs of ``labels`` (every position a completion token) and their entropies: from the
    logits (``toolkit.tasks.grpo.loss.completion_logps``) or as ``loss_chunk_size`` computes them
    (``toolkit.loss.chunked_completion_logps``); the log-probs' sum backpropagated, the entropies kept."""
    from toolkit.loss import chunked_completion_logps
    from toolkit.tasks.grpo.loss import completion_logps

    flat_hidden, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).clamp(min=0)
    if which == GRPO_SETTINGS[0]:
        logps, entropy = completion_logps(head(flat_hidden), targets, 1.0)
    else:
        logps, entropy = chunked_completion_logps(flat_hidden, head, targets, chunk)
    logps.sum().backward()
    entropies[which] = entropy.detach()
    return float(logps.detach().sum())


def loss_table(opts, settings=LOSS_SETTINGS) -> list[dict]:
    rows = []
    runs = [(settings[0], 0)] + [(s, c) for c in opts.chunks for s in settings[1:]]
    for setting, chunk in runs:
        out = subprocess.run([sys.executable, __file__, "loss-one", "--setting", setting, "--chunk", str(chunk),
                              *_size_args(opts)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _size_args(opts) -> list[str]:
    return ["--positions", str(opts.positions), "--hidden", str(opts.hidden), "--vocab", str(opts.vocab),
            "--repeats", str(opts.repeats)]


def loss_markdown(rows: list[dict]) -> str:
    logits = rows[0]["logits_mib"]
    lines = [f"One loss, forward and backward, {rows[0]['device']}: the materialised fp32 logits are {logits} MiB "
             "(and their gradient as much again).", "",
             "| loss | chunk | step (s) | peak growth (MiB) | beyond the head's gradient (MiB) | / logits | "
             "loss diff | head grad diff |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['chunk'] or '-'} | {r['step_s']} | {r['peak_growth_mib']} | "
                     f"{r['beyond_head_grad_mib']} | {r['beyond_head_grad_mib'] / logits:.2f} | "
                     f"{r['loss_diff']:.1e} | {r['weight_grad_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def grpo_loss_markdown(rows: list[dict]) -> str:
    logits = rows[0]["logits_mib"]
    lines = [f"GRPO's log-probs (forward and backward) and entropy metric, {rows[0]['device']}: the materialised fp32 "
             f"logits are {logits} MiB.", "",
             "| log-probs and entropy | chunk | step (s) | peak growth (MiB) | beyond the head's gradient (MiB) | "
             "/ logits | log-prob sum diff | head grad diff | entropy rel diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['chunk'] or '-'} | {r['step_s']} | {r['peak_growth_mib']} | "
                     f"{r['beyond_head_grad_mib']} | {r['beyond_head_grad_mib'] / logits:.2f} | "
                     f"{r['loss_diff']:.1e} | {r['weight_grad_diff']:.1e} | {r['entropy_rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def save(rows: dict) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "speed_pack.json")
    old = json.load(open(path)) if os.path.isfile(path) else {}
    old.update(rows)
    with open(path, "w") as f:
        json.dump(old, f, indent=2)
    with open(os.path.join(RESULTS, "speed_pack.md"), "w") as f:
        for name, text in (("loss", loss_markdown), ("grpo_loss", grpo_loss_markdown), ("save", save_markdown),
                           ("switches", switches_markdown)):
            if name in old:
                f.write(text(old[name]) + "\n")


def save_table(opts) -> list[dict]:
    """recipes/gpt2.py on 2 gloo ranks, a checkpoint every step, AdamW (weights + 2 moments written each save), on a
    GPT-2 of 6 x 512 (vocab 50257: 44M parameters, 0.5 GB a checkpoint); the stall per save from the run's
    ``checkpoint stall`` line, the step time from its summary (steps over the training's wall time)."""
    import re
    import tempfile

    work = tempfile.mkdtemp(prefix="speed-pack-save-")
    model = os.path.join(work, "gpt2-6x512")
    subprocess.run([sys.executable, "-m", "toolkit", "offline", "tiny-gpt2", model, "--n-layer", "6", "--n-embd",
                    "512", "--n-head", "8", "--n-positions", "128"], check=True, cwd=ROOT, capture_output=True)
    rows = []
    for strategy, config in (("DDP", "ddp.yaml"), ("FSDP2", "fsdp.yaml")):
        for mode in ("synchronous", "async_save"):
            out = os.path.join(work, f"{config}-{mode}")
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   os.path.join(ROOT, "accelerate_configs", config), "--num_processes", "2", "recipes/gpt2.py",
                   "--model_name_or_path", model, "--dataset_name", "pydoc", "--block_size", "128",
                   "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps",
                   str(opts.steps), "--save_steps", "1", "--save_total_limit", "2", "--optim", "adamw_torch",
                   "--logging_steps", "1", "--eval_on_start", "false", "--save_final_model", "false", "--report_to",
                   "none", "--plot", "false", "--async_save", str(mode == "async_save").lower(), "--output_dir", out]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "recipes")])}
            text = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
            stall = float(re.search(r"checkpoint stall: median ([0-9.]+) s", text).group(1))
            summary = json.load(open(os.path.join(out, "summary.json")))
            rows.append({"strategy": strategy, "save": mode, "stall_s": stall,
                         "step_s": round(1 / summary["steps_per_s"], 3) if summary.get("steps_per_s")
                         else None})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def save_markdown(rows: list[dict]) -> str:
    lines = ["Checkpoint every step, 2 gloo ranks: the loop's stall per save (median over the run's saves).", "",
             "| strategy | save | stall per save (s) | step (s) |", "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['save']} | {r['stall_s']} | {r['step_s']} |")
    return "\n".join(lines) + "\n"


# each switch of the pack on, against all off: (name, the recipe's fields beyond the plain run's)
SWITCHES = (("all off", []), ("loss_chunk_size 256", ["--loss_chunk_size", "256"]),
            ("torch_compile (inductor)", ["--torch_compile", "true"]),
            ("async_save (save every step)", ["--async_save", "true", "--save_steps", "1"]),
            ("synchronous save every step", ["--save_steps", "1"]))


def switches_table(opts) -> list[dict]:
    """recipes/gpt2.py on 2 gloo DDP ranks, each switch on against all off, on a GPT-2 of 4 x 256 (vocab 50257: the
    head and its logits dominate, what loss_chunk_size is for): the median step time after the first (from the
    per-step metrics), the first step's excess over it (the compile, for torch_compile), the peak memory per rank
    (summary.json), the loop's stall per save (the run's ``checkpoint stall`` line)."""
    import re
    import tempfile

    work = tempfile.mkdtemp(prefix="speed-pack-switches-")
    model = os.path.join(work, "gpt2-4x256")
    subprocess.run([sys.executable, "-m", "toolkit", "offline", "tiny-gpt2", model, "--n-layer", "4", "--n-embd",
                    "256", "--n-head", "4", "--n-positions", "256"], check=True, cwd=ROOT, capture_output=True)
    rows = []
    for name, fields in SWITCHES:
        out = os.path.join(work, re.sub(r"\W+", "-", name))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(ROOT, "accelerate_configs", "ddp.yaml"), "--num_processes", "2", "recipes/gpt2.py",
               "--model_name_or_path", model, "--dataset_name", "pydoc", "--block_size", "256",
               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps",
               str(opts.steps), "--optim", "adamw_torch", "--logging_steps", "1", "--eval_on_start", "false",
               "--save_final_model", "false", "--report_to", "none", "--plot", "false", "--save_total_limit", "2",
               "--torch_compile_cache_dir", os.path.join(work, "compile-cache"), "--output_dir", out, *fields]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "recipes")])}
        text = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
        steps = [1 / r["steps_per_s"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
                 if r.get("steps_per_s")]
        stall = re.search(r"checkpoint stall: median ([0-9.]+) s", text)
        summary = json.load(open(os.path.join(out, "summary.json")))
        step = statistics.median(steps[1:])
        rows.append({"switch": name, "step_s": round(step, 3), "first_step_excess_s": round(steps[0] - step, 1),
                     "peak_gb_per_rank": summary.get("peak_memory_gb_per_rank"),
                     "stall_s": float(stall.group(1)) if stall else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def switches_markdown(rows: list[dict]) -> str:
    lines = ["Each switch on against all off: 2 gloo DDP ranks, GPT-2 4 x 256 (vocab 50257), micro-batch 4 x 256 "
             "tokens, AdamW.", "",
             "| switch | step (s, median after the first) | first step's excess (s: the compile) | peak memory per "
             "rank (GB) | stall per save (s) |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        peak = "/".join(f"{p:.2f}" for p in r["peak_gb_per_rank"] or [])
        lines.append(f"| {r['switch']} | {r['step_s']} | {r['first_step_excess_s']} | {peak} | "
                     f"{r['stall_s'] if r['stall_s'] is not None else '-'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["loss", "grpo-loss", "loss-one", "save", "switches"])
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setting", default=LOSS_SETTINGS[0])
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--steps", type=int, default=12)
    opts = parser.parse_args()
    if opts.what == "loss-one":
        print(json.dumps(loss_one(opts.setting, opts.chunk, opts)))
    elif opts.what == "loss":
        save({"loss": loss_table(opts)})
    elif opts.what == "grpo-loss":
        save({"grpo_loss": loss_table(opts, GRPO_SETTINGS)})
    elif opts.what == "switches":
        save({"switches": switches_table(opts)})
    else:
        save({"save": save_table(opts)})


if __name__ == "__main__":
    main()

"""DDP with gradient accumulation 1 vs 4 at the same global batch: all-reduces and their time per optimizer step.

    python bench/ddp_accumulation.py [--rounds 3 --steps 6 --layers 4 --width 256 --block-size 128 --global-rows 8]

2 CPU ranks (gloo) launched as a user launches them, ``accelerate launch --config_file accelerate_configs/ddp.yaml
--num_processes 2``, each running the toolkit's real loop (``toolkit.training.loop.train`` after ``toolkit.training.build.build``, as
recipes/gpt2.py does) through ``bench/_ddp_accum_worker.py``, whose callback registers a DDP communication hook that
counts and times each bucket all-reduce before doing DDP's default one, and wraps ``torch.distributed.all_reduce``
to count the others (the loop's one all-reduce of the step's token counts). The model: GPT-2 shaped, ``--layers`` x
``--width``, the real GPT-2 vocabulary (50257) and tokenizer (``toolkit.models.offline.save_tiny_gpt2``), fp32, AdamW,
dropout off, the packed pydoc rows (``--block-size`` tokens each). The same global batch (``--global-rows`` rows per
optimizer step, 2 ranks) three ways:

- accum 1: micro batch global/2, accumulation 1 (the baseline of the ratios);
- accum 4: micro batch global/8, accumulation 4, accelerate's ``no_sync`` on the first 3 micro-steps (the toolkit);
- accum 4 without no_sync: the same, but the DDP model's ``no_sync`` replaced by a null context, so every micro-step
  all-reduces (what accumulation costs without it). It runs in the accum 4 launch, alternating step by step with
  the toolkit's accum 4 steps, so that these two are paired in one process.

Each (launch, round) is a fresh ``accelerate launch``; accum 1 and accum 4 interleaved round by round, their order
alternating. The first step (warm-up) and the last (it logs and gathers metrics) of each run are left out; ``--steps``
are measured per setting. Reported, per optimizer step, medians over ranks, steps and rounds (min-max over the rounds'
medians): bucket all-reduces (and per micro-step), other all-reduces (with where they come from), MB all-reduced,
milliseconds inside bucket all-reduces (summed over buckets; gloo runs them beside the backward pass), and the step
time with its ratio to accum 1 (accum 4 without no_sync: also to the accum 4 steps of the same launches).
Writes ``bench/results/ddp_accumulation.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
WORKER = os.path.join(ROOT, "bench", "_ddp_accum_worker.py")
LAUNCHES = {"accum 1": (1, False), "accum 4": (4, True)}  # accumulation, alternate no_sync on / off step by step
SETTINGS = {"accum 1": ("accum 1", None), "accum 4": ("accum 4", True),  # launch, the steps' no_sync (None: all)
            "accum 4 without no_sync": ("accum 4", False)}
ACCUM = {"accum 1": 1, "accum 4": 4, "accum 4 without no_sync": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             OMP_NUM_THREADS="1",  # 2 ranks on 2 cores: one thread each
             PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([ROOT, e.get("PYTHONPATH", "")]))
    e.pop("ACCELERATE_USE_CPU", None)
    return e


def launch(name: str, opts, model: str, workdir: str, r: int) -> list[dict]:
    accum, alternate = LAUNCHES[name]
    micro = opts.global_rows // (2 * accum)
    steps = opts.steps * (2 if alternate else 1)
    out = os.path.join(workdir, f"{name.replace(' ', '_').replace(',', '')}-{r}")
    fields = {"model_name_or_path": model, "dataset_name": "pydoc", "validation_split_percentage": 0,
              "packing": "true", "block_size": opts.block_size, "per_device_train_batch_size": micro,
              "gradient_accumulation_steps": accum, "max_steps": steps + 2, "logging_steps": steps + 2,
              "optim": "adamw_torch", "learning_rate": 1e-4, "max_grad_norm": 1.0, "lr_scheduler_type": "constant",
              "disable_dropout": "true", "overwrite_output_dir": "true", "report_to": "none", "save_final_model": "false", "output_dir": out,
              "seed": 0}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", "ddp.yaml"), "--num_processes", "2", "--main_process_port",
           str(free_port()), WORKER, "--bench_out", os.path.join(out, "comm.json")]
    cmd += [x for k, v in fields.items() for x in (f"--{k}", str(v))]
    if alternate:
        cmd.append("--bench_alternate_no_sync")
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(out, f"comm.rank{rank}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def _stats(values) -> dict:
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(per_round: list[list[dict]], no_sync: bool | None) -> dict:
    """Per optimizer step: the median over ranks and measured steps of each round (the steps with ``no_sync`` as
    given, all when None), then median (min-max) over rounds."""
    keys = ("bucket_allreduces", "other_allreduces", "bucket_bytes", "bucket_allreduce_s", "bucket_allreduce_span_s",
            "other_allreduce_s", "step_s")
    rounds = {k: [] for k in keys}
    patterns = set()
    for ranks in per_round:
        steps = [s for rk in ranks for s in rk["steps"][1:-1]  # not the warm-up, not the (logging) last step
                 if no_sync is None or s["no_sync"] == no_sync]
        for k in keys:
            rounds[k].append(statistics.median(s[k] for s in steps))
        patterns |= {tuple(s["bucket_allreduces_per_micro_step"]) for s in steps}
    out = {k: _stats(v) for k, v in rounds.items()}
    out["rounds"] = rounds
    out["bucket_allreduces_per_micro_step"] = sorted(list(p) for p in patterns)
    sites = {}
    for ranks in per_round:
        for site, n in ranks[0]["other_allreduce_sites"].items():
            sites[site] = sites.get(site, 0) + n
    out["other_allreduce_sites_rank0_all_steps"] = sites
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps per run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--global-rows", type=int, default=8, help="rows per optimizer step (a multiple of 8)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--from-json", action="store_true",
                        help="rewrite the .md and .png from bench/results/ddp_accumulation.json without running")
    opts = parser.parse_args()
    if opts.from_json:
        with open(os.path.join(RESULTS, "ddp_accumulation.json")) as f:
            saved = json.load(f)
        write_results(saved["raw"], argparse.Namespace(**{k: v for k, v in saved["job"].items()
                                                          if k in vars(opts) and k != "from_json"}))
        return
    if opts.global_rows % 8:
        raise SystemExit("--global-rows must be a multiple of 8 (2 ranks x accumulation 4)")
    sys.path.insert(0, ROOT)
    from toolkit.models.offline import save_tiny_gpt2

    workdir = opts.workdir or tempfile.mkdtemp(prefix="ddp-accum-")
    model = save_tiny_gpt2(os.path.join(workdir, "model"), n_layer=opts.layers, n_embd=opts.width,
                           n_head=max(1, opts.width // 64), n_positions=max(opts.block_size, 128), seed=0)
    names = list(LAUNCHES)
    raw = {n: [] for n in names}
    for r in range(opts.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            raw[name].append(launch(name, opts, model, workdir, r))
            for setting, (launched, no_sync) in SETTINGS.items():
                if launched == name:
                    s = summarize([raw[name][-1]], no_sync)
                    print(f"round {r + 1} {setting}: {s['bucket_allreduces']['median']:.0f} bucket all-reduces/step, "
                          f"{s['bucket_allreduce_s']['median'] * 1e3:.0f} ms in them, step "
                          f"{s['step_s']['median']:.2f} s", flush=True)
    if not opts.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    write_results(raw, opts)


def write_results(raw: dict, opts) -> None:
    summary = {name: summarize(raw[launched], no_sync) for name, (launched, no_sync) in SETTINGS.items()}
    for s in summary.values():  # per round: this setting's median step over accum 1's of the same round
        s["step_s_over_accum_1"] = _stats(a / b for a, b in zip(s["rounds"]["step_s"],
                                                                 summary["accum 1"]["rounds"]["step_s"]))
    # paired in the accum 4 launches: per round, the median step without no_sync over the median step with it
    summary["accum 4 without no_sync"]["step_s_over_accum_4_same_launch"] = _stats(
        a / b for a, b in zip(summary["accum 4 without no_sync"]["rounds"]["step_s"], summary["accum 4"]["rounds"]["step_s"]))
    job = {k: v for k, v in vars(opts).items() if k != "from_json"} | {"workdir": None, "world": 2, "threads_per_rank": raw[next(iter(raw))][0][0]["threads"],
                        "tokens_per_step": opts.global_rows * opts.block_size}
    out = {"job": job, "summary": summary, "raw": raw}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "ddp_accumulation.json"), "w") as f:
        json.dump(out, f, indent=2)

    def mm(s, scale=1.0, fmt="{:.2f}"):
        return f"{fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})"

    lines = ["| setting | micro x accum x ranks | bucket all-reduces / step (per micro-step) | other all-reduces / step "
             "| MB all-reduced / step | ms in bucket all-reduces / step | step time, s | step time vs accum 1 (per round) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in summary.items():
        accum = ACCUM[name]
        pattern = " or ".join("[" + ",".join(map(str, p)) + "]" for p in s["bucket_allreduces_per_micro_step"])
        lines.append(f"| {name} | {opts.global_rows // (2 * accum)} x {accum} x 2 | "
                     f"{s['bucket_allreduces']['median']:.0f} {pattern} | {s['other_allreduces']['median']:.0f} | "
                     f"{s['bucket_bytes']['median'] / 1e6:.1f} | {mm(s['bucket_allreduce_s'], 1e3, '{:.0f}')} | "
                     f"{mm(s['step_s'])} | {mm(s['step_s_over_accum_1'], 1, '{:.2f}x')} |")
    paired = summary["accum 4 without no_sync"]["step_s_over_accum_4_same_launch"]
    sites = summary["accum 4"]["other_allreduce_sites_rank0_all_steps"]
    lines.append("")
    lines.append(f"GPT-2 {opts.layers} x {opts.width}, vocab 50257, fp32, AdamW; {opts.global_rows} rows x "
                 f"{opts.block_size} tokens per optimizer step on 2 gloo ranks, 1 thread each; {opts.steps} measured "
                 f"steps x {opts.rounds} rounds; medians over ranks and steps, (min-max) over the rounds.")
    lines.append(f"Paired in the same accum 4 launches, step by step: without no_sync / with = {mm(paired, 1, '{:.2f}x')}.")
    lines.append("Other all-reduces (rank 0, accum 4 runs, all steps): "
                 + ", ".join(f"{k} x{v}" for k, v in sorted(sites.items(), key=lambda kv: -kv[1])) + ".")
    with open(os.path.join(RESULTS, "ddp_accumulation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(9.5, 3.2))
    for ax, key, label, scale in ((axes[0], "bucket_allreduces", "bucket all-reduces / step", 1),
                                  (axes[1], "bucket_allreduce_s", "ms in bucket all-reduces / step", 1e3),
                                  (axes[2], "step_s", "optimizer step (s)", 1)):
        ax.bar(range(len(names)), [summary[n][key]["median"] * scale for n in names],
               color=["C0", "C1", "C3"][:len(names)], alpha=0.8)
        for r in range(len(summary[names[0]]["rounds"][key])):  # each round's median, joined: contention shows
            ax.plot(range(len(names)), [summary[n]["rounds"][key][r] * scale for n in names], "o-", color="k",
                    ms=3, lw=0.6, alpha=0.6, label="a round" if r == 0 else None)
        ax.set_xticks(range(len(names)), [n.replace(" without", "\nwithout") for n in names], fontsize=8)
        ax.set_title(label, fontsize=9)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"DDP, 2 gloo ranks: GPT-2 {opts.layers}x{opts.width}, {opts.global_rows}x{opts.block_size} tokens "
                 "per optimizer step", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "ddp_accumulation.png"), dpi=120)


if __name__ == "__main__":
    main()

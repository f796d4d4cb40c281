"""Pipeline parallelism on CPU ranks: the measured bubble and step time of GPipe and 1F1B against (p - 1) / (m + p - 1),
and the peak memory per rank of each schedule as the micro-batches grow.

    python bench/pipeline.py [--stages 2] [--micro-batches 1 2 4 8] [--rows 4] [--seq 128] [--layers 8] [--width 256]
        [--steps 3] [--out bench/results/pipeline.json]

A Llama of ``--layers`` x ``--width`` (random weights, a 2048-token vocabulary) is cut by ``toolkit.parallel.pipeline`` into
``--stages`` stages, one per gloo rank (``torch.multiprocessing``), and trained with the toolkit's own stage modules
and torch's schedules, ``--rows`` rows of ``--seq`` tokens per micro-batch. Each (schedule, m) runs in fresh
processes, so that each peak is its own: ``ru_maxrss`` after the steps minus after the first step's setup is what the
schedule's in-flight activations added (GPipe: m micro-batches' activations until their backward; 1F1B: at most p).
The bubble: 1 - m x (one micro-batch's forward and backward through the rank's stage alone) / the step's wall time,
the mean over the steps after the first (which sets the stages up) and over the ranks: what a step spends beyond
its rank's own work (waiting for the other stage, and sending).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _model(layers: int, width: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                         num_attention_heads=max(1, width // 64), num_key_value_heads=max(1, width // 64),
                         max_position_embeddings=4096, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _alone(stage_module, rank: int, args, width: int) -> float:
    """Seconds of one micro-batch's forward and backward through this rank's stage alone (no pipeline, no wait): the
    work a rank does per micro-batch, m of them per step."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 2048, (args.rows, args.seq), generator=g)
    x = ids if rank == 0 else torch.randn(args.rows, args.seq, width, generator=g, requires_grad=True)
    mask = torch.ones_like(ids)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        stage_module(x, mask).float().sum().backward()
        times.append(time.perf_counter() - started)
    for p in stage_module.parameters():
        p.grad = None
    return min(times[1:])


def _rank(rank: int, args, schedule: str, m: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    from torch.distributed import pipelining

    from toolkit.parallel.pipeline import Stage, cut, family

    model = _model(args.layers, args.width)
    bounds = cut(model, args.stages)
    stage_module = Stage(model, family(model), bounds[rank], rank == 0, rank == args.stages - 1)
    per_micro = _alone(stage_module, rank, args, args.width)
    stage = pipelining.PipelineStage(stage_module, rank, args.stages, torch.device("cpu"))
    tokens = args.rows * args.seq * m

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)) / m

    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (args.rows * m, args.seq), generator=g)
    mask = torch.ones_like(ids)
    steps, base = [], None
    for step in range(args.steps + 1):
        dist.barrier()
        started = time.perf_counter()
        sched.step(*([ids] if rank == 0 else []), target=ids, attention_mask=mask)
        dist.barrier()
        wall = time.perf_counter() - started
        if step == 0:  # the stages' setup (shape inference) and the first allocation of everything kept
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            continue
        steps.append((wall, per_micro * m))
        for p in stage_module.parameters():
            p.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.put({"rank": rank, "steps": steps, "peak_kb": peak, "after_setup_kb": base, "tokens": tokens})
    dist.destroy_process_group()


def measure(args, schedule: str, m: int, port: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, schedule, m, port, queue)) for r in range(args.stages)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    step = sum(w for w, _ in results[0]["steps"]) / len(results[0]["steps"])
    bubble = sum(1 - b / w for r in results for w, b in r["steps"]) / sum(len(r["steps"]) for r in results)
    return {"schedule": schedule, "micro_batches": m, "step_s": step, "measured_bubble": bubble,
            "formula_bubble": (args.stages - 1) / (m + args.stages - 1),
            "peak_mb_per_rank": [r["peak_kb"] / 1024 for r in results],
            "grown_mb_per_rank": [(r["peak_kb"] - r["after_setup_kb"]) / 1024 for r in results]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "pipeline.json"))
    args = parser.parse_args(argv)
    rows, port = [], 29700
    print(f"{'schedule':<8} {'m':>3} {'step s':>8} {'bubble':>8} {'(p-1)/(m+p-1)':>14} {'peak MB/rank':>18} "
          f"{'grown MB/rank':>18}")
    for m in args.micro_batches:
        for schedule in ("gpipe", "1f1b"):
            if schedule == "1f1b" and m < args.stages:  # torch's 1F1B needs a micro-batch per stage at least
                continue
            port += 1
            r = measure(args, schedule, m, port)
            rows.append(r)
            print(f"{schedule:<8} {m:>3} {r['step_s']:>8.3f} {r['measured_bubble']:>8.1%} {r['formula_bubble']:>14.1%} "
                  f"{'/'.join(f'{x:.0f}' for x in r['peak_mb_per_rank']):>18} "
                  f"{'/'.join(f'{x:.0f}' for x in r['grown_mb_per_rank']):>18}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

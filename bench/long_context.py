"""Ulysses and ring attention on CPU ranks: peak memory per rank against the sequence length, and the step time.

    python bench/long_context.py [--sizes 1 2 4 --ring-sizes 2 4 --lengths 1024 2048 4096 --layers 4 --width 128
                                  --cap-mb 200]

For each sequence-parallel size n (Ulysses: ``--sizes``; ring attention, ``context_parallel_size``: ``--ring-sizes``,
rows "ring n"), n gloo ranks (``torch.multiprocessing``, ``OMP_NUM_THREADS=1``) each build the same
Llama shape from a config (``--width`` wide, ``--layers`` layers, 8 query and 4 key/value heads, a 2048-token
vocabulary) with ``toolkit.parallel.sequence``'s attention (the all-to-all, or the ring), and run one forward and backward of one row of each
length, longest last, through ``toolkit.parallel.sequence.row_losses`` (what a training micro-step runs; without
DDP's gradient all-reduce, which does not depend on the length). Per rank and length: the peak resident memory above
the rank's resting memory before the step (``ru_maxrss`` after the step minus the resident set before it: the step's
activations, logits, attention and gradients, which grow with the length) and the step time (after a warm-up step
at the shortest length). Reports the ratio of n ranks' per-rank peak to one process's at the same length (activations
split n ways: close to 1/n, plus what does not shrink: the gradients of the whole model), the longest measured length
within ``--cap-mb`` per rank, the step time at the same tokens per rank against n = 1 (which also holds attention
over an n times longer sequence for 1/n of the heads: n times its quadratic work per rank; the ring: its queries
against n times the keys, about n times as well, in n steps), and the seconds spent inside the communication (the
all-to-alls, or waiting for the ring's sends and receives; forward and backward, the slowest rank; on an
oversubscribed CPU this includes waiting for the slowest rank to arrive).
Writes ``bench/results/long_context.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
sys.path.insert(0, ROOT)


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rank(rank: int, n: int, opts, port: int, out: str, ring: bool = False) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.parallel import ring as ring_attention
    from toolkit.parallel import sequence

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=opts.width, intermediate_size=2 * opts.width,
                         num_hidden_layers=opts.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=max(opts.lengths), attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    accelerator = SimpleNamespace(process_index=rank, num_processes=n, print=lambda *a, **k: None)
    sizes = SimpleNamespace(sequence_parallel_size=1 if ring else n, context_parallel_size=n if ring else 1)
    group = sequence.setup(accelerator, sizes, model) if n > 1 else None
    model.train()
    waited = [0.0]  # seconds inside the all-to-alls or the ring's waits (forward and backward), this rank
    owner, name = (ring_attention, "_wait") if ring else (sequence, "_all_to_all")
    communicate = getattr(owner, name)

    def timed(*args):
        started = time.perf_counter()
        try:
            return communicate(*args)
        finally:
            waited[0] += time.perf_counter() - started

    setattr(owner, name, timed)

    def step(length: int) -> float:
        ids = torch.randint(0, 2048, (1, length), generator=torch.Generator().manual_seed(length))
        batch = {"input_ids": ids, "labels": ids}
        started = time.perf_counter()
        if group is None:
            logits = model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float()[0, :-1], ids[0, 1:], reduction="sum")
        else:
            loss = sequence.row_losses(model, batch, group).sum()
        loss.backward()
        model.zero_grad(set_to_none=False)  # the gradients stay allocated: the resting memory holds them
        dist.barrier()
        return time.perf_counter() - started

    step(min(opts.lengths))  # warm-up: the gradients allocated, kernels chosen
    records = []
    for length in sorted(opts.lengths):
        resting, waited[0] = _resident_mb(), 0.0
        seconds = min(step(length) for _ in range(opts.repeats))
        records.append({"length": length, "peak_above_resting_mb": round(_peak_mb() - resting, 1),
                        "step_s": round(seconds, 3), "all_to_all_s": round(waited[0] / opts.repeats, 3)})
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(records, f)
    dist.destroy_process_group()


def measure(n: int, opts, port: int, ring: bool = False) -> list[dict]:
    """Every rank's records for size n: per length, the largest peak over the ranks and the slowest rank's time."""
    import torch.multiprocessing as mp

    out = os.path.join(RESULTS, f".long_context_{'ring' if ring else 'ulysses'}_{n}")
    mp.start_processes(_rank, args=(n, opts, port, out, ring), nprocs=n, start_method="spawn")
    per_rank = []
    for rank in range(n):
        with open(f"{out}.rank{rank}") as f:
            per_rank.append(json.load(f))
        os.remove(f"{out}.rank{rank}")
    return [{"length": rows[0]["length"], "peak_above_resting_mb": max(r["peak_above_resting_mb"] for r in rows),
             "step_s": max(r["step_s"] for r in rows), "all_to_all_s": max(r["all_to_all_s"] for r in rows)}
            for rows in zip(*per_rank)]


def report(results: dict, opts) -> str:
    one = {r["length"]: r for r in results["1"]}
    lines = [f"Llama {opts.layers} layers x {opts.width} wide, 8 query / 4 key-value heads, vocabulary 2048; one row "
             "per step; per rank: peak resident memory above the resting memory (MB), step time (s, forward and "
             "backward, slowest rank)", "",
             "| n | length | tokens per rank | peak MB per rank | vs n=1 at this length | step s | vs n=1 at the "
             "same tokens per rank | communicating s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, rows in results.items():
        n = label.split()[-1]  # "2" (Ulysses) or "ring 2"
        for r in rows:
            base, same = one.get(r["length"]), one.get(r["length"] // int(n))
            ratio = f"{r['peak_above_resting_mb'] / base['peak_above_resting_mb']:.2f}" if base else ""
            cost = f"{r['step_s'] / same['step_s']:.2f}" if same and n != "1" else ""
            lines.append(f"| {label} | {r['length']} | {r['length'] // int(n)} | {r['peak_above_resting_mb']} | {ratio} | "
                         f"{r['step_s']} | {cost} | {r['all_to_all_s']} |")
    lines.append("")
    for label, rows in results.items():
        fits = [r["length"] for r in rows if r["peak_above_resting_mb"] <= opts.cap_mb]
        lines.append(f"- {'n = ' * label.isdigit()}{label}: the longest measured length within {opts.cap_mb} MB per rank: "
                     f"{max(fits) if fits else 'none'}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ring-sizes", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cap-mb", type=float, default=200.0)
    opts = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.makedirs(RESULTS, exist_ok=True)
    results = {str(n): measure(n, opts, 29500 + 7 * i) for i, n in enumerate(opts.sizes)}
    results.update({f"ring {n}": measure(n, opts, 29600 + 7 * i, ring=True) for i, n in enumerate(opts.ring_sizes)})
    text = report(results, opts)
    print(text)
    with open(os.path.join(RESULTS, "long_context.json"), "w") as f:
        json.dump({"options": vars(opts), "results": results}, f, indent=1)
    with open(os.path.join(RESULTS, "long_context.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()

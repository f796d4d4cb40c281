"""optim muon against AdamW: the optimizer step's time and the optimizer's memory per rank, under DDP and FSDP2 on
2 gloo CPU ranks; and, under FSDP2, torch's Newton-Schulz on the DTensor shards against gathering each matrix once.

    python bench/muon.py [--layers 4 --width 512 --vocab 8192 --steps 4 --ranks 2]

Each rank (``torch.multiprocessing.spawn``, gloo, ``OMP_NUM_THREADS`` 1) builds the same GPT-2 shape from its config
(seeded), wraps it (DDP, or FSDP2's ``fully_shard`` on each block and the root), and builds the optimizer with
``toolkit.training.loop.build_optimizer`` (``adamw_torch``; ``muon`` with ``muon_ns_dtype`` bfloat16 and float32).
A step: forward and backward on the same random tokens, then ``optimizer.step()``, timed alone (a barrier before and
after, the slowest rank's time); reported: the median over ``--steps`` after one warm-up step. Memory: the bytes of
optimizer state this rank holds after the steps (FSDP2: its shards), and the growth of the process's peak RSS
(VmHWM, reset through /proc/self/clear_refs before each step) during the optimizer step: the transient working set.

The Newton-Schulz comparison (FSDP2's layout; ``--ns-only`` runs it alone): for each Muon matrix's shape, a random
matrix as a DTensor (Shard(0) over the ranks), torch's ``_zeropower_via_newtonschulz`` on the DTensor (each matmul a
distributed operation) against ``full_tensor()`` (one all-gather) + the same function on the whole matrix on every
rank, and against an owner rank per matrix (round robin: gather to it, orthogonalise once, scatter the shards); all
in fp32 (``toolkit.training.optimizers.NewtonSchulzDtype``); the results are compared (max |difference|).
Writes ``bench/results/muon.json`` and ``.md`` (``--ns-only``: ``muon-ns.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
OPTIMIZERS = {"adamw_torch": {}, "muon bf16": {"optim": "muon", "muon_ns_dtype": "bfloat16"},
              "muon fp32": {"optim": "muon", "muon_ns_dtype": "float32"}}


def peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def held_state(optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for v in state.values():
            if hasattr(v, "to_local"):
                v = v.to_local()
            if hasattr(v, "untyped_storage") and v.dim() > 0 and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total


def build(args, strategy: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                        vocab_size=args.vocab, n_positions=args.seq, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model = GPT2LMHeadModel(config)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return model, DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model, model


def time_steps(args, strategy: str, fields: dict) -> dict:
    import torch
    import torch.distributed as dist

    from toolkit.config import TrainingArguments
    from toolkit.training.loop import build_optimizer

    model, wrapped = build(args, strategy)
    train = TrainingArguments(output_dir=tempfile.gettempdir(), learning_rate=0.02, weight_decay=0.01, **fields)
    optimizer = build_optimizer(model, train)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    times, growth = [], []
    for step in range(args.steps + 1):
        wrapped(input_ids=ids, labels=ids).loss.backward()
        dist.barrier()
        peak_rss_reset()
        before, start = peak_rss(), time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        dist.barrier()
        grown = peak_rss() - before
        optimizer.zero_grad(set_to_none=True)
        slowest = torch.tensor([elapsed, float(grown)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if step:  # the first step allocates the state
            times.append(float(slowest[0]))
            growth.append(float(slowest[1]))
    return {"step_s": statistics.median(times), "state_bytes": held_state(optimizer),
            "transient_rss_bytes": statistics.median(growth)}


def _gathered(grad, coeffs, world: int, rank: int):
    """Every rank gathers the whole matrix (one all-gather) and orthogonalises it; this rank's rows of the result."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(grad.full_tensor(), coeffs, 5, 1e-7).chunk(world, dim=0)[rank]


def _owner_rank(grad, index: int, coeffs, world: int, rank: int):
    """The owner scheme: matrix ``index``'s shards gathered on one rank (index % world), orthogonalised there once,
    its shards scattered back; this rank's shard of the result."""
    import torch
    import torch.distributed as dist
    from torch.optim._muon import _zeropower_via_newtonschulz

    local, owner = grad.to_local().contiguous(), index % world
    parts = [torch.empty_like(local) for _ in range(world)] if rank == owner else None
    dist.gather(local, parts, dst=owner)
    chunks = list(_zeropower_via_newtonschulz(torch.cat(parts), coeffs, 5, 1e-7).chunk(world)) if rank == owner else None
    mine = torch.empty_like(local)
    dist.scatter(mine, [c.contiguous() for c in chunks] if chunks else None, src=owner)
    return mine


def newton_schulz_paths(args) -> dict:
    """torch's iterations on each Muon matrix as a Shard(0) DTensor, against gathering it once on every rank, and
    against one owner rank per matrix (gather, orthogonalise once, scatter); fp32 all three."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    from toolkit.training.optimizers import NewtonSchulzDtype, muon_split

    model, _ = build(args, "none")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    coeffs, rank, world = (DEFAULT_A, DEFAULT_B, DEFAULT_C), dist.get_rank(), dist.get_world_size()
    seconds, diff = {"dtensor_s": 0.0, "gathered_s": 0.0, "owner_s": 0.0}, 0.0

    def timed(key, fn, *fn_args):
        dist.barrier()
        start = time.perf_counter()
        out = fn(*fn_args)
        dist.barrier()
        seconds[key] += time.perf_counter() - start
        return out

    for index, (_, p) in enumerate(muon_split(model)[0]):
        grad = distribute_tensor(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())), mesh,
                                 [Shard(0)])
        with NewtonSchulzDtype(torch.float32):
            on_shards = timed("dtensor_s", _zeropower_via_newtonschulz, grad, coeffs, 5, 1e-7).to_local()
            mine = timed("gathered_s", _gathered, grad, coeffs, world, rank)
            owned = timed("owner_s", _owner_rank, grad, index, coeffs, world, rank)
        diff = max(diff, float((on_shards - mine).abs().max()), float((on_shards - owned).abs().max()))
    return {**seconds, "max_abs_diff": diff}


def worker(rank: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(args.ranks))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    results = {}
    for strategy in [] if args.ns_only else args.strategies.split(","):
        for name, fields in OPTIMIZERS.items():
            results[f"{strategy} {name}"] = time_steps(args, strategy, fields)
    if "fsdp2" in args.strategies:
        results["newton-schulz"] = newton_schulz_paths(args)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,fsdp2")
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--ns-only", action="store_true", help="only the Newton-Schulz comparison (FSDP2's shards)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args, queue), nprocs=args.ranks)
    results = {"args": vars(args), **queue.get()}
    os.makedirs(RESULTS, exist_ok=True)
    name = "muon-ns" if args.ns_only else "muon"  # the comparison alone keeps the full run's files
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=2)
    lines = [f"GPT-2 shape {args.layers} x {args.width}, vocab {args.vocab}, {args.ranks} gloo CPU ranks, 1 thread each",
             "", "| strategy, optimizer | optimizer step (s, median) | optimizer state per rank (MB) | "
                 "peak RSS growth in the step (MB) |", "|---|---|---|---|"]
    for key, r in results.items():
        if isinstance(r, dict) and "step_s" in r:
            lines.append(f"| {key} | {r['step_s']:.3f} | {r['state_bytes'] / 1e6:.1f} | "
                         f"{r['transient_rss_bytes'] / 1e6:.1f} |")
    if "newton-schulz" in results:
        ns = results["newton-schulz"]
        lines += ["", f"Newton-Schulz (fp32) over every Muon matrix, Shard(0) over the ranks: on the DTensor "
                      f"{ns['dtensor_s']:.3f} s, gathered on every rank {ns['gathered_s']:.3f} s, one owner rank a "
                      f"matrix {ns['owner_s']:.3f} s; max |difference| {ns['max_abs_diff']:.1e}"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

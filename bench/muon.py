"""optim muon against AdamW: the optimizer step's time and the optimizer's memory per rank, under DDP and FSDP2 on
2 gloo CPU ranks (under FSDP2 also with torch's DTensor path instead of the owner ranks); under FSDP2, the
Newton-Schulz iterations three ways; and the validation loss on README's SmolLM2 run.

    python bench/muon.py [--layers 4 --width 512 --vocab 8192 --steps 4 --ranks 2]
    python bench/muon.py --ns-only ...        # the Newton-Schulz comparison alone
    python bench/muon.py --loss [--loss-steps 10]

Each rank (``torch.multiprocessing.spawn``, gloo, ``OMP_NUM_THREADS`` 1) builds the same GPT-2 shape from its config
(seeded), wraps it (DDP, or FSDP2's ``fully_shard`` on each block and the root), and builds the optimizer with
``toolkit.training.loop.build_optimizer`` (``adamw_torch``; ``muon`` with ``muon_ns_dtype`` bfloat16 and float32;
under FSDP2 both again with ``MuonWithAdamW.sharded`` "dtensor": torch's Muon on the DTensor shards).
A step: forward and backward on the same random tokens, then ``optimizer.step()``, timed alone (a barrier before and
after, the slowest rank's time); reported: the median over ``--steps`` after one warm-up step. Memory: the bytes of
optimizer state this rank holds after the steps (FSDP2: its shards), and the growth of the process's peak RSS
(VmHWM, reset through /proc/self/clear_refs before each step) during the optimizer step: the transient working set.

The Newton-Schulz comparison (FSDP2's layout; ``--ns-only`` runs it alone): for each Muon matrix's shape, a random
matrix as a DTensor (Shard(0) over the ranks), torch's ``_zeropower_via_newtonschulz`` on the DTensor (each matmul a
distributed operation) against ``full_tensor()`` (one all-gather) + the same function on the whole matrix on every
rank, and against owner ranks (``toolkit.training.newton_schulz``, what ``optim muon`` runs: owners by cost, every
matrix gathered to its owner, the owners iterating at the same time, the shards scattered back); all
in fp32 (``toolkit.training.optimizers.NewtonSchulzDtype``); the results are compared (max |difference|).
Writes ``bench/results/muon.json`` and ``.md`` (``--ns-only``: ``muon-ns.json`` and ``.md``).

The validation loss (``--loss``; README command 1's model and data, ``python -m toolkit offline smollm2
outputs/models/smollm2`` first): ``recipes/gpt2.py --config recipes/configs/smollm2_pydoc.yaml`` as one process
(micro batch 4 x accumulation 2: the README run's 8 rows a step), ``--loss-steps`` N steps, evaluated at the start and
at step N on the config's held-out rows, twice on the same data and seed: AdamW at the config's rate (5e-5, the
fine-tuning rate README's run uses) and ``optim muon`` at 0.02 (Keller Jordan's) with ``muon_adamw_learning_rate``
its default (3e-4) and bf16 iterations (the defaults); the config's cosine schedule and 3 warm-up steps for both.
Writes ``bench/results/muon-loss.json`` and ``.md``: the evaluation losses and each run's time.
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
# FSDP2 only: the same optimizer on torch's DTensor path (MuonWithAdamW's sharded "dtensor": every matmul of the
# iterations a distributed one), against the owner ranks above
DTENSOR_PATH = {"muon bf16, torch's DTensor path": "muon bf16", "muon fp32, torch's DTensor path": "muon fp32"}


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


def time_steps(args, strategy: str, fields: dict, sharded: str = "owner") -> dict:
    import torch
    import torch.distributed as dist

    from toolkit.config import TrainingArguments
    from toolkit.training.loop import build_optimizer

    model, wrapped = build(args, strategy)
    train = TrainingArguments(output_dir=tempfile.gettempdir(), learning_rate=0.02, weight_decay=0.01, **fields)
    optimizer = build_optimizer(model, train)
    if hasattr(optimizer, "sharded"):
        optimizer.sharded = sharded
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


def _owner_ranks(grads: list, coeffs, world: int, rank: int) -> list:
    """The owner scheme as ``optim muon`` runs it (``toolkit.training.newton_schulz``): every matrix gathered to its
    owner, each rank iterating on the ones it owns (at the same time), the shards scattered back; this rank's."""
    import torch
    import torch.distributed as dist
    from torch.optim._muon import _zeropower_via_newtonschulz

    from toolkit.training.newton_schulz import assign_owners, gather_to_owner, scatter_from_owner

    group = dist.group.WORLD
    owners = assign_owners([g.shape for g in grads], world)
    whole = [gather_to_owner(g.to_local(), g.shape, 0, group, o) for g, o in zip(grads, owners)]
    whole = [None if w is None else _zeropower_via_newtonschulz(w, coeffs, 5, 1e-7) for w in whole]
    return [scatter_from_owner(w, g.to_local().shape, g.shape, 0, group, o, torch.float32, g.to_local().device)
            for w, g, o in zip(whole, grads, owners)]


def newton_schulz_paths(args) -> dict:
    """torch's iterations on each Muon matrix as a Shard(0) DTensor, against gathering it once on every rank, and
    against owner ranks (gather, orthogonalise once, scatter); fp32 all three."""
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

    grads = [distribute_tensor(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())), mesh,
                               [Shard(0)]) for _, p in muon_split(model)[0]]
    with NewtonSchulzDtype(torch.float32):
        on_shards = [timed("dtensor_s", _zeropower_via_newtonschulz, g, coeffs, 5, 1e-7).to_local() for g in grads]
        mine = [timed("gathered_s", _gathered, g, coeffs, world, rank) for g in grads]
        owned = timed("owner_s", _owner_ranks, grads, coeffs, world, rank)
    for a, b, c in zip(on_shards, mine, owned):
        diff = max(diff, float((a - b).abs().max()), float((a - c).abs().max()))
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
        for name, same in DTENSOR_PATH.items() if strategy == "fsdp2" else ():
            results[f"{strategy} {name}"] = time_steps(args, strategy, OPTIMIZERS[same], sharded="dtensor")
    if "fsdp2" in args.strategies:
        results["newton-schulz"] = newton_schulz_paths(args)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


LOSS_RUNS = {"adamw_torch": [], "muon": ["--optim", "muon", "--learning_rate", "0.02"]}


def validation_loss(args) -> dict:
    """Each optimizer's run of the SmolLM2 recipe (one process, subprocess), its evaluation losses and time."""
    import subprocess

    from toolkit.reporting.metrics import read_metrics

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "recipes")])}
    results = {}
    for name, fields in LOSS_RUNS.items():
        out = os.path.join(args.loss_dir, name)
        cmd = [sys.executable, os.path.join(ROOT, "recipes", "gpt2.py"), "--config",
               os.path.join(ROOT, "recipes", "configs", "smollm2_pydoc.yaml"), "--model_name_or_path", args.model,
               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
               "--max_steps", str(args.loss_steps), "--eval_steps", str(args.loss_steps), "--logging_steps", "1",
               "--report_to", "none", "--output_dir", out, *fields]
        start = time.perf_counter()
        with open(out + ".log", "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
        rows = read_metrics(out)
        results[name] = {"seconds": time.perf_counter() - start, "command": " ".join(cmd[1:]),
                         "eval_loss": {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r},
                         "lr": max(r["lr"] for r in rows if "lr" in r)}
        print(f"{name}: {results[name]['eval_loss']} in {results[name]['seconds']:.0f} s", flush=True)
    return results


def loss_table(results: dict, steps: int) -> str:
    lines = [f"SmolLM2-135M-Instruct on the pydoc text, one process, 8 rows x 128 tokens a step, {steps} steps",
             "", "| optimizer | peak lr | eval loss, step 0 | eval loss, step N | run (s) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        losses = sorted(r["eval_loss"].items(), key=lambda kv: int(kv[0]))
        lines.append(f"| {name} | {r['lr']:.2g} | {losses[0][1]:.4f} | {losses[-1][1]:.4f} (step {losses[-1][0]}) "
                     f"| {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--loss", action="store_true", help="only the validation loss, Muon against AdamW, on the "
                                                               "SmolLM2 recipe (one process)")
    parser.add_argument("--loss-steps", type=int, default=10)
    parser.add_argument("--model", default=os.path.join(ROOT, "outputs", "models", "smollm2"))
    parser.add_argument("--loss-dir", default=os.path.join(tempfile.gettempdir(), "bench-muon-loss"))
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    if args.loss:
        results = validation_loss(args)
        text = loss_table(results, args.loss_steps)
        os.makedirs(RESULTS, exist_ok=True)
        json.dump({"args": vars(args), **results}, open(os.path.join(RESULTS, "muon-loss.json"), "w"), indent=2)
        open(os.path.join(RESULTS, "muon-loss.md"), "w").write(text)
        print(text)
        return 0
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
                      f"{ns['dtensor_s']:.3f} s, gathered on every rank {ns['gathered_s']:.3f} s, owner ranks "
                      f"(optim muon's) {ns['owner_s']:.3f} s; max |difference| {ns['max_abs_diff']:.1e}"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A pipeline's checkpoint (``toolkit.parallel.pipeline``): its stages' weights and optimizer state written in a plain
process's layout, and read back from one.

The layout is the one ``accelerator.save_state`` writes for one process or DDP: ``model.safetensors`` keyed by the
whole model's names (a tied weight once, under its first name), ``optimizer.bin`` in torch's index form, numbered in
the order a one-process run's optimizer holds the parameters (``toolkit.training.loop.build_optimizer``: the weights that
decay, then the rest, each in the model's order), ``scheduler.bin``, and accelerate's own RNG files. So a checkpoint
written under any pipeline degree, replicated or FSDP2-sharded, resumes as written under one process, DDP, or a
pipeline of any other degree or schedule (each rank reads the tensors of its stages by name), and a one-process or
DDP checkpoint resumes under a pipeline; each parameter's AdamW moments move with its name.

Why not torchtitan's route (``torch.distributed.checkpoint``, every rank writing its stages' tensors by name, which
reshards across pipeline degrees without gathering): a DCP checkpoint loads under one process or DDP only after a
conversion (``toolkit.checkpointing.convert``'s ``plain``), and a plain one under a pipeline only through a reader of
its own; one layout for every non-sharded launch keeps resume in both directions a direct read. The cost: the first
rank holds the whole model's weights and optimizer state in host memory while it writes them (as the final export
gathers the weights already), which suits the models this toolkit pipelines on CPU ranks and small GPU jobs, not a
model whose optimizer state does not fit one host's memory (docs/strategies.md#pipeline-parallelism).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE = "model.safetensors", "optimizer.bin", "scheduler.bin"  # accelerate's


def plain_order(shapes: dict) -> list[list[str]]:
    """The names in each param group of a one-process run's optimizer (``toolkit.training.loop.build_optimizer``'s split: the
    weights of 2 or more dimensions decay, the others do not; an empty group is dropped), from the whole model's
    parameter shapes in its order (tied weights once)."""
    groups = [[n for n, s in shapes.items() if len(s) >= 2], [n for n, s in shapes.items() if len(s) < 2]]
    return [g for g in groups if g]


def _full(value):
    """A tensor as a whole (an FSDP2 shard gathered: collective over the stage's replicas), on the CPU."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().cpu() if torch.is_tensor(value) else value


def _my_optimizer_state(model, optimizer) -> dict:
    """{whole-model name: (its group's hyperparameters, its state with whole tensors)} of this rank's stages (the
    tied head left out: the first stage's copy holds the same moments). Collective under FSDP2 (the gather)."""
    hyper = {id(p): {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups for p in g["params"]}
    alias = model.tie_names[1] if model.tie_names else None
    mine = {}
    for name, p in model.named_parameters_by_model:
        state = {k: _full(v) for k, v in optimizer.state.get(p, {}).items()}  # every replica: the gather's order
        if name != alias and id(p) in hyper:
            mine[name] = (hyper[id(p)], state)
    return mine


def save(model, optimizer, scheduler, folder: str) -> None:
    """Collective: the weights and optimizer state of every stage, gathered on the first rank and written there into
    ``folder`` (which exists) as a plain process would; the scheduler (the same on every rank) beside them."""
    from safetensors.torch import save_file

    weights = model.gather_state_dict()  # the whole model on the first rank (both names of a tied weight)
    mine = _my_optimizer_state(model, optimizer)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if model.mesh_dp_rank() == 0 else {}, gathered, dst=0)
    if dist.get_rank() != 0:
        return
    by_name = {name: entry for part in gathered for name, entry in part.items()}
    if model.tie_names:
        weights.pop(model.tie_names[1])  # the head's name of the embedding: a plain checkpoint holds it once
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, MODEL_FILE))
    order = plain_order(model.shapes)
    index = {name: i for i, name in enumerate(n for group in order for n in group)}
    torch.save({"state": {index[n]: by_name[n][1] for n in index if by_name[n][1]},
                "param_groups": [{**by_name[group[0]][0], "params": [index[n] for n in group]} for group in order]},
               os.path.join(folder, OPTIMIZER_FILE))
    torch.save(scheduler.state_dict(), os.path.join(folder, SCHEDULER_FILE))


def _place(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor as ``like`` holds it: its device and dtype, and its FSDP2 shard when ``like`` is sharded (each
    rank cuts its own shard from the whole: no communication)."""
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = value.to(device=like.device, dtype=like.dtype)
        return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    return value.to(device=like.device, dtype=like.dtype)


def load(model, optimizer, scheduler, folder: str) -> None:
    """This rank's stages' weights and optimizer state, by name, from a plain checkpoint ``folder`` (written by
    ``save``, one process or DDP), and the scheduler. Every rank reads the files itself; the weights lazily."""
    from safetensors import safe_open

    source = {model.tie_names[1]: model.tie_names[0]} if model.tie_names else {}  # the head reads the embedding
    named = dict(model.named_parameters_by_model)
    with safe_open(os.path.join(folder, MODEL_FILE), framework="pt") as f, torch.no_grad():
        for name, p in named.items():
            value = _place(f.get_tensor(source.get(name, name)), p)
            (p.to_local() if hasattr(p, "to_local") else p).copy_(value.to_local() if hasattr(value, "to_local")
                                                                   else value)
    saved = torch.load(os.path.join(folder, OPTIMIZER_FILE), map_location="cpu", weights_only=True, mmap=True)
    order = [n for group in plain_order(model.shapes) for n in group]
    saved_names = [i for group in saved["param_groups"] for i in group["params"]]
    if len(saved_names) != len(order):
        raise RuntimeError(f"{folder}: its optimizer holds {len(saved_names)} parameters, the model {len(order)}: "
                           "not a checkpoint of this model's full training (every parameter trained)")
    index = {name: i for i, name in enumerate(order)}
    group_of = {i: g for g in saved["param_groups"] for i in g["params"]}
    names = {id(p): name for name, p in named.items()}
    for group in optimizer.param_groups:
        first = index[source.get(names[id(group["params"][0])], names[id(group["params"][0])])]
        group.update({k: v for k, v in group_of[first].items() if k != "params"})  # lr, initial_lr, betas, ...
        for p in group["params"]:
            i = index[source.get(names[id(p)], names[id(p)])]
            state = saved["state"].get(i, {})
            optimizer.state[p] = {k: v.clone() if k == "step" or not torch.is_tensor(v) else _place(v, p)
                                  for k, v in state.items()}
    scheduler.load_state_dict(torch.load(os.path.join(folder, SCHEDULER_FILE), weights_only=True))

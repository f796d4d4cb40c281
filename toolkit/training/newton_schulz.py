"""Newton-Schulz under sharded layouts (FSDP2, HSDP, TP): each sharded Muon matrix gets one owner rank, which
gathers the matrix's momentum update from its shards, runs torch's iterations on it once, and scatters the result's
shards back; every rank updates its own shard.

Why: torch's ``Muon`` on a DTensor runs every matmul of the iterations as a distributed operation (what the
strategies ran before, correct but slower), and gathering each matrix on every rank repeats the whole work on each
rank. Measured on 2 gloo CPU ranks (docs/performance.md, ``bench/muon.py --ns-only``): the owner scheme is the
cheapest of the three, and the result is the iterations on the whole matrix, which is what one process computes.

The scheme, for the Muon matrices of one param group (``owner_muon_step``):
  1. momentum and Nesterov's blend on each rank's shard (elementwise: torch's ``_single_tensor_muon``'s two lines);
  2. owners assigned by the iterations' cost (largest first, to the rank with the least work so far: the same answer
     on every rank, from the shapes alone); every matrix's shards gathered to its owner (``dist.gather`` in the
     shard dimension's process group; padded to torch.chunk's largest piece, as DTensor's Shard splits);
  3. each rank iterates on the matrices it owns (torch's ``_zeropower_via_newtonschulz`` inside
     ``NewtonSchulzDtype``): the ranks work at the same time;
  4. the results' shards scattered back, the decoupled weight decay and the shape-adjusted step on each shard
     (torch's ``_adjust_lr`` on the whole shape).
A rank holds, while it iterates, the whole matrices it owns (about 1/W of Muon's group on W shard ranks) and one
matrix's working set. A matrix sharded on more than one mesh dimension (FSDP2 x TP) stays on torch's DTensor path;
a replicated one is iterated whole on every rank (as torch's path does).
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


class NewtonSchulzDtype(TorchFunctionMode):
    """Inside: ``Tensor.bfloat16()`` returns a copy in ``dtype`` (torch's Muon casts only the Newton-Schulz input:
    toolkit.training.optimizers' docstring says why)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16:
            return args[0].to(self.dtype, copy=True)
        return func(*args, **(kwargs or {}))


def owner_layout(p) -> tuple[int, int] | None:
    """(mesh dimension, tensor dimension) of a DTensor sharded on exactly one mesh dimension (the others
    replicated); ``(-1, -1)`` for a replicated one; None for another layout (torch's DTensor path keeps it)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor) or not isinstance(p.grad, DTensor) or p.grad.placements != p.placements:
        return None
    shards = [(i, s.dim) for i, s in enumerate(p.placements) if type(s) is Shard]
    if len(shards) > 1 or not all(type(s) in (Shard, Replicate) for s in p.placements):
        return None
    return shards[0] if shards else (-1, -1)


def ns_cost(shape) -> int:
    """The iterations' flops on an R x C matrix, up to a constant: m = min, n = max: 4 m^2 n + 2 m^3 a step."""
    m, n = sorted(shape)
    return 4 * m * m * n + 2 * m ** 3


def assign_owners(shapes: list, world: int) -> list[int]:
    """Each matrix's owner rank: largest cost first, to the rank with the least cost so far (ties: lowest rank)."""
    owners, load = [0] * len(shapes), [(0, r) for r in range(world)]
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        cost, rank = heapq.heappop(load)
        owners[i] = rank
        heapq.heappush(load, (cost + ns_cost(shapes[i]), rank))
    return owners


def _sizes(length: int, world: int) -> list[int]:
    """Each rank's rows along a sharded dimension: torch.chunk's pieces, then empty ones (DTensor's Shard)."""
    pieces = [len(c) for c in torch.arange(length).chunk(world)]
    return pieces + [0] * (world - len(pieces))


def _padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t.contiguous()
    pad = list(t.shape)
    pad[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad)], dim=dim)


def gather_to_owner(local: torch.Tensor, full_shape, dim: int, group, owner: int) -> torch.Tensor | None:
    """The whole matrix on ``owner`` (a rank of ``group``), None elsewhere."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = _sizes(full_shape[dim], world)
    send = _padded(local, dim, sizes[0])
    parts = [torch.empty_like(send) for _ in range(world)] if rank == owner else None
    dist.gather(send, parts, group=group, group_dst=owner)
    if rank != owner:
        return None
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim=dim)


def scatter_from_owner(full: torch.Tensor | None, local_shape, full_shape, dim: int, group, owner: int,
                       dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's shard of ``full`` (held by ``owner``), received on ``device``: the shard's own (a GPU's under
    NCCL, which sends no host tensor, and where the weight it updates lives)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = _sizes(full_shape[dim], world)
    shape = list(local_shape)
    shape[dim] = sizes[0]
    mine = torch.empty(shape, dtype=dtype, device=device)
    pieces = None
    if rank == owner:
        pieces = [_padded(piece, dim, sizes[0]) for piece in full.split(sizes, dim=dim)]
    dist.scatter(mine, pieces, group=group, group_src=owner)
    return mine.narrow(dim, 0, sizes[rank])


def owner_muon_step(group: dict, params: list, state: dict, ns_dtype: torch.dtype) -> None:
    """torch's Muon step (``_single_tensor_muon``) for ``params`` (each with an ``owner_layout``), the iterations
    by the owner scheme (module docstring). ``state``: the optimizer's, holding each one's ``momentum_buffer`` as
    torch's Muon does (a DTensor like the gradient), so checkpoints are the same either way."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    lr, momentum, decay = float(group["lr"]), group["momentum"], group["weight_decay"]
    updates = []
    for p in params:
        if "momentum_buffer" not in state[p]:
            state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, grad = state[p]["momentum_buffer"].to_local(), p.grad.to_local()
        buf.lerp_(grad, 1 - momentum)
        updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
    layouts = [owner_layout(p) for p in params]
    # the shard dimension's process group (HSDP: each replica's own group of shard ranks); None: replicated, the
    # whole matrix is on every rank, which iterates on it itself (as torch's path does)
    groups = [p.device_mesh.get_group(mesh_dim) if mesh_dim >= 0 else None for p, (mesh_dim, _) in
              zip(params, layouts)]
    owners = [0] * len(params)
    for size in {dist.get_world_size(g) for g in groups if g}:  # one size in practice: owners among its ranks
        index = [i for i, g in enumerate(groups) if g and dist.get_world_size(g) == size]
        for i, owner in zip(index, assign_owners([params[i].shape for i in index], size)):
            owners[i] = owner
    whole = [gather_to_owner(u, p.shape, dim, g, owner) if g else u
             for u, p, (_, dim), g, owner in zip(updates, params, layouts, groups, owners)]
    del updates
    with NewtonSchulzDtype(ns_dtype):
        for i, w in enumerate(whole):  # each input dropped once iterated: a rank holds its matrices and one's work
            whole[i] = None if w is None else _zeropower_via_newtonschulz(w, group["ns_coefficients"],
                                                                           group["ns_steps"], group["eps"])
    for p, o, (_, dim), g, owner in zip(params, whole, layouts, groups, owners):
        local = p.to_local()
        mine = scatter_from_owner(o, local.shape, p.shape, dim, g, owner, ns_dtype, local.device) if g else o
        local.mul_(1 - lr * decay)
        local.add_(mine, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))

"""The global gradient norm, and clipping to ``max_grad_norm``, exact on a CPU too (docs/pitfalls.md#cpu-norm).

torch's CPU kernel for an fp32 2-norm (``torch.linalg.vector_norm``, behind ``clip_grad_norm_``, ``get_total_norm``
and accelerate's ``clip_grad_norm_``) sums the squares in a single fp32 accumulator per vector lane: on a large
gradient the sum stops growing. A skewed 38M-weight gradient (GPT-2's embedding has 38.6M) came out 0.36% low, a
1M-weight one 1e-4 low, where ``g.pow(2).sum()`` (cascade summation) is within 1e-7 (pytorch/pytorch#169237,
#151761, open in torch 2.13); SmolLM2-135M's first logged norm moved by 6.6e-5. The norm is logged as ``grad_norm``
and scales every clipped step: a CPU run logged and clipped against a norm that depended on how the tensors are cut,
so 1 process, DDP and FSDP2 could disagree by as much. On a CPU the norm here is the square root of the squares'
sums (each gradient's, by chunks, over its shards where it is a DTensor), added in float64; the clipping is torch's
own (``clip_grads_with_norm_``: max_norm / (norm + 1e-6), at most 1).
Elsewhere (a GPU's reduction is a tree) accelerate's ``clip_grad_norm_`` runs, and so does FSDP1's own (its flat
parameters), and DeepSpeed clips inside its engine.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor, Partial, Replicate


def clip_grad_norm(accelerator: Accelerator, parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to ``max_norm`` (inf: no clipping) and return their global pre-clip
    2-norm, as ``accelerator.clip_grad_norm_`` does (not under DeepSpeed: its engine clips)."""
    fsdp1 = accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2
    if accelerator.device.type != "cpu" or fsdp1:
        return accelerator.clip_grad_norm_(parameters, max_norm)
    accelerator.unscale_gradients()  # a GradScaler's (fp16: the in-process tests'), as accelerate's does first
    by_mesh = defaultdict(list)  # torch clips the parameters of one device mesh at a time, as accelerate does
    for p in parameters:
        if p.grad is not None:
            by_mesh[getattr(p.grad, "device_mesh", None)].append(p)
    norm = total_norm([p.grad for params in by_mesh.values() for p in params])
    if max_norm != float("inf"):
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together (fp32, like torch's): each one's sum of squares by cascade summation,
    a DTensor's over its shards, added in float64.

    A DTensor's sum is this rank's shard's, partial over the mesh dimensions it is sharded on. The partial sums of
    all the gradients of one mesh and layout are reduced together, in one all-reduce: one ``full_tensor`` a gradient
    made one collective a parameter a step (a 242-parameter FSDP2 model on 2 gloo ranks, a shared 2-core CPU: 200 ms
    a norm, against 6-8 ms for accelerate's one all-reduce a mesh; 10-13 ms this way). Every rank holds the same
    gradients' layouts in the same order, so every rank makes the same collectives in the same order."""
    plain, partial = [], defaultdict(list)
    for g in grads:
        if isinstance(g, DTensor) and not any(p.is_partial() for p in g.placements):
            # this rank's shard, summed as a plain tensor (a DTensor op a gradient costs ~0.1 ms of dispatch): the
            # sum is partial over the dimensions the gradient is sharded on, the same on those it is replicated on
            layout = tuple(Partial() if p.is_shard() else Replicate() for p in g.placements)
            partial[(g.device_mesh, layout)].append(_squares(g.to_local()))
        elif isinstance(g, DTensor):  # a pending reduction: DTensor's own ops make it first
            s = g.float().pow(2).sum()
            partial[(s.device_mesh, tuple(s.placements))].append(s.to_local().double())
        else:
            plain.append(_squares(g))
    squares = [torch.stack(plain)] if plain else []
    for (mesh, placements), sums in partial.items():  # float64 on the wire too: the shards' sums added in float64
        squares.append(DTensor.from_local(torch.stack(sums), mesh, placements, run_check=False).full_tensor())
    if not squares:
        return torch.zeros((), dtype=torch.float32)
    return torch.cat(squares).sum().sqrt().float()


_CHUNK = 1 << 20


def _squares(t: torch.Tensor) -> torch.Tensor:
    """``t``'s sum of squares (float64): each 1M-element chunk's by cascade summation in fp32, the chunks added in
    float64. One ``t.float().pow(2).sum()`` wrote a temporary as big as the gradient (154 MB for GPT-2's embedding,
    twice that from bf16) and took 87-112 ms on it, a single CPU thread, against torch's kernel's 8 ms; a chunk stays
    in cache: 13 ms, as exact (3.9e-8 against float64 on a skewed 38.6M-weight gradient)."""
    if t.numel() <= _CHUNK:
        return t.float().pow(2).sum().double()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in t.reshape(-1).split(_CHUNK):
        total += chunk.float().pow(2).sum().double()
    return total

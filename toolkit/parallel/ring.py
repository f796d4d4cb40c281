"""Ring attention: causal attention over a sequence split across the n ranks of a group, key/value passed around.

``context_parallel_size: n``. The padded sequence is cut into 2n chunks; rank j holds chunks j and 2n-1-j (a head
and a tail chunk, as torch's and Megatron's context parallelism do: ``order``), so that under the causal mask every
rank does the same work at every step. In n steps each rank attends its queries to every rank's keys/values: at step
s it holds those of rank (j - s) mod n, the next rank's arriving meanwhile (``dist.batch_isend_irecv``: gloo runs
point-to-point sends and receives, so no all-gather, which would hold all n chunks at once, is needed). What a step
computes, with the chunks' order (2n positions of chunks, each of length c):

    s = 0: the rank's own two chunks, causally (the head chunk sees none of the tail chunk, the tail sees all of the
           head chunk and itself causally: one causal attention over the 2c positions as they lie);
    source rank i < j: both query chunks against the source's head chunk i (earlier than both), all of it; the
           source's tail chunk 2n-1-i lies after both query chunks: fully masked, skipped (not computed, not merged);
    source rank i > j: the query tail chunk 2n-1-j against both source chunks (earlier than it), all of them; the
           query head chunk j lies before both: fully masked, skipped.

Each step runs the flash-attention kernel (CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``; CUDA: the
memory-efficient kernel, which takes fp32 as well; not run on a GPU here yet: ``bench/gpu_check.sh`` checks it) and
returns its output and log-sum-exp per query; the partial outputs merge by their log-sum-exps (``_merge``), exactly
what one softmax over every key gives. The backward (``_RingAttention.backward``) runs the kernels' backward per
step with the merged output and log-sum-exp (what flash attention's backward needs to rebuild each block's
probabilities), passes the keys/values around the ring again, and sends the gradients of the keys/values along with
them, so each reaches its owner after n hops.

Every row has a real causal diagonal, so no query row is ever fully masked: a query's log-sum-exp is finite from
step 0 on. Rows are right-padded: pad positions come after every real token, no real query sees them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def order(length: int, n: int) -> list[tuple[int, int]]:
    """The (start, stop) of the 2n chunks a padded row of ``length`` (a multiple of 2n) is cut into, in the order the
    ranks hold them: rank j's head chunk j then its tail chunk 2n-1-j."""
    c = length // (2 * n)
    return [span for j in range(n) for span in ((j * c, (j + 1) * c), ((2 * n - 1 - j) * c, (2 * n - j) * c))]


def _forward_kernel(q, k, v, causal: bool, scale):
    """One block's attention: (output batch x heads x positions x dim, log-sum-exp batch x heads x positions fp32)."""
    if q.device.type == "cuda":
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]].float()  # without dropout its seed and offset are not used
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _backward_kernel(grad, q, k, v, out, lse, causal: bool, scale):
    """The block's (dq, dk, dv) given the merged output and log-sum-exp of its queries."""
    if q.device.type == "cuda":  # the efficient kernel's log-sum-exp is padded to a multiple of 32 positions
        padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), float("inf"), device=lse.device)
        padded[..., :lse.shape[-1]] = lse
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, None, out, padded, zero, zero, 0.0, [True, True, True, False], causal, scale=scale)[:3]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale)


def _merge(out, lse, block_out, block_lse):
    """Two softmax-normalised partial outputs over disjoint keys merged into the one over their union (fp32)."""
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - new).unsqueeze(-1),
            new)


def _blocks(step: int, rank: int, n: int, c: int):
    """What step ``step`` computes on ``rank``: (query slice, key/value slice, causal) of the local 2c positions, one
    or two entries; the fully masked blocks are left out (module docstring)."""
    if step == 0:
        return [(slice(0, 2 * c), slice(0, 2 * c), True)]
    source = (rank - step) % n
    if source < rank:
        return [(slice(0, 2 * c), slice(0, c), False)]
    return [(slice(c, 2 * c), slice(0, 2 * c), False)]


class _Ring:
    """Point-to-point exchange around a group's ring: every rank sends to the next and receives from the previous."""

    def __init__(self, group):
        self.group, self.n, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.n], ranks[(self.rank - 1) % self.n]

    def start(self, tensors):
        """Send ``tensors`` on, receive the previous rank's (same shapes); returns (works, received)."""
        tensors = [t.contiguous() for t in tensors]  # gloo sends contiguous tensors only
        received = [torch.empty_like(t) for t in tensors]
        ops = [op for sent, got in zip(tensors, received)
               for op in (dist.P2POp(dist.isend, sent, self.next, self.group),
                          dist.P2POp(dist.irecv, got, self.prev, self.group))]
        return dist.batch_isend_irecv(ops), received


def _wait(works) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    """Causal ring attention of this rank's 2c query positions (batch x heads x 2c x dim; keys/values with as many
    heads) over the group's whole sequence, laid out by ``order``."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        ring = _Ring(group)
        c = q.shape[2] // 2
        # contiguous, for the sends and the gradients' layout (zeros_like keeps a view's strides; GPT-2's key/value
        # are strided views of one projection), and of one dtype: the kernels take no mix of dtypes
        ctx.dtypes = (k.dtype, v.dtype)
        q, k, v = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
        out, lse, kv = None, None, (k, v)
        for step in range(ring.n):
            works, arriving = ring.start(kv) if step < ring.n - 1 else ([], None)
            for qs, ks, causal in _blocks(step, ring.rank, ring.n, c):
                block_out, block_lse = _forward_kernel(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal, scale)
                if out is None:  # step 0 covers every query: the later blocks merge into its rows
                    out, lse = block_out.float(), block_lse.float()
                else:
                    out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            _wait(works)
            kv = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        c = q.shape[2] // 2
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv, dkv = (k, v), None
        for step in range(ring.n):
            works, arriving = ring.start(kv) if step < ring.n - 1 else ([], None)
            own = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
            for qs, ks, causal in _blocks(step, ring.rank, ring.n, c):
                bq, bk, bv = _backward_kernel(grad[:, :, qs], q[:, :, qs].contiguous(),
                                              kv[0][:, :, ks].contiguous(), kv[1][:, :, ks].contiguous(),
                                              out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal,
                                              ctx.scale)
                dq[:, :, qs] += bq.float()
                own[0][:, :, ks] += bk.float()
                own[1][:, :, ks] += bv.float()
            # the key/value gradients travel with the keys/values: what the earlier holders added, plus this rank's
            dkv = own if dkv is None else [a + b for a, b in zip(dkv, own)]
            dkv_works, dkv = ring.start(dkv) if ring.n > 1 else ([], dkv)  # a ring of one: its own
            _wait(works)
            _wait(dkv_works)
            kv = arriving
        # after n hops (the last one after the last step) the sums for this rank's own keys/values have arrived
        return dq.to(q.dtype), dkv[0].to(ctx.dtypes[0]), dkv[1].to(ctx.dtypes[1]), None, None


def ring_attention(q, k, v, group, scale=None):
    """Causal attention of this rank's positions (``order``) over the group's sequence: batch x heads x 2c x dim."""
    return _RingAttention.apply(q, k, v, group, scale)

"""Causal-LM loss with exact normalisation over the accumulated global batch.

The objective of one optimizer step is the mean token loss over its whole global batch:

    L = (1 / T) * sum over ranks r, micro-steps m, target tokens t of  CE(t)        T = target tokens of the step

Averaging per micro-batch instead (mean of means) weights a token in a short micro-batch more than one in a long
micro-batch: the 2024 transformers accumulation bug (docs/pitfalls.md#loss-per-micro-batch). So each micro-step backpropagates its *summed* token
loss, divided by T (all ranks, all micro-steps, counted before the first backward) and multiplied by W * k, because
the framework then divides again:

    - DDP / FSDP average gradients over the W ranks (x 1/W);
    - ``accelerator.backward`` divides by k (and DeepSpeed's engine does the same, ``scale_wrt_gas``) (x 1/k);

leaving sum_r sum_m grad(sum CE) / T = grad L, identical on any world size and accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Target tokens after the causal shift: position i predicts label i+1, so the first label of a row is no target."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels moved one position left, the last position padded with IGNORE_INDEX: position i's target is label i+1.

    Shifting the (small, integer) labels instead of slicing the logits (``logits[..., :-1, :]``) keeps the logits as
    they are: the slice-and-reshape copied the whole batch x seq x vocab tensor every micro-step and scattered its
    gradient back (docs/performance.md#the-step; the sum unchanged). transformers' ``ForCausalLMLoss`` shifts the
    same way.
    """
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def row_index(labels: torch.Tensor, row_lengths: torch.Tensor | None) -> torch.Tensor:
    """Each position's row, flattened: the batch's rows, or with ``row_lengths`` the packed rows that a flattened
    micro-batch (one row, ``toolkit.data.packing.collate_packed``) holds side by side."""
    batch, seq = labels.shape
    if row_lengths is None:
        return torch.arange(batch, device=labels.device).repeat_interleave(seq)
    return torch.arange(len(row_lengths), device=labels.device).repeat_interleave(row_lengths, output_size=batch * seq)


def token_losses(logits: torch.Tensor, labels: torch.Tensor,
                 row_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row summed cross-entropy (fp32) and per-row target counts, for shifted next-token prediction; the rows
    of a flattened packed micro-batch with ``row_lengths`` (``row_index``).

    Our own function rather than the model's ``loss_function`` (``ForCausalLMLoss`` via ``labels=`` and
    ``num_items_in_batch=``): evaluation needs per-row sums (``gather_for_metrics`` drops repeated rows), the chunked
    loss projects hidden states itself, and the normalisation must be ours (``micro_step_loss``) for every model class.
    """
    targets = shift_labels(labels)
    ce = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),  # no copy: .float() of fp32 and reshape of contiguous are views
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(targets.shape)
    if row_lengths is not None:
        rows = row_index(labels, row_lengths)
        sums = torch.zeros(len(row_lengths), dtype=ce.dtype, device=ce.device).index_add(0, rows, ce.flatten())
        return sums, torch.zeros_like(row_lengths).index_add(0, rows, (targets != IGNORE_INDEX).flatten().long())
    return ce.sum(dim=-1), (targets != IGNORE_INDEX).sum(dim=-1)


def row_logit_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the sum over its target positions of the mean logit over the vocabulary (fp32): TRL's
    ``logits/chosen`` and ``logits/rejected`` are these summed over the completions and divided by their tokens."""
    with torch.no_grad():
        mask = shift_labels(labels) != IGNORE_INDEX
        return (logits.float().mean(dim=-1) * mask).sum(dim=-1)


def chunked_token_losses(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                         chunk_size: int, num_chunks: int = 0, mean_logits: bool = False,
                         row_lengths: torch.Tensor | None = None, fused: bool = False) -> tuple[torch.Tensor, ...]:
    """``token_losses`` of ``head(hidden)`` without ever holding the logits of the whole micro-batch.

    The (batch x seq) positions are taken ``chunk_size`` at a time: project to the vocabulary, cross-entropy in fp32,
    add into the per-row sums. Each chunk runs under non-reentrant checkpointing, so autograd keeps only the chunk's
    hidden states and recomputes its logits in the backward pass: peak logits memory is one chunk's
    (chunk_size x vocab x 4 bytes, and as much again for their gradient) instead of batch x seq x vocab x 4
    (4 x 1024 x 151936 fp32 = 2.5 GB). ``head`` is called as a module, so ZeRO-3 / FSDP gather its weight as usual.

    ``num_chunks``: call ``head`` at least this many times, the chunks past the data empty. Under ZeRO-3 each call
    all-gathers the head's weight (and its recompute in the backward pass gathers it again), so every rank must make
    the same number of calls whatever its micro-batch's padded length: the caller passes the count for the longest
    possible micro-batch (rows x block_size).

    ``mean_logits`` (evaluation, under ``no_grad``): also each row's ``row_logit_sums``, from the same chunks' logits.

    ``fused`` (what ``loss_chunk_size`` runs, unless ``mean_logits`` or ``can_fuse`` says no): torch's
    ``F.linear_cross_entropy`` in chunks of ``chunk_size`` instead, one call of ``head`` for the whole micro-batch
    (``_fused_cross_entropy``). It keeps no logits between forward and backward either, and unlike the checkpointed
    chunks no head-sized weight gradient per chunk; ``num_chunks`` is then moot (one gather of the head per call on
    every rank). Measured against the checkpointed chunks in docs/performance.md#the-loss-without-logits.
    """
    from torch.utils.checkpoint import checkpoint

    batch, seq = labels.shape
    targets = shift_labels(labels)
    flat_hidden, flat_targets = hidden.reshape(batch * seq, -1), targets.reshape(-1)
    rows = row_index(labels, row_lengths)
    row_loss = torch.zeros(batch if row_lengths is None else len(row_lengths), dtype=torch.float32, device=hidden.device)
    if fused and not mean_logits and can_fuse(head):
        ce = _fused_cross_entropy(flat_hidden, flat_targets, head, chunk_size)
        return row_loss.index_add(0, rows, ce), _row_counts(targets, flat_targets, rows, row_lengths)
    chunks = max(num_chunks, -(-batch * seq // chunk_size))
    if chunks > num_chunks > 0:
        raise ValueError(f"a micro-batch of {batch} x {seq} positions needs {chunks} chunks of {chunk_size}, more than "
                         f"the {num_chunks} every rank was told to run")
    row_logits = torch.zeros_like(row_loss) if mean_logits else None
    for start in range(0, chunks * chunk_size, chunk_size):
        part = slice(start, start + chunk_size)
        if mean_logits:  # no recompute to save memory for: the chunk's logits are used twice, then dropped
            if torch.is_grad_enabled():
                raise ValueError("mean_logits is for evaluation: call it under torch.no_grad()")
            logits = head(flat_hidden[part]).float()
            ce = F.cross_entropy(logits, flat_targets[part], ignore_index=IGNORE_INDEX, reduction="none")
            row_logits = row_logits.index_add(0, rows[part], logits.mean(dim=-1) * (flat_targets[part] != IGNORE_INDEX))
        else:
            ce = checkpoint(_chunk_cross_entropy, flat_hidden[part], flat_targets[part], head, use_reentrant=False)
        row_loss = row_loss.index_add(0, rows[part], ce)
    counts = _row_counts(targets, flat_targets, rows, row_lengths)
    return (row_loss, counts, row_logits) if mean_logits else (row_loss, counts)


def _row_counts(targets, flat_targets, rows, row_lengths) -> torch.Tensor:
    if row_lengths is None:
        return (targets != IGNORE_INDEX).sum(dim=-1)
    return torch.zeros_like(row_lengths).index_add(0, rows, (flat_targets != IGNORE_INDEX).long())


def _chunk_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


def can_fuse(head: torch.nn.Module) -> bool:
    """Whether ``head`` is a plain ``nn.Linear`` on a plain weight, which ``F.linear_cross_entropy`` reproduces: not a
    LoRA-wrapped or quantized head, not a tensor-parallel shard (a DTensor, which its chunked op does not take)."""
    from torch.distributed.tensor import DTensor

    return type(head) is torch.nn.Linear and not isinstance(head.weight, DTensor)


def _fused_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Linear,
                         chunk_size: int, temperature: float = 1.0, entropy: bool = False) -> torch.Tensor:
    """Per-position cross-entropy of ``head(hidden) / temperature`` by ``F.linear_cross_entropy``
    (``reduction="none"``: its backward recomputes each chunk's logits from the saved hidden states and weight), in
    fp32 as ``token_losses``. ``entropy`` (GRPO's metric): also each position's entropy of that distribution,
    ``chunk_size`` positions at a time under no_grad (``_entropies``); then a (2, positions) tensor, the
    cross-entropies and the entropies.

    It runs as the head's own forward, through ``head(...)``: the module's hooks are what gather a sharded weight
    (ZeRO-3's pre-forward hook, and its pre-backward hook on the output for the backward pass; FSDP2 unshards the
    root, which holds the head, around the whole forward). Calling the functional op on ``head.weight`` directly
    would read ZeRO-3's empty placeholder. The entropies are taken inside the same call, so that every rank calls
    the head once per micro-batch whatever its length (ZeRO-3 gathers the weight on each call, collectively)."""
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=max(1, min(chunk_size, len(targets))),
                                                 chunking_method=None)

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight, bias = head.weight, head.bias
        if x.dtype != torch.float32:  # fp32 cross-entropy, as the materialised path's logits.float()
            x, weight = x.float(), weight.float()
            bias = bias.float() if bias is not None else None
        scaled_x, scaled_bias = x, bias
        if temperature != 1.0:  # (x W^T + b) / t, the logits' division, as x/t W^T + b/t: no logits-sized tensor
            scaled_x = x / temperature
            scaled_bias = bias / temperature if bias is not None else None
        ce = F.linear_cross_entropy(scaled_x, weight, targets, linear_bias=scaled_bias, reduction="none",
                                    ignore_index=IGNORE_INDEX, options=options)
        if not entropy:
            return ce
        return torch.stack((ce, _entropies(x.detach(), weight.detach(), bias, temperature, chunk_size)))

    head.forward = forward  # an instance attribute, for this call only: nn.Module.__call__ runs it inside the hooks
    try:
        return head(hidden)
    finally:
        del head.forward


@torch.no_grad()
def _entropies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
               chunk_size: int) -> torch.Tensor:
    """Each row's entropy of softmax((x W^T + b) / temperature), ``chunk_size`` rows at a time. TRL's definition
    (``trl.trainer.utils.entropy_from_logits``: ``-(exp(logp) * logp).sum(-1)``, chunked along the positions as
    there) and the materialised path's arithmetic (``toolkit.tasks.grpo.loss.completion_logps``); a metric, so no
    gradient. At most two chunk-sized fp32 buffers live at once (the logits, then their log-softmax and its
    exp, each product in place): 2 x chunk_size x vocab x 4 bytes."""
    parts = []
    for part in x.split(max(1, chunk_size)):
        logits = F.linear(part, weight, bias).float()
        logp = torch.log_softmax(logits.div_(temperature), dim=-1)
        del logits
        parts.append(logp.exp().mul_(logp).sum(-1).neg_())
        del logp
    return torch.cat(parts) if parts else x.new_zeros(0)


def chunked_completion_logps(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk_size: int,
                             temperature: float = 1.0, num_chunks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each of ``targets``, entropy of the distribution it was drawn from) under
    ``head(hidden) / temperature``, without ever holding the logits of all of ``hidden``'s positions: GRPO's
    ``toolkit.tasks.grpo.loss.completion_logps`` with ``loss_chunk_size``. ``hidden``: (positions, hidden size), the
    positions that predict ``targets`` (positions,).

    A plain linear head (``can_fuse``): one fused call (``_fused_cross_entropy``: the log-prob is minus the
    cross-entropy, the entropy a no_grad metric, both ``chunk_size`` positions at a time). Any other head: the
    checkpointed chunks of ``chunked_token_losses``, at least ``num_chunks`` of them, the same count on every rank
    (ZeRO-3's gathers)."""
    from torch.utils.checkpoint import checkpoint

    if can_fuse(head):
        ce, entropy = _fused_cross_entropy(hidden, targets, head, chunk_size, temperature, entropy=True)
        return -ce, entropy.detach()  # a row of the stacked output: cut from the graph, as the metric it is
    chunks = max(num_chunks, -(-len(targets) // chunk_size))
    if chunks > num_chunks > 0:
        raise ValueError(f"{len(targets)} completion positions need {chunks} chunks of {chunk_size}, more than the "
                         f"{num_chunks} every rank was told to run")
    logps, entropies = [], []
    for start in range(0, chunks * chunk_size, chunk_size):
        part = slice(start, start + chunk_size)
        logp, entropy = checkpoint(_chunk_logps, hidden[part], targets[part], head, temperature, use_reentrant=False)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each of ``targets``, entropy of the distribution it was drawn from) from ``logits``
    (positions x vocab) divided by the sampling ``temperature``, as TRL's fused head divides them; in fp32. GRPO's
    materialised path (``toolkit.tasks.grpo.loss.completion_logps``) and the checkpointed chunks below;
    ``entropy_grad`` False: the entropy as a metric, without a graph."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def _chunk_logps(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One checkpointed chunk: its log-probs (recomputed in the backward pass) and its entropies (no gradient)."""
    return token_logps(head(hidden), targets, temperature, entropy_grad=False)


def micro_step_loss(
    loss_sum: torch.Tensor,
    local_targets: torch.Tensor,
    global_targets: torch.Tensor,
    num_processes: int,
    accumulation_steps: int,
    normalization: str = "global_tokens",
) -> torch.Tensor:
    """The scalar to hand to ``accelerator.backward`` for one micro-step (see the module docstring)."""
    if normalization == "global_tokens":
        return loss_sum * (num_processes * accumulation_steps) / global_targets.clamp(min=1)
    if normalization == "per_micro_batch":
        # Wrong on purpose (pre-PR-#34191 behaviour), kept to show the bug: each micro-batch's own mean.
        return loss_sum / local_targets.clamp(min=1)
    raise ValueError(f"unknown loss normalization {normalization!r}")

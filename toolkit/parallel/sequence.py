"""Sequence parallelism: the ranks of a group share every sequence, each holding 1/n of its tokens.

``sequence_parallel_size: n`` (DeepSpeed-Ulysses; LLaMA-Factory's and ms-swift's name), or ``context_parallel_size:
n`` (ring attention, ``toolkit.parallel.ring``; axolotl's name): everything but the attention and which positions a
rank holds is the same for both (below; for the ring, read "ring attention" for step 2's all-to-all and SDPA). The W
launched ranks form W / n groups of n consecutive ranks (rank = replica x n + j); a group's ranks take the same rows
(the sample order's ``copies``: ``toolkit.data.order``), so the data-parallel size is W / n and the global batch
means what it means without the split. In a training micro-step each rank of a group:

    1. shifts the labels on the whole row (so the token at each cut is a target exactly once), pads the row to a
       multiple of n (padding: no target), and keeps its n-th of the positions: ids, global positions, targets;
    2. runs the model on its part; in every attention an all-to-all turns the group's sequence-sharded q/k/v into
       head-sharded ones over the whole sequence (``_AllToAll``: its backward is the inverse all-to-all), causal SDPA
       runs on n-th of the heads, and the inverse all-to-all gives each rank its positions back with every head;
    3. sums the cross-entropy of its positions' targets: the group's sums add up to the rows' sums.

The ring: step 1 pads the row to a multiple of 2n and keeps the rank's head and tail chunks (``ring.order``: the
causal work balanced over the ranks); step 2 is ``ring_attention``: every head, this rank's queries against each
rank's keys/values in turn (the key/value heads repeated to the query heads first: any head count). Padding-free
packing is refused under the ring (its document mask would have to follow the chunks around the ring; not built).

Padding needs no mask: rows are right-padded (``toolkit.data.loading.CausalLMCollator``), so under the causal mask
no real token sees a pad, and pad positions are no targets. Padding-free packing (``packing_strategy: bfd``; one
flattened row whose ``position_ids`` restart at each document) needs one: every rank of the group holds the whole
row, so each finds the documents from the row's positions (document id = running count of position 0, each pad
position a document of its own) and, after the all-to-all, attends block-causally (a boolean mask over the whole
sequence: positions^2 bytes). The mask transformers builds from a rank's own positions alone is not used in
training.

Heads: the query heads must divide by n; key/value heads that do not (fewer than n, GQA) are replicated (each
repeated n / gcd(kv, n) times, GQA's own sharing kept) before the all-to-all. Evaluation and generation
(``model.eval()``) run whole sequences on each rank with SDPA: the attention splits only in training mode, so
activation checkpointing's recompute splits too.

Gradients: each rank's backward gives the gradient of its own positions' loss with respect to its copy of the
weights, and the all-to-all's backward carries the other ranks' share of its attention to them; the gradient of the
micro-batch is the sum over the group's ranks. DDP (and FSDP2's reduce-scatter, whose shards span every rank)
averages over all W ranks, so the loss is scaled by W (not by the data-parallel size W / n):
``toolkit.loss.micro_step_loss`` with ``num_processes = W`` (``scale``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.env.launcher import launched_parallel_sizes, launched_strategy_name, launched_world_size
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX, shift_labels
from toolkit.parallel import ring

ATTENTION = "toolkit_ulysses"  # the name registered with transformers' AttentionInterface
RING = "toolkit_ring"  # the ring's
TASKS = ("causal-lm", "chat-sft")  # what the split's loss (next-token targets of causal LMs) is proven on


def check_launch(args) -> None:
    """The launch this process is in, against ``sequence_parallel_size``: DDP (ddp.yaml) or FSDP2 (fsdp.yaml: the
    weights sharded over every rank, data-parallel x sequence, as DeepSpeed's ALST does), its world a multiple of n.
    ZeRO, FSDP1, tensor parallelism and HSDP (a parallelism_config) are refused: not proven under the split."""
    n, name = args.split_size, args.split_field
    if n == 1:
        return
    strategy, world = launched_strategy_name(), launched_world_size()
    if strategy not in ("ddp", "single", "fsdp2") or launched_parallel_sizes():
        raise ConfigError(name, "sequence parallelism runs on ddp.yaml (each rank the whole model) or fsdp.yaml "
                                f"(FSDP2, the weights sharded over every rank); this launch is {strategy}"
                                f"{' with a parallelism_config' if launched_parallel_sizes() else ''}, which is not "
                                "proven under it: launch with accelerate_configs/ddp.yaml or fsdp.yaml, or set "
                                f"{name} 1")
    if world % n:
        raise ConfigError(name, f"{n} does not divide the {world} launched processes: launch a multiple of {n} "
                                f"(--num_processes {n} or {2 * n})")


def check_run(cfg, task, model_config) -> None:
    """Before the data and the weights load: the task, the data layout and the model's heads."""
    n, name = cfg.train.split_size, cfg.train.split_field
    if n == 1:
        return
    if task.name not in TASKS:
        raise ConfigError(name, f"the {task.name} task is not supported under sequence parallelism (proven for the "
                                f"causal LM and chat SFT): set {name} 1")
    if cfg.data.streaming:
        raise ConfigError("streaming", "is not supported under sequence parallelism yet: set streaming false")
    if cfg.model.attn_implementation not in (None, "sdpa"):
        raise ConfigError("attn_implementation", f"sequence parallelism attends with torch's SDPA around its "
                                                 f"all-to-all; {cfg.model.attn_implementation} is not supported under "
                                                 "it: leave attn_implementation unset or sdpa")
    unrouted = _without_attention_interface(model_config)
    if unrouted:  # transformers only warns and keeps SDPA: each rank would attend within its own part, silently
        raise ConfigError(name, f"{unrouted} does not route its attention through transformers' AttentionInterface, "
                                f"which sequence parallelism replaces: set {name} 1, or use a model that does "
                                "(GPT-2, Llama, Qwen2, Mistral, ...)")
    local = _local_attention(model_config)
    if local:  # the split attends causally over the whole sequence: no window or chunk, no silent change
        raise ConfigError(name, f"the model attends within {local}, which sequence parallelism does not: set {name} 1")
    if cfg.train.context_parallel_size > 1:  # the ring: any head count (the key/value heads repeated to the queries')
        dropout = attention_dropout(model_config)
        if dropout:  # the ring's kernels run without it: refused here, not at the first step (a RuntimeError there)
            raise ConfigError("disable_dropout", f"the model's attention dropout ({dropout[0]} {dropout[1]}) is not "
                                                 "supported inside ring attention (context_parallel_size); set "
                                                 "disable_dropout: true, or sequence_parallel_size (Ulysses) instead "
                                                 "of the ring")
        if cfg.data.padding_free:
            raise ConfigError("packing_strategy", f"{cfg.data.packing_strategy} (padding-free packing) is not "
                                                  "supported with context_parallel_size (ring attention) yet: use "
                                                  "sequence_parallel_size (Ulysses), or packing false")
        return
    heads = getattr(model_config, "num_attention_heads", None)
    if heads is None or heads % n:
        raise ConfigError("sequence_parallel_size", f"Ulysses splits the attention heads over the group: the model's "
                                                    f"{heads} query heads do not divide by {n}; use a divisor of "
                                                    f"{heads}")


def attention_dropout(model_config) -> tuple[str, float] | None:
    """(name, rate) of the model config's attention dropout when above 0 (GPT-2's ``attn_pdrop``, Llama's and Qwen2's
    ``attention_dropout``), else None. ``disable_dropout`` has set them to 0 already (``load_config``)."""
    for name in ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob"):
        rate = getattr(model_config, name, None)
        if isinstance(rate, (int, float)) and rate > 0:
            return name, rate
    return None


def _without_attention_interface(model_config) -> str | None:
    """The causal LM class of ``model_config`` when it does not take an attention function from transformers'
    ``AttentionInterface`` (``_supports_attention_backend`` false: Falcon, Bloom, GPT-Neo, MPT), else None (also
    for a class transformers does not map: a trust_remote_code model is not checked)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(model_config), None)
    return None if cls is None or getattr(cls, "_supports_attention_backend", False) else cls.__name__


def _local_attention(model_config) -> str | None:
    """What restricts some layer's attention to nearby positions, in words, or None: a sliding window (Qwen2's
    ``use_sliding_window``, Mistral's) or chunks (Llama 4's ``attention_chunk_size``: its "chunked_attention"
    layers). transformers builds both into the mask, which the split's attention does not read in training."""
    types = getattr(model_config, "layer_types", None)
    window = "sliding_attention" in types if types is not None else (
        getattr(model_config, "sliding_window", None) is not None and getattr(model_config, "use_sliding_window", True))
    if window:
        return f"a sliding window ({model_config.sliding_window} positions)"
    if types is not None and "chunked_attention" in types:
        return f"chunks of {model_config.attention_chunk_size} positions (attention_chunk_size)"
    return None


@dataclass
class SequenceGroup:
    """This rank's sequence-parallel group: its size n, this rank's index in it, and its process group."""

    size: int
    rank: int
    group: object  # torch.distributed.ProcessGroup
    documents: torch.Tensor | None = None  # a packed micro-batch's document ids over the whole row (``row_losses``)
    ring: bool = False  # ring attention (context_parallel_size): a head and a tail chunk per rank

    def scale(self, data_parallel_size: int) -> int:
        """The ranks DDP averages gradients over (data-parallel x sequence), by which each micro-step's loss is
        multiplied (see the module docstring)."""
        return data_parallel_size * self.size


_GROUP: SequenceGroup | None = None  # the group the registered attention splits over (one model per process)


def setup(accelerator, args, model) -> SequenceGroup | None:
    """Collective, before ``prepare``: the groups of n consecutive ranks, and the model's attention switched to the
    Ulysses all-to-all around SDPA or to the ring (registered with transformers' ``AttentionInterface``). None when n
    is 1."""
    global _GROUP
    is_ring = getattr(args, "context_parallel_size", 1) > 1
    n = args.context_parallel_size if is_ring else args.sequence_parallel_size
    if n == 1:
        return None
    import torch.distributed as dist
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    rank, world = accelerator.process_index, accelerator.num_processes
    groups = [dist.new_group(list(range(start, start + n))) for start in range(0, world, n)]  # every rank, each group
    _GROUP = SequenceGroup(size=n, rank=rank % n, group=groups[rank // n], ring=is_ring)
    name = RING if is_ring else ATTENTION
    AttentionInterface.register(name, ring_attention if is_ring else ulysses_attention)
    # SDPA's masks outside training (evaluation, the packing guard, generation: whole sequences on each rank), so that
    # packed documents stay apart there as under SDPA
    AttentionMaskInterface.register(name, sdpa_mask)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA's PeftModel
    base.set_attn_implementation(name)
    accelerator.print(f"sequence parallelism: {world // n} group(s) of {n} ranks, each rank 1/{n} of every sequence "
                      f"({'ring attention' if is_ring else 'Ulysses all-to-all around SDPA'})")
    return _GROUP


class _AllToAll(torch.autograd.Function):
    """All-to-all over ``group``: ``x`` cut into n along ``scatter``, part j to rank j, the parts received joined in
    rank order along ``gather``. Its backward is the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int):
        ctx.group, ctx.dims = group, (scatter, gather)
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather, scatter), None, None, None


def _all_to_all(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    import torch.distributed as dist

    n = dist.get_world_size(group)
    sent = [part.contiguous() for part in x.chunk(n, dim=scatter)]
    received = [torch.empty_like(sent[0]) for _ in range(n)]
    dist.all_to_all(received, sent, group=group)
    return torch.cat(received, dim=gather)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention function (query/key/value: batch x heads x positions x head dim) for ``ATTENTION``.
    In training mode: this rank's positions of every head -> every position of n-th of the heads, causal SDPA, and
    back (returns batch x positions x heads x head dim, as transformers' ``sdpa_attention_forward`` does). Outside
    training mode: that function itself, on whole sequences."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if _GROUP is None or not module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if kwargs.get("sliding_window") or kwargs.get("softcap") is not None:
        raise RuntimeError("Ulysses attention takes no sliding window or softcap: this model's attention needs one "
                           "(set sequence_parallel_size 1)")
    n, group = _GROUP.size, _GROUP.group
    kv_heads = key.shape[1]
    if kv_heads % n:  # too few key/value heads to split: replicate them, each query head keeping its own
        repeats = n // math.gcd(kv_heads, n)
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    query, key, value = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    mask = None if _GROUP.documents is None else _block_causal(_GROUP.documents)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=mask is None)
    return _AllToAll.apply(out, group, 2, 1).transpose(1, 2).contiguous(), None


def ring_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                   **kwargs):
    """transformers' attention function for ``RING``: in training mode, causal ring attention of this rank's head and
    tail chunks over the group's sequence (``toolkit.parallel.ring``; the key/value heads repeated to the query
    heads'); outside training mode, SDPA on whole sequences (as ``ulysses_attention``)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if _GROUP is None or not module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap") is not None:
        raise RuntimeError("ring attention takes no attention dropout, sliding window or softcap: this model's "
                           "attention needs one (set context_parallel_size 1)")
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = ring.ring_attention(query, key, value, _GROUP.group, scaling)
    return out.transpose(1, 2).contiguous(), None


def _block_causal(documents: torch.Tensor) -> torch.Tensor:
    """batch x 1 x positions x positions, True where a query may attend: an earlier (or its own) position of its
    document."""
    same = documents[:, None, :, None] == documents[:, None, None, :]
    return same & torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()


def shard(batch: dict, group: SequenceGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's part of a micro-batch: (input ids, positions, next-token targets), each batch x (padded length /
    n), and for a packed one the whole row's document ids (else None). The targets are shifted on the whole row,
    before the cut. Padded rows' positions are 0, 1, ...; a packed row's are its own (restarting per document); the
    split's own padding is at position 0: numbered on, it would run past a learned position table (GPT-2's
    ``n_positions``) when the row already fills it."""
    ids, targets, packed = batch["input_ids"], shift_labels(batch["labels"]), batch.get("position_ids")
    positions = packed if packed is not None else torch.arange(ids.shape[1], device=ids.device).expand(len(ids), -1)
    pad = -ids.shape[1] % (2 * group.size if group.ring else group.size)
    if pad:  # a multiple of n: the padding is no target, and no real token sees it (causal, or its own document)
        ids, targets = F.pad(ids, (0, pad), value=0), F.pad(targets, (0, pad), value=IGNORE_INDEX)
        positions = F.pad(positions, (0, pad), value=0)
    documents = torch.cumsum(positions == 0, dim=1) if packed is not None else None
    if group.ring:  # this rank's head and tail chunks (ring.order), in that order
        part = torch.cat([torch.arange(*span, device=ids.device)
                          for span in ring.order(ids.shape[1], group.size)[2 * group.rank:2 * group.rank + 2]])
        return ids[:, part], positions[:, part], targets[:, part], documents
    length = ids.shape[1] // group.size
    part = slice(group.rank * length, (group.rank + 1) * length)
    return ids[:, part], positions[:, part], targets[:, part], documents


def row_losses(model, batch: dict, group: SequenceGroup) -> torch.Tensor:
    """Per row, the summed cross-entropy (fp32) of this rank's targets: the group's sums add up to the rows' (a
    flattened packed micro-batch: one sum; the loop sums them all)."""
    ids, positions, targets, group.documents = shard(batch, group)  # kept for activation checkpointing's recompute
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="none")
    return ce.view(targets.shape).sum(dim=-1)

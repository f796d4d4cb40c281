"""Padding-free packing (``packing_strategy: bfd``): whole documents or chats placed into ``block_size`` rows by
best-fit decreasing, each attending only to itself, so a packed run trains exactly like the same documents unpacked.

Why a strategy of its own: ``wrapped`` (run_clm's concatenate-and-cut, ``toolkit.data.pack``) lets a document attend
to the one before it and cuts documents across rows; chat SFT cannot use it. Here each row is a bin of whole
documents (``seq_lengths`` records them), and its forward (``packed_inputs``) passes ``position_ids`` restarting at 0
per document, *no* ``attention_mask`` and ``use_cache=False``: transformers then finds the documents from the
restarts (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal mask for SDPA and eager
attention, or ``cu_seqlens`` for flash-attention. That detection runs only without a 2D mask and without a cache
(a config's default ``use_cache=True`` builds one, even in training), and it fails silently: the documents attend
across each other and the loss still falls (docs/pitfalls.md#packed-position-ids). ``check_packed_attention`` proves
on the real model, before the first step, that it did not.

The bins are computed once, from the tokenized rows (deterministic: lengths sorted decreasing, ties by row index),
before the global order (``toolkit.order``) shuffles them with the seed: the rows are then ordinary rows, so the same
global batches come on any world size and a resume is exact. The label of each document's first token is -100, so
no target crosses a boundary (the last token of one document does not predict the first of the next), and a packed
micro-batch has exactly the targets of the same documents unpadded: the loss normalisation is unchanged.
"""

from __future__ import annotations

import bisect

import torch

from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX, count_targets

SEQ_LENGTHS = "seq_lengths"  # a packed row's document lengths, in row order
PACK_BINS_PER_BATCH = 1_000  # bins per map batch when the rows are built (bounds its Python lists)


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to <= ``capacity``: items longest first (ties by index), each into the bin
    it fills most (the least room left that still fits it; ties: the bin opened first), a new bin when none fits.

    Deterministic from ``lengths`` alone. Bins come in the order they were opened (longest first item first).
    ``room``: the distinct free capacities, sorted; ``open_with[c]``: the bins with c free, oldest first."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"an item of {max(lengths)} exceeds the capacity {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    open_with: dict[int, list[int]] = {}
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(room, n)
        if k < len(room):
            free = room[k]
            b = open_with[free].pop(0)
            if not open_with[free]:
                del open_with[free]
                room.pop(k)
        else:
            free, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = free - n
        if left > 0:
            if left not in open_with:
                bisect.insort(room, left)
                open_with[left] = []
            bisect.insort(open_with[left], b)
    return bins


def document_lengths(tokenized):
    """The ``input_ids`` lengths of a ``Dataset``'s rows, as a numpy array, without reading the ids.

    From the Arrow list offsets, read as numpy: no pyarrow.compute kernel (nor flatten_indices, which runs them), whose
    thread pool does not survive a fork (notebook_launcher forks a kernel that has packed before: the ranks hung
    there, docs/pitfalls.md#pyarrow-fork). A selected/filtered view reads the table's lengths through its index column."""
    import numpy as np

    lengths = np.concatenate([np.diff(chunk.offsets.to_numpy()) for chunk in
                              tokenized.data.column("input_ids").chunks] or [np.zeros(0, np.int64)])
    if tokenized._indices is not None:
        view = [chunk.to_numpy() for chunk in tokenized._indices.column(0).chunks]
        lengths = lengths[np.concatenate(view).astype(np.int64)] if view else lengths[:0]
    return lengths


def pack_documents(tokenized, block_size: int, map_kwargs: dict):
    """A ``Dataset`` of packed rows (``input_ids``, ``labels`` where the rows have them, ``seq_lengths``) from rows of
    at most ``block_size`` tokens each (the caller truncates), by ``best_fit_decreasing``."""
    from datasets import Dataset

    bins = best_fit_decreasing(document_lengths(tokenized).tolist(), block_size)
    columns = [c for c in ("input_ids", "labels") if c in tokenized.column_names]

    def rows(batch):
        docs = tokenized[[i for members in batch["members"] for i in members]]  # one read per map batch, in bin order
        out, at = {c: [] for c in (*columns, SEQ_LENGTHS)}, 0
        for members in batch["members"]:
            part = slice(at, at + len(members))
            for c in columns:
                out[c].append([tok for doc in docs[c][part] for tok in doc])
            out[SEQ_LENGTHS].append([len(ids) for ids in docs["input_ids"][part]])
            at += len(members)
        return out

    kwargs = {k: v for k, v in map_kwargs.items() if k != "load_from_cache_file"}  # an in-memory table: no cache
    return Dataset.from_dict({"members": bins}).map(rows, batched=True, batch_size=PACK_BINS_PER_BATCH,
                                                    remove_columns=["members"], desc=f"pack whole documents into "
                                                    f"{block_size}-token rows (best-fit decreasing)", **kwargs)


def fill_rate(dataset, block_size: int) -> float:
    """Real tokens / (rows x block_size) of packed rows."""
    real = sum(sum(n) for n in dataset[SEQ_LENGTHS])
    return real / max(len(dataset) * block_size, 1)


def collate_packed(rows: list[dict], pad_token_id: int) -> dict:
    """A micro-batch of packed rows: right-padded to the longest, ``position_ids`` restarting at 0 per document (the
    padding is a document of its own: no real token sees it, it has no target), the first label of each document
    -100, and no ``attention_mask``. ``num_tokens``: the real tokens; ``num_slots``: the positions computed."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(r.get("labels", r["input_ids"]), dtype=torch.long)
        start = 0
        for size in [*r[SEQ_LENGTHS], length - n]:
            positions[i, start:start + size] = torch.arange(size)
            if size:
                labels[i, start] = IGNORE_INDEX  # no target across a boundary
            start += size
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "num_targets": int(count_targets(labels)),
            "num_tokens": sum(len(r["input_ids"]) for r in rows), "num_slots": ids.numel()}


def packed_inputs(batch: dict) -> dict:
    """The forward's keyword arguments for a packed micro-batch (see the module docstring for why each)."""
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}


def packed_guard_row(dataset, scan: int = 64) -> dict:
    """The row the guard checks: the first of the first ``scan`` rows that holds two documents or more, else row 0."""
    for i in range(min(len(dataset), scan)):
        if len(dataset[i][SEQ_LENGTHS]) > 1:
            return dataset[i]
    return dataset[0]


def _guard_rows(row: dict) -> tuple[list[dict], slice]:
    """Three rows from a real packed row: its last document after the documents before it, after those documents
    changed, and alone; and where that document lies in the first two (a one-document row is split in two)."""
    ids, sizes = list(row["input_ids"]), list(row[SEQ_LENGTHS])
    if len(sizes) < 2:
        sizes = [sizes[0] // 2, sizes[0] - sizes[0] // 2]
    before = sum(sizes[:-1])
    top = max(ids) + 1
    changed = [(t + 1) % top for t in ids[:before]] + ids[before:]  # other ids, every one within the vocabulary
    last = {"input_ids": ids[before:], SEQ_LENGTHS: [sizes[-1]]}
    return [{"input_ids": ids, SEQ_LENGTHS: sizes}, {"input_ids": changed, SEQ_LENGTHS: sizes}, last], slice(before,
                                                                                                            len(ids))


@torch.no_grad()
def check_packed_attention(model, row: dict, pad_token_id: int, device=None, tolerance: float = 1e-3) -> float:
    """Refuse a model that lets a packed document attend to the one before it: on ``model`` (as prepared, so every
    rank must call this, with the same ``row``) the logits of a real row's last document must not change when the
    documents before it change (``tolerance``, relative to the largest logit), and must equal that document run alone
    (10 x ``tolerance``). Returns the larger relative difference. Eval mode during the check (dropout off); the model's mode is restored."""
    rows, last = _guard_rows(row)
    batch = collate_packed(rows, pad_token_id)
    training = model.training
    model.eval()
    try:
        inputs = packed_inputs(batch)
        for key in ("input_ids", "position_ids"):
            inputs[key] = inputs[key].to(device or _device(model))
        logits = model(**inputs).logits.float()
    finally:
        model.train(training)
    n = last.stop - last.start
    alone = logits[2, :n]
    scale = max(float(alone.abs().max()), 1.0)
    # Rows 0 and 1 put the document at the same positions with the same shapes: any difference comes from the
    # documents before it (tight). Alone, it sits at other offsets of the batch, which half-precision kernels may
    # round differently: looser, still far below what positions that do not restart give.
    leak = float((logits[0, last] - logits[1, last]).abs().max()) / scale
    moved = float((logits[0, last] - alone).abs().max()) / scale
    if not (leak <= tolerance and moved <= 10 * tolerance):
        inner = getattr(model, "module", model)
        impl = getattr(getattr(inner, "config", None), "_attn_implementation", "?")
        raise ConfigError("packing_strategy", f"{type(inner).__name__} (attn_implementation {impl}) does not honour "
                                              "packed position_ids: a document's logits moved by "
                                              f"{leak * scale:.3g} when the document before it in the row changed and "
                                              f"differ by {moved * scale:.3g} from the document run alone (largest "
                                              f"logit {scale:.3g}), so packed documents would attend to each other "
                                              "silently; use packing_strategy: wrapped or packing: false for this "
                                              "model, or an attention implementation that honours them (sdpa, eager, "
                                              "flash_attention_2)")
    return max(leak, moved)


def _device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

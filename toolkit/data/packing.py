"""Padding-free packing (``packing_strategy: bfd`` or ``bfd_split``, TRL's names): documents or chats placed into
``block_size`` rows by best-fit decreasing, each attending only to itself, so a packed run trains exactly like the
same documents unpacked.

Why a strategy of its own: ``wrapped`` (run_clm's concatenate-and-cut, ``toolkit.data.loading.pack``) lets a document attend
to the one before it and cuts documents across rows; chat SFT cannot use it. Here each row is a bin of documents
(``seq_lengths`` records them). A document longer than ``block_size`` is cut to it under ``bfd`` and split into
``block_size`` pieces under ``bfd_split`` (``pieces``; each piece a document of its own); ``cut_report`` is the line
the build logs about it.

A micro-batch is flattened into one row (``collate_packed``, the layout of transformers' and TRL's
``DataCollatorWithFlattening``) and its forward (``packed_inputs``) passes ``position_ids`` restarting at 0 per
document, *no* ``attention_mask`` and ``use_cache=False``: transformers then finds the documents from the restarts
(``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal mask for SDPA and eager
attention, or ``cu_seqlens`` for flash-attention, which reads them from the positions only in a batch of one row
(``modeling_flash_attention_utils._is_packed_sequence``): several rows would attend across their documents there.
That detection runs only without a 2D mask and without a cache (a config's default ``use_cache=True`` builds one,
even in training), and it fails silently: the documents attend across each other and the loss still falls
(docs/pitfalls.md#packed-position-ids). ``check_packed_attention`` proves on the real model, before the first step,
that it did not.

The bins are computed once, from the tokenized rows (deterministic: lengths sorted decreasing, ties by row index),
before the global order (``toolkit.data.order``) shuffles them with the seed: the rows are then ordinary rows, so the same
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
ROW_LENGTHS = "row_lengths"  # a flattened micro-batch's tokens per packed row (collate_packed)
PACKING_REPORT = "packing_report"  # pack_splits' line on what block_size cut or split
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


def pieces(lengths: list[int], block_size: int, split: bool) -> list[tuple[int, int, int]]:
    """The (document, start, stop) pieces that get packed: ``bfd`` keeps each document's first ``block_size`` tokens
    (the rest is cut); ``bfd_split`` (TRL's ``pack_dataset``) cuts a longer document into ``block_size`` pieces and
    its remainder, last, each packed as a document of its own (positions restarting): no token is lost."""
    out = []
    for doc, n in enumerate(lengths):
        if not split or n <= block_size:
            out.append((doc, 0, min(n, block_size)))
        else:
            out.extend((doc, start, min(start + block_size, n)) for start in range(0, n, block_size))
    return out


def cut_report(lengths: list[int], block_size: int, split: bool, what: str = "documents") -> str:
    """One line: how many ``what`` exceed ``block_size`` and what became of their tokens beyond it."""
    over = [n for n in lengths if n > block_size]
    extra, total = sum(n - block_size for n in over), sum(lengths)
    share = f"{len(over)} of {len(lengths)} {what} are longer than block_size {block_size}"
    if split:
        return (f"packing_strategy bfd_split: {share}: split into {sum(-(-n // block_size) for n in over)} pieces, "
                "each packed as a document of its own; no token dropped")
    return (f"packing_strategy bfd: {share}: cut to it, {extra} of {total} tokens dropped "
            f"({100 * extra / max(total, 1):.1f}%); packing_strategy: bfd_split keeps them")


def pack_documents(tokenized, block_size: int, map_kwargs: dict, split: bool = False):
    """A ``Dataset`` of packed rows (``input_ids``, ``labels`` where the rows have them, ``seq_lengths``): the
    documents' ``pieces`` binned by ``best_fit_decreasing``. ``cut_report`` says what a document longer than
    ``block_size`` lost (``bfd``) or how it was split (``bfd_split``)."""
    from datasets import Dataset

    parts = pieces(document_lengths(tokenized).tolist(), block_size, split)
    bins = best_fit_decreasing([stop - start for _, start, stop in parts], block_size)
    columns = [c for c in ("input_ids", "labels") if c in tokenized.column_names]

    def rows(batch):
        members = [parts[i] for b in batch["members"] for i in b]
        docs = tokenized[[doc for doc, _, _ in members]]  # one read per map batch, in bin order
        out, at = {c: [] for c in (*columns, SEQ_LENGTHS)}, 0
        for b in batch["members"]:
            part = range(at, at + len(b))
            for c in columns:
                out[c].append([tok for k in part for tok in docs[c][k][members[k][1]:members[k][2]]])
            out[SEQ_LENGTHS].append([members[k][2] - members[k][1] for k in part])
            at += len(b)
        return out

    kwargs = {k: v for k, v in map_kwargs.items() if k != "load_from_cache_file"}  # an in-memory table: no cache
    return Dataset.from_dict({"members": bins}).map(rows, batched=True, batch_size=PACK_BINS_PER_BATCH,
                                                    remove_columns=["members"], desc=f"pack whole documents into "
                                                    f"{block_size}-token rows (best-fit decreasing)", **kwargs)


def pack_splits(tokenized, block_size: int, map_kwargs: dict, split: bool):
    """``pack_documents`` of every split of a ``DatasetDict``; its ``PACKING_REPORT`` attribute holds the training
    split's ``cut_report`` (``toolkit.training.build`` logs it)."""
    from datasets import DatasetDict

    packed = DatasetDict({name: pack_documents(part, block_size, map_kwargs, split)
                          for name, part in tokenized.items()})
    setattr(packed, PACKING_REPORT, cut_report(document_lengths(tokenized["train"]).tolist(), block_size, split,
                                               "training documents"))
    return packed


def pack_rows(rows: list[dict], block_size: int) -> list[dict]:
    """Packed rows of a list of documents (a stream's micro-batch, ``toolkit.data.stream``), as ``pack_documents`` packs
    a dataset's: a document longer than ``block_size`` is split (the stream cut it to ``block_size`` under ``bfd``)."""
    columns = [c for c in ("input_ids", "labels") if c in rows[0]]
    parts = pieces([len(r["input_ids"]) for r in rows], block_size, split=True)
    packed = []
    for members in best_fit_decreasing([stop - start for _, start, stop in parts], block_size):
        chosen = [parts[i] for i in members]
        packed.append({**{c: [t for doc, a, b in chosen for t in rows[doc][c][a:b]] for c in columns},
                       SEQ_LENGTHS: [b - a for _, a, b in chosen]})
    return packed


def fill_rate(dataset, block_size: int) -> float:
    """Real tokens / (rows x block_size) of packed rows."""
    real = sum(sum(n) for n in dataset[SEQ_LENGTHS])
    return real / max(len(dataset) * block_size, 1)


def collate_packed(rows: list[dict]) -> dict:
    """A micro-batch of packed rows flattened into one row of shape [1, total] (transformers' and TRL's
    ``DataCollatorWithFlattening``): every document of every row side by side, ``position_ids`` restarting at 0 per
    document, the first label of each document -100 (no target across a boundary), no padding and no
    ``attention_mask``. One row, because flash-attention finds the documents (``cu_seqlens``) from the position
    restarts only in a batch of one row; SDPA and eager see the same layout. ``ROW_LENGTHS``: each packed row's
    tokens, so that the loss comes back per dataset row (evaluation's ``gather_for_metrics`` drops repeated rows).
    ``num_tokens`` = ``num_slots``: every position computed is a real token."""
    sizes = [n for r in rows for n in r[SEQ_LENGTHS]]
    ids = torch.as_tensor([t for r in rows for t in r["input_ids"]], dtype=torch.long)
    labels = torch.as_tensor([t for r in rows for t in r.get("labels", r["input_ids"])], dtype=torch.long)
    if sum(sizes) != len(ids):
        raise ValueError(f"packed rows of {len(ids)} tokens whose {SEQ_LENGTHS} add up to {sum(sizes)}")
    lengths = torch.as_tensor(sizes, dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(len(ids)) - torch.repeat_interleave(starts, lengths)
    labels[starts] = IGNORE_INDEX
    return {"input_ids": ids[None], "position_ids": positions[None], "labels": labels[None],
            ROW_LENGTHS: torch.as_tensor([len(r["input_ids"]) for r in rows], dtype=torch.long),
            "num_targets": int(count_targets(labels[None])), "num_tokens": len(ids), "num_slots": len(ids)}


def packed_inputs(batch: dict) -> dict:
    """The forward's keyword arguments for a packed micro-batch (see the module docstring for why each)."""
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}


def packed_guard_row(dataset, scan: int = 64) -> dict:
    """The row the guard checks: the first of the first ``scan`` rows that holds two documents or more, else row 0."""
    for i in range(min(len(dataset), scan)):
        if len(dataset[i][SEQ_LENGTHS]) > 1:
            return dataset[i]
    return dataset[0]


def _guard_rows(row: dict) -> tuple[dict, dict, dict]:
    """Three rows from a real packed row: itself (a one-document row split in two), the same with every document but
    the last changed, and its last document alone."""
    ids, sizes = list(row["input_ids"]), list(row[SEQ_LENGTHS])
    if len(sizes) < 2:
        sizes = [sizes[0] // 2, sizes[0] - sizes[0] // 2]
    before = sum(sizes[:-1])
    top = max(ids) + 1
    changed = [(t + 1) % top for t in ids[:before]] + ids[before:]  # other ids, every one within the vocabulary
    return ({"input_ids": ids, SEQ_LENGTHS: sizes}, {"input_ids": changed, SEQ_LENGTHS: sizes},
            {"input_ids": ids[before:], SEQ_LENGTHS: [sizes[-1]]})


@torch.no_grad()
def check_packed_attention(model, row: dict, device=None, tolerance: float = 1e-3) -> float:
    """Refuse a model that lets a packed document attend to the one before it: on ``model`` (as prepared, so every
    rank must call this, with the same ``row``) two flattened micro-batches (``collate_packed``, the layout training
    uses), each a real row's documents then its last document alone: in the second the documents before it are
    changed. That document's logits must not change (``tolerance``, relative to the largest logit), and must equal
    it alone (10 x ``tolerance``). Returns the larger relative difference. Eval mode during the check (dropout off);
    the model's mode is restored."""
    real, changed, last = _guard_rows(row)
    training = model.training
    model.eval()
    try:
        logits = []
        for rows in ([real, last], [changed, last]):
            inputs = packed_inputs(collate_packed(rows))
            for key in ("input_ids", "position_ids"):
                inputs[key] = inputs[key].to(device or _device(model))
            logits.append(model(**inputs).logits[0].float())
    finally:
        model.train(training)
    end = len(real["input_ids"])
    doc, alone = slice(end - len(last["input_ids"]), end), slice(end, end + len(last["input_ids"]))
    scale = max(float(logits[0][alone].abs().max()), 1.0)
    # The two forwards put the document at the same offsets with the same shapes: any difference comes from the
    # documents before it (tight). Alone, it sits at other offsets of the row, which half-precision kernels may
    # round differently: looser, still far below what positions that do not restart give.
    leak = float((logits[0][doc] - logits[1][doc]).abs().max()) / scale
    moved = float((logits[0][doc] - logits[0][alone]).abs().max()) / scale
    if not (leak <= tolerance and moved <= 10 * tolerance):
        inner = getattr(model, "module", model)
        impl = getattr(getattr(inner, "config", None), "_attn_implementation", "?")
        raise ConfigError("packing_strategy", f"{type(inner).__name__} (attn_implementation {impl}) does not honour "
                                              "packed position_ids: a document's logits moved by "
                                              f"{leak * scale:.3g} when the documents before it in the row changed "
                                              f"and differ by {moved * scale:.3g} from the document run alone (largest "
                                              f"logit {scale:.3g}), so packed documents would attend to each other "
                                              "silently; use packing_strategy: wrapped or packing: false for this "
                                              "model, or an attention implementation that honours them (sdpa, eager, "
                                              "flash_attention_2)")
    return max(leak, moved)


def _device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

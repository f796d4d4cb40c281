"""The global sample order of a stream (``streaming: true``): ``toolkit.data.order``'s contract for data read as it comes.

A stream has no length and cannot be permuted whole, and ``datasets``' own tools break the contract
(docs/reliability.md#streams: a shuffle buffer that a checkpoint does not save, ``split_dataset_by_node`` handing
whole shards to ranks). So, with W = ``shuffle_buffer_size``:

    source:   the files, their order permuted by the seed, read one after the other (a plain stream: its
              ``state_dict`` resumes exactly); rows the task cannot train on (a text null, empty or not a string; a
              JSON line that is not a JSON object, read as a row of nulls: ``lenient_json``) are dropped here, on
              every rank alike, counted in one line of the log and in summary.json's ``dropped_rows``
    window k: source rows [k*W, (k+1)*W), shuffled by a permutation seeded from (seed, k)
    global index g = k*W + j: the j-th row of window k after its shuffle
    step s:   global indices [s*B, (s+1)*B), B = data-parallel ranks x micro x accumulation
    rank r:   the indices g of the step with g % dp == r, in increasing order, ``micro`` per micro-batch

so the global batch of every step is the same set of rows on any data-parallel degree (the loss is normalised over
the global batch, ``toolkit.loss``: its partition among ranks does not change the update). Every rank reads every
row of the source (cheap) and tokenizes only its own. A checkpoint records the next g (``LoopState.step`` x B) and
the source's state at the start of g's window (``position``); a resume on any world size re-reads that window,
shuffles it again and continues at g. A stream that ends before a step's last index ends the run after the last
full step (every rank reads the same rows, so every rank stops at the same step, without a collective).

Read-ahead: the next step's rows are read, tokenized, packed and collated in a background thread while the current
step trains (``read_ahead``: one step ahead, the same order; the resume position of each step is taken with it), so
a streamed step costs what a map-style step does (bench/streaming.py, docs/performance.md).

Memory: the windows that hold the current and the next step (W rows + two steps), and those steps' tokenized rows.
Packing with ``bfd`` places each micro-batch's documents into ``block_size`` rows (best-fit decreasing, each attending only to
itself, ``toolkit.data.packing``): a layout of the same documents, so the update is that of the unpacked rows. ``wrapped``
packing, whose rows mix the tokens of neighbouring documents, would make the rows depend on which documents a rank
holds, and is refused on a stream (``toolkit.tasks.lm.CausalLM.check``).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from toolkit.data.packing import pack_rows
from toolkit.errors import ConfigError


def shard_order(files: list[str], seed: int, shuffle: bool) -> list[str]:
    """The files in the order the stream reads them: permuted by the seed (unless shuffle is off)."""
    if not shuffle:
        return list(files)
    return [files[i] for i in np.random.default_rng([seed, len(files)]).permutation(len(files))]


def window_order(window: int, size: int, seed: int, shuffle: bool) -> list[int]:
    """The order of the ``size`` rows of window ``window``: a permutation seeded from (seed, window index)."""
    if not shuffle:
        return list(range(size))
    return np.random.default_rng([seed, window]).permutation(size).tolist()


# A file's content fingerprint: its size and 32 blocks of 64 KiB spread evenly from its first byte to its last (the
# whole file up to 2 MiB). A full hash costs 0.69 s per GiB from the page cache (sha256, measured on a 1 GiB jsonl
# shard, AMD EPYC), on every rank at every start (and a cold read from disk is slower): minutes for a corpus of a
# hundred shards. The sample costs 1.7 ms per file whatever its size, and sees a shard regenerated with other rows
# (which changes bytes everywhere); an edit that keeps the size and falls between the samples is not seen.
SAMPLE_BLOCKS, SAMPLE_BLOCK = 32, 64 * 1024


def content_fingerprint(path: str) -> str:
    """A cheap hash of a file's size and content (``SAMPLE_BLOCKS`` blocks; see above)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"{size};".encode())
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK:
            h.update(f.read())
        else:
            for i in range(SAMPLE_BLOCKS):
                f.seek(i * (size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BLOCK))
    return h.hexdigest()[:16]


@dataclass
class StreamSpec:
    """What the order of a stream depends on (``order_record`` writes it into checkpoints)."""

    files: list[str]
    window: int  # W: rows per shuffled window (shuffle_buffer_size)
    seed: int
    shuffle: bool

    def fingerprint(self) -> str:
        """The files (names, sizes) in read order: a changed corpus changes the stream's rows."""
        h = hashlib.sha256()
        for path in shard_order(self.files, self.seed, self.shuffle):
            h.update(f"{os.path.basename(path)}:{os.path.getsize(path)};".encode())
        return h.hexdigest()[:16]

    def file_fingerprints(self) -> list[list[str]]:
        """[path, content fingerprint] of each file in read order: a resume whose file changed is refused naming it
        (``toolkit.checkpointing.resume``), as the stream restarts at a row index that would fall in other rows."""
        return [[path, content_fingerprint(path)] for path in shard_order(self.files, self.seed, self.shuffle)]


def open_source(files: list[str], seed: int, shuffle: bool, state: dict | None = None):
    """A plain ``datasets`` stream of the files in shard order, from ``state`` (a ``state_dict``) if given; JSON lines
    read so that a malformed line is a row of nulls (``lenient_json``), which the task drops and counts."""
    from datasets import load_dataset_builder

    from toolkit.data.loading import file_builder

    ordered = shard_order(files, seed, shuffle)
    name, kwargs = file_builder({"train": ordered})
    builder = load_dataset_builder(name, data_files={"train": ordered}, **kwargs)  # what load_dataset(streaming) does
    if name == "json":
        builder._generate_tables = one_format(builder, lenient_json(builder, builder._generate_tables))
    source = builder.as_streaming_dataset(split="train")
    if state is not None:
        source.load_state_dict(state)
    return source


def lenient_json(builder, tables: Callable) -> Callable:
    """``datasets``' JSON-lines reader (``tables``: its ``_generate_tables``), with a malformed line dropped instead
    of stopping the stream. Its reader parses a chunk of the file at once (``chunksize`` bytes, to the end of a line)
    and cannot skip one line: from the chunk where it fails, the file is read here in the same chunks, line by line,
    a line that is not a JSON object becoming a row of nulls (the task's ``keep`` drops it and counts it: no row
    index shifts, so a resume reads the same rows) and named in one line of the log (first process). Deterministic:
    a resume, which re-reads its file's chunks, meets the same rows."""
    import pyarrow as pa
    from datasets.builder import Key

    def generate(*args, **kwargs):
        done = 0  # the chunks (tables) this shard gave before it failed
        try:
            for key, table in tables(*args, **kwargs):
                done += 1
                yield key, table
            return
        except (pa.ArrowInvalid, ValueError):
            paths = [p for files in kwargs.get("files_iterables", ()) for p in files]
            if len(paths) != 1:  # one file per shard (local files); otherwise the stream stops, naming the line
                raise
        path, size = paths[0], builder.config.chunksize
        with open(path, "rb") as f:
            chunk, number = 0, 0
            while batch := f.read(size):
                batch += f.readline()
                lines, chunk = batch.splitlines(), chunk + 1
                if chunk <= done:
                    number += len(lines)
                    continue
                rows = []
                for line in lines:
                    number += 1
                    if line.strip():
                        rows.append(_json_row(line, path, number, builder))
                columns = list(dict.fromkeys(c for row in rows for c in row))  # every row's (not the first's alone)
                yield Key(0, chunk - 1), builder._cast_table(pa.Table.from_pylist([{c: row.get(c) for c in columns}
                                                                                   for row in rows]))

    return generate


def one_format(builder, tables: Callable) -> Callable:
    """``datasets``' JSON reader (``tables``: its ``_generate_tables``) stopping at a row that holds a value in a
    column the stream's first file has not (an ``UnreadableLine`` naming the file and its row, after the rows before
    it): ``datasets`` casts every later file to the first one's columns and drops the others, so a later file that
    switches from ``messages`` rows to Alpaca rows gave rows of nulls, every one dropped as fitting no format, and
    the run ended with ``data_ran_out`` (docs/pitfalls.md#stream-later-columns; a loaded set of those files is
    refused; a switch within the first file is ``toolkit.tasks.sft.other_format``'s)."""
    import pyarrow.compute as pc

    cast, found = builder._cast_table, []

    def cast_one_format(table, *args, **kwargs):
        features = builder.info.features
        other = [c for c in table.column_names if features is not None and c not in features]
        if other:
            valid = pc.is_valid(table[other[0]])
            for column in other[1:]:
                valid = pc.or_(valid, pc.is_valid(table[column]))
            first = pc.index(valid, True).as_py()
            if first >= 0:
                row = {c: v for c, v in table.slice(first, 1).to_pylist()[0].items() if v is not None}
                found.append((first, sorted(features), row))
                table = table.slice(0, first)
            table = table.select([c for c in table.column_names if c in features])  # (a column of nulls holds nothing)
        return cast(table, *args, **kwargs)

    builder._cast_table = cast_one_format

    def generate(*args, **kwargs):
        paths = [p for files in kwargs.get("files_iterables", ()) for p in files]
        rows = 0  # this file's rows before the table
        for key, table in tables(*args, **kwargs):
            if not found:
                yield key, table
                rows += len(table)
                continue
            first, columns, row = found.pop()
            if len(table):
                yield key, table
            raise UnreadableLine("dataset_format", f"the stream's rows have the columns {columns} (its first file's), "
                                                   f"but {paths[0] if len(paths) == 1 else 'a later file'} row "
                                                   f"{rows + first + 1} has others ({row!r:.120}): a stream holds rows "
                                                   "of one format, as a loaded set does (a loaded set of these files "
                                                   "is refused too): convert those rows, or train on them apart")

    return generate


def _json_row(line: bytes, path: str, number: int, builder) -> dict:
    """One line of a chunk the JSON reader could not parse: its row, or a row of nulls (said once, from the first
    process) when it is not a JSON object."""
    from toolkit.data.loading import json_object

    row, why = json_object(line)
    if row is not None:
        return row
    if os.environ.get("RANK", "0") == "0":
        print(f"the stream skips {path} line {number} ({why}): a row with no data, dropped and counted", flush=True)
    return dict.fromkeys(builder.info.features or (), None)


class UnreadableLine(ConfigError):
    """A row of a stream's file that its reader cannot parse nor skip (a CSV row with too many fields; a JSON line is
    skipped: ``lenient_json``), or that the task refuses as a loaded set would be (a row in another format than the
    stream's: ``toolkit.tasks.sft.other_format``). Every rank reads every row of the stream, so every rank meets it at the
    same row: the loop can end the run there on every rank alike (``toolkit.training.loop``), which it cannot do for an error
    only some ranks raise."""


def source_rows(source, files: list[str], field: str = "train_file") -> Iterator[dict]:
    """The rows of a ``datasets`` stream; a row its reader cannot parse nor skip (which stops the stream) is one
    ``UnreadableLine`` (a ConfigError) naming the file and the line (``data.unreadable``: the first line that is not a
    JSON object, or the reader's own message, pandas' for CSV), not a traceback. The files are searched from the one
    being read."""
    import pyarrow as pa

    rows = iter(source)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except UnreadableLine:  # already the line's error (one_format)
            raise
        except (ValueError, pa.ArrowException) as e:  # pyarrow's ArrowInvalid: a malformed line
            from toolkit.data.loading import unreadable

            reading = _shard_index(source.state_dict())
            error = unreadable(field, files[reading:] if reading is not None else files, e)
            raise UnreadableLine(error.field_name, error.message) from None
        yield row


def _shard_index(state) -> int | None:
    """The index of the file a ``datasets`` stream is reading, from its ``state_dict`` (None if not found)."""
    if isinstance(state, dict):
        if isinstance(state.get("shard_idx"), int):
            return state["shard_idx"]
        for value in state.values():
            found = _shard_index(value)
            if found is not None:
                return found
    return None


class Windows:
    """The source in shuffled windows of W kept rows, each with the source's state at its start; rows by global
    index, holding only the windows still needed."""

    def __init__(self, source, spec: StreamSpec, keep: Callable[[dict], bool], first_window: int = 0):
        self.source, self.spec, self.keep = source, spec, keep
        self.rows = source_rows(source, shard_order(spec.files, spec.seed, spec.shuffle))
        self.next_window = first_window  # the index of the window read next
        self.start_state = source.state_dict()  # the source's state at the start of the next window
        self.loaded: dict[int, tuple[dict, list[dict]]] = {}  # window -> (state at its start, rows in shuffled order)
        self.ended = False
        self.dropped = 0  # rows ``keep`` refused (None) so far
        self.columns: list[str] | None = None  # the first row's columns (a message's, when no row is kept)

    def read_window(self) -> bool:
        """Read the next window; False when the source has no row left."""
        if self.ended:
            return False
        state, rows, W = self.start_state, [], self.spec.window
        for row in self.rows:
            if self.columns is None:
                self.columns = sorted(row)
            verdict = self.keep(row)
            if verdict:
                rows.append(row)
                if len(rows) == W:
                    break
            elif verdict is None:  # a row the task cannot train on: dropped, and counted for the log
                self.dropped += 1
        self.start_state = self.source.state_dict()
        if len(rows) < W:
            self.ended = True
        if not rows:
            return False
        order = window_order(self.next_window, len(rows), self.spec.seed, self.spec.shuffle)
        self.loaded[self.next_window] = (state, [rows[i] for i in order])
        self.next_window += 1
        return True

    def available(self, end: int) -> bool:
        """Read windows until global index ``end - 1`` is loaded; False if the stream ends before it."""
        while self.next_window * self.spec.window < end:
            if not self.read_window():
                break
        last = max(self.loaded, default=-1)
        return last >= 0 and last * self.spec.window + len(self.loaded[last][1]) >= end

    def row(self, g: int) -> dict:
        return self.loaded[g // self.spec.window][1][g % self.spec.window]

    def forget_before(self, g: int) -> None:
        for k in [k for k in self.loaded if (k + 1) * self.spec.window <= g]:
            del self.loaded[k]

    def position(self, g: int) -> dict:
        """Where a resume at global index ``g`` restarts the source: its window and the state at that window's
        start (``g``'s window is loaded, or the next one to read)."""
        k = g // self.spec.window
        state = self.loaded[k][0] if k in self.loaded else self.start_state
        if k not in self.loaded and k != self.next_window:
            raise RuntimeError(f"global index {g}: window {k} is neither loaded nor the next one ({self.next_window})")
        return {"window": k, "source": state}


def pack_bfd(rows: list[dict], block_size: int) -> list[dict]:
    """A micro-batch's documents as packed rows (``toolkit.data.packing.pack_rows``: one longer than ``block_size`` is split,
    under bfd_split; bfd's ``encode`` cut it)."""
    return pack_rows(rows, block_size)


def read_ahead(items: Iterator, name: str):
    """``items``' values in order, each computed in a background thread while the caller works on the one before it
    (one ahead: the thread waits for the caller to take a value before it starts the one after next).

    The thread never outlives its use: it ends at the end of ``items``, on an exception in ``items`` (raised here, in
    the caller, with its traceback), and when the caller closes this generator or drops it (a run that ended early,
    was preempted or raised: ``toolkit.training.loop`` closes it, and a dropped generator closes itself). It waits with a
    timeout and is a daemon, so it cannot hold a process at exit either."""
    results: queue.Queue = queue.Queue()
    demand, stop, end = threading.Semaphore(1), threading.Event(), object()

    def work() -> None:
        try:
            while not stop.is_set():
                if not demand.acquire(timeout=0.1):
                    continue
                if stop.is_set():
                    break
                results.put((next(items, end), None))
        except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
            results.put((None, e))
        finally:
            items.close()  # in the thread that ran it: a running generator cannot be closed from another thread

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while True:
            try:
                item, error = results.get(timeout=1.0)
            except queue.Empty:
                if not thread.is_alive():
                    raise RuntimeError(f"{name}: the read-ahead thread ended without a value") from None
                continue
            if error is not None:
                raise error
            if item is end:
                return
            demand.release()  # the next value is computed while the caller works on this one
            yield item
    finally:
        stop.set()
        demand.release()  # wakes a thread waiting for demand: it sees stop at once
        thread.join(timeout=30)  # at most the value being computed; the daemon goes with the process otherwise


class TrainStream:
    """One rank's micro-batches of a stream, step by step (see the module docstring for the order).

    ``keep(row) -> bool | None`` runs on every row on every rank (cheap checks; a bad row raises on every rank alike,
    or returns None: dropped and counted, the count logged when the stream stops and written into ``record``); ``encode(rows) -> rows`` tokenizes
    this rank's rows; ``collate(rows) -> micro-batch``; ``bfd_block_size`` packs each micro-batch's documents.
    ``source(state) -> IterableDataset``: the plain stream, from a ``state_dict`` or its start (default: ``spec``'s
    files, ``open_source``; bench/streaming.py passes a generator's). The next step's rows are read, tokenized and
    collated in a background thread while the current step trains (``read_ahead``), in the same order."""

    def __init__(self, spec: StreamSpec, *, keep, encode, collate, micro: int, accumulation: int,
                 data_parallel_size: int = 1, rank: int = 0, bfd_block_size: int | None = None, max_steps: int = 0,
                 source: Callable[[dict | None], object] | None = None, log: Callable[[str], None] = print,
                 record: dict | None = None):
        self.spec, self.keep, self.encode, self.collate, self.log = spec, keep, encode, collate, log
        self.record = record  # where the count of dropped rows goes when the stream stops ("train": summary.json's)
        self.source = source or (lambda state: open_source(spec.files, spec.seed, spec.shuffle, state))
        self.micro, self.accumulation = micro, accumulation
        self.dp, self.rank, self.bfd_block_size = data_parallel_size, rank, bfd_block_size
        self.steps_per_epoch = max_steps or 1  # a stream is one pass: its "epoch" is the run's max_steps
        self.windows: Windows | None = None
        self.steps_done = 0  # steps the stream gave (the run ends early when the source ends)
        self.first_window: list[dict] | None = None  # window 0's rows in order, read once for every head()
        self.head_columns: list[str] | None = None  # the columns of the stream's first row (head()'s)
        self.holds_one_step: bool | None = None  # whether the stream holds one global batch (head() reads it)
        self.positions: dict[int, dict] = {}  # step -> where a resume at that step restarts (the last steps given)
        self.read_ahead = True  # False: each step read in the caller's thread (bench/streaming.py's comparison)

    @property
    def global_batch_size(self) -> int:
        return self.micro * self.dp * self.accumulation

    def steps(self, start_step: int = 0, position: dict | None = None):
        """Yield this rank's micro-batches of every step from ``start_step`` (a list of ``accumulation`` each);
        ``position``: the checkpoint's ``LoopState.stream`` (None: the stream's start)."""
        g0 = start_step * self.global_batch_size
        if position is None and g0:
            raise ValueError("a stream resumed after step 0 needs its checkpoint's position")
        first = position["window"] if position else 0
        if position and first != g0 // self.spec.window:
            raise ConfigError("shuffle_buffer_size", f"the checkpoint's stream position is window {first}, this run "
                                                     f"would resume in window {g0 // self.spec.window}: the window "
                                                     "size changed; resume with the checkpoint's shuffle_buffer_size")
        self.first_window = None  # head()'s rows are no longer needed: training holds its own windows
        self.windows = Windows(self.source(position["source"] if position else None), self.spec, self.keep,
                               first_window=first)
        self.positions = {}
        try:
            steps = self._read(self.windows, start_step)
            if self.read_ahead:
                steps = read_ahead(steps, "toolkit-stream-read-ahead")
            for step, (batches, after) in enumerate(steps, start_step + 1):
                self.positions = {step - 1: self.positions.get(step - 1), step: after}
                self.steps_done = step
                yield batches
        finally:
            self._report_dropped(self.windows)

    def _read(self, windows: Windows, step: int):
        """Each step's micro-batches from ``step`` on, with the position of a resume after it (in the read-ahead
        thread: the windows it holds move on before the caller asks for the position)."""
        B = self.global_batch_size
        while True:
            start = step * B
            if not windows.available(start + B):
                return
            mine = self.encode([windows.row(g) for g in range(start + self.rank, start + B, self.dp)])
            windows.forget_before(start + B)
            batches = []
            for i in range(0, len(mine), self.micro):
                rows = mine[i:i + self.micro]
                batches.append(self.collate(pack_bfd(rows, self.bfd_block_size) if self.bfd_block_size else rows))
            step += 1
            yield batches, windows.position(start + B)

    def _report_dropped(self, windows: Windows) -> None:
        if self.record is not None:
            self.record["train"] = windows.dropped
        if windows.dropped:
            what = getattr(self.keep, "drops", "rows the task cannot train on")
            self.log(f"the stream dropped {windows.dropped} {what} (of the rows this run read, the training rows "
                     "read ahead included)")

    def position(self, step: int) -> dict:
        """The ``LoopState.stream`` record for a resume at ``step`` (after the steps already given)."""
        if self.positions.get(step) is None:
            raise RuntimeError(f"no stream position recorded for step {step} (the last steps given: "
                               f"{sorted(self.positions)})")
        return self.positions[step]

    def head(self, n: int) -> list[dict]:
        """The first ``n`` rows of the global order, tokenized (the same on every rank): for the FLOPs estimate and
        the packing guard. The first window is read once (up to shuffle_buffer_size rows) for every such call."""
        if self.first_window is None:
            windows = Windows(self.source(None), self.spec, self.keep)
            # window 0, and the windows after it only where the first global batch reaches past it
            self.holds_one_step = windows.available(self.global_batch_size)
            self.first_window, self.head_columns = windows.loaded.get(0, (None, []))[1], windows.columns
        rows = self.encode(self.first_window[:n])
        return pack_bfd(rows, self.bfd_block_size) if self.bfd_block_size and rows else rows


def no_first_step(global_batch: int) -> ConfigError:
    """A stream that ends before its first global batch: refused before the weights load (``toolkit.training.build``), and by
    the loop for a stream that changed since."""
    return ConfigError("train_file", f"the stream ends before its first global batch ({global_batch} rows it keeps): "
                                     "nothing to train on; add rows, or lower per_device_train_batch_size or "
                                     "gradient_accumulation_steps")


def eval_rows(files: list[str], keep, encode, limit: int | None, bfd_block_size: int | None, log=print,
              record: dict | None = None):
    """The validation set of a streamed run, as a ``Dataset``: the first ``limit`` rows (all without a limit) of the
    validation files, read as a stream in file order, tokenized (and packed with bfd) like the training rows; rows
    ``keep`` drops (None) are counted in one line of the log (and in ``record["validation"]``)."""
    from datasets import Dataset

    rows, dropped = [], 0
    for row in source_rows(open_source(files, seed=0, shuffle=False), files, "validation_file"):
        verdict = keep(row)
        dropped += verdict is None
        if verdict:
            rows.append(row)
            if limit and len(rows) == limit:
                break
    if record is not None:
        record["validation"] = dropped
    if dropped:
        log(f"the validation stream dropped {dropped} {getattr(keep, 'drops', 'rows the task cannot use')}")
    if not rows:
        raise ConfigError("validation_file", "the validation stream has no row to evaluate on")
    tokenized = encode(rows)
    return Dataset.from_list(pack_bfd(tokenized, bfd_block_size) if bfd_block_size else tokenized)

"""The order of a stream (toolkit.data.stream), in process: the same global batches on any data-parallel degree, an exact
resume on another degree, a run that ends with its stream; what a stream cannot honour is refused before work."""

import json

import pytest

from toolkit.config import ConfigError, DataArguments, config_from_dict
from toolkit.data.stream import StreamSpec, TrainStream, shard_order

FILES, ROWS_PER_FILE = 4, 23  # file sizes and a window size that align with nothing: windows straddle files


@pytest.fixture
def shards(tmp_path) -> list[str]:
    paths = []
    for f in range(FILES):
        path = tmp_path / f"part-{f}.jsonl"
        # every 7th row is empty: skipped before it gets a global index, on every rank alike
        path.write_text("\n".join(json.dumps({"text": "" if (f * ROWS_PER_FILE + i) % 7 == 3 else f"{f}-{i}"})
                                  for i in range(ROWS_PER_FILE)) + "\n")
        paths.append(str(path))
    return paths


def _stream(files, dp, rank, micro, accumulation, window=10, seed=3):
    """A stream whose rows stay their text (no tokenizer): the order is what is under test."""
    return TrainStream(StreamSpec(files, window, seed, True), keep=lambda row: bool(row["text"]),
                       encode=lambda rows: [r["text"] for r in rows], collate=list, micro=micro,
                       accumulation=accumulation, data_parallel_size=dp, rank=rank)


def _global_steps(files, dp, micro, accumulation, start=0, positions=None, steps=None):
    """Each step's rows over every rank (a set: the partition among ranks does not change the update), and each
    step's resume position; ``positions``: the checkpoint's record to start from."""
    ranks = [_stream(files, dp, r, micro, accumulation) for r in range(dp)]
    iterators = [s.steps(start, positions) for s in ranks]
    out, where = [], []
    for step in range(start, start + (steps or 10**6)):
        got = [next(it, None) for it in iterators]
        assert all(g is None for g in got) or all(g is not None for g in got), "the ranks disagree on the end"
        if got[0] is None:
            break
        assert all(len(g) == accumulation and all(len(m) == micro for m in g) for g in got)
        out.append(sorted(row for g in got for micro_batch in g for row in micro_batch))
        where.append([s.position(step + 1) for s in ranks])
        assert all(w == where[-1][0] for w in where[-1]), "every rank records the same position"
    return out, [w[0] for w in where]


def test_the_global_batches_are_the_same_on_1_2_and_4_ranks_step_by_step(shards):
    one, _ = _global_steps(shards, 1, 8, 1)
    two, _ = _global_steps(shards, 2, 2, 2)
    four, _ = _global_steps(shards, 4, 1, 2)
    kept = FILES * ROWS_PER_FILE - sum(1 for g in range(FILES * ROWS_PER_FILE) if g % 7 == 3)
    assert len(one) == kept // 8 and one == two == four
    # shuffled across windows and files: not the files' order, and the shard order follows the seed
    flat = [row for step in one for row in step]
    assert len(set(flat)) == len(flat) and flat != sorted(flat)
    assert shard_order(shards, 3, True) != shards and shard_order(shards, 3, False) == shards


@pytest.mark.parametrize("writer, reader", [(2, 4), (4, 1), (1, 2)])
def test_a_resume_on_another_world_size_continues_the_uninterrupted_order_every_row_once(shards, writer, reader):
    micro = {1: (8, 1), 2: (2, 2), 4: (1, 2)}
    whole, positions = _global_steps(shards, writer, *micro[writer])
    for stop in (1, 3, len(whole) - 1):  # g = 8, 24 (mid-window), the last step
        # the JSON round trip of a checkpoint's toolkit_state.json
        saved = json.loads(json.dumps(positions[stop - 1]))
        resumed, _ = _global_steps(shards, reader, *micro[reader], start=stop, positions=saved)
        assert whole[:stop] + resumed == whole
        rows = [row for step in whole[:stop] + resumed for row in step]
        assert len(rows) == len(set(rows))


def test_a_resume_with_another_window_size_is_refused(shards):
    _, positions = _global_steps(shards, 1, 8, 1, steps=2)
    moved = TrainStream(StreamSpec(shards, 4, 3, True), keep=lambda r: True, encode=list, collate=list, micro=8,
                        accumulation=1)
    with pytest.raises(ConfigError, match="shuffle_buffer_size.*window size changed"):
        next(moved.steps(2, positions[1]))


@pytest.mark.slow  # an in-process run: ~2 s alone, more beside other work
def test_a_stream_shorter_than_max_steps_ends_the_run_cleanly_with_a_message(tiny_model, tmp_path, capsys):
    from helpers import train_in_process

    path = tmp_path / "short.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {i} of a short stream"}) for i in range(11)) + "\n")
    summary = train_in_process({"model_name_or_path": tiny_model, "train_file": str(path), "streaming": True,
                                "max_steps": 50, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                "block_size": 32, "output_dir": str(tmp_path / "out"), "report_to": "none",
                                "save_final_model": False, "optim": "sgd"})
    assert summary["steps"] == 2 and summary["train_rows"] == 8  # 11 rows: two global batches of 4, 3 left out
    assert "the stream ended after step 2 of max_steps 50 (8 rows trained on): the run ends here" in capsys.readouterr().out


def _config(tiny_model, tmp_path, **values):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "a"}\n')
    return config_from_dict({"model_name_or_path": tiny_model, "train_file": str(path), "streaming": True,
                             "max_steps": 3, "output_dir": str(tmp_path / "out"), **values})


@pytest.mark.parametrize("values, field, words", [
    ({"max_steps": -1}, "max_steps", "a stream has no length"),
    ({"max_train_samples": 4}, "max_train_samples", "bound a stream with max_steps"),
    ({"dataloader_num_workers": 2}, "dataloader_num_workers", "set dataloader_num_workers: 0"),
    ({"shuffle_buffer_size": 0}, "shuffle_buffer_size", "positive"),
])
def test_what_a_stream_cannot_honour_is_refused_before_work(tiny_model, tmp_path, values, field, words):
    with pytest.raises(ConfigError) as err:
        _config(tiny_model, tmp_path, **values)
    assert err.value.field_name == field and words in str(err.value)


def test_a_stream_reads_local_files_and_packs_whole_documents(tiny_model, tmp_path):
    from toolkit.tasks.classification import SequenceClassification
    from toolkit.tasks.dpo import DPO
    from toolkit.tasks.lm import CausalLM
    from toolkit.training.build import build

    with pytest.raises(ConfigError, match="streaming.*set train_file"):
        DataArguments(dataset_name="pydoc", streaming=True)
    with pytest.raises(ConfigError, match="packing_strategy.*wrapped packing mixes neighbouring documents"):
        build(_config(tiny_model, tmp_path, packing_strategy="wrapped"))
    for task, words in ((DPO(), "reference log-probs"), (SequenceClassification(), "whole training set")):
        with pytest.raises(ConfigError, match=f"streaming.*{task.name} task cannot train on a stream.*{words}"):
            build(_config(tiny_model, tmp_path), task=task)
    cfg = _config(tiny_model, tmp_path)
    CausalLM().check(cfg)  # packing unset on a causal-LM stream: whole documents, bfd
    assert cfg.data.packing and cfg.data.padding_free


def test_datasets_own_stream_tools_break_the_order_contract(shards):
    """Why toolkit.data.stream owns the order (docs/pitfalls.md#stream-order): on this 4-file stream, datasets 5.2's
    ``split_dataset_by_node`` hands whole files to ranks, so 2 ranks see other global batches than 1 process; and a
    ``shuffle(buffer_size)`` stream resumed from its ``state_dict`` does not continue its order (the buffer is not
    saved). The windows above keep both (the two tests before)."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    def stream():
        return load_dataset("json", data_files={"train": shards}, split="train", streaming=True)

    one = [r["text"] for r in stream()][:32]
    ranks = [[r["text"] for r in split_dataset_by_node(stream(), rank=r, world_size=2)] for r in (0, 1)]
    two = [row for step in range(8) for rank in ranks for row in rank[step * 2:(step + 1) * 2]][:32]
    assert [sorted(one[i:i + 4]) for i in range(0, 32, 4)] != [sorted(two[i:i + 4]) for i in range(0, 32, 4)]

    shuffled = stream().shuffle(seed=3, buffer_size=16)
    whole, it = [r["text"] for r in shuffled], iter(shuffled)
    head = [next(it)["text"] for _ in range(20)]
    state = shuffled.state_dict()
    resumed = stream().shuffle(seed=3, buffer_size=16)
    resumed.load_state_dict(state)
    assert head == whole[:20] and head + [r["text"] for r in resumed] != whole


@pytest.mark.slow  # an in-process run: ~2 s alone, more beside other work
def test_a_resume_whose_shard_was_regenerated_with_other_rows_of_the_same_size_is_refused(tiny_model, tmp_path,
                                                                                           monkeypatch):
    """A stream resumes at a row index: a shard rewritten with other rows of the same byte size (the names and sizes
    were all a checkpoint recorded) would have resumed into other data. Refused before the weights load, naming it."""
    from helpers import train_in_process

    import toolkit.training.build

    paths = []
    for f in range(2):
        paths.append(tmp_path / f"part-{f}.jsonl")
        paths[-1].write_text("".join(json.dumps({"text": f"row {i:02d} of shard {f}"}) + "\n" for i in range(20)))
    values = {"model_name_or_path": tiny_model, "train_file": str(tmp_path / "part-*.jsonl"), "streaming": True,
              "shuffle_buffer_size": 8, "max_steps": 2, "save_steps": 1, "per_device_train_batch_size": 4,
              "block_size": 16, "output_dir": str(tmp_path / "out"), "report_to": "none", "save_final_model": False,
              "optim": "sgd"}
    first = train_in_process(values)
    assert first["steps"] == 2 and first["epochs"] is None  # a stream not read to its end: no length, no fraction
    before = paths[1].read_bytes()
    paths[1].write_text("".join(json.dumps({"text": f"row {19 - i:02d} of shard 1"}) + "\n" for i in range(20)))
    assert len(paths[1].read_bytes()) == len(before) and paths[1].read_bytes() != before

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights loaded before the resume was refused")

    monkeypatch.setattr(toolkit.training.build, "load_model", no_weights)
    with pytest.raises(ConfigError, match=r"train_file: cannot resume from .*step-2: .*part-1\.jsonl changed since "
                                          r"the checkpoint was written .*put back the files"):
        train_in_process({**values, "max_steps": 4, "resume_from_checkpoint": "latest"})


@pytest.mark.slow  # two in-process runs: ~2 s each alone
@pytest.mark.parametrize("streaming", [True, False])
def test_rows_with_no_text_are_dropped_and_counted_on_both_paths(tiny_model, tmp_path, capsys, streaming):
    """A null text killed a streamed run at the row (while the map-style path refused the whole file): both drop the
    row and say how many in one line. A text that is not a string (a row of another shape) is dropped alike."""
    from helpers import train_in_process

    from toolkit.tasks.lm import CausalLM

    path = tmp_path / "holes.jsonl"
    path.write_text("".join(json.dumps({"text": None if i % 3 == 1 else f"row {i} has a few words"}) + "\n"
                            for i in range(30)))
    summary = train_in_process({"model_name_or_path": tiny_model, "train_file": str(path), "streaming": streaming,
                                "max_steps": 20, "per_device_train_batch_size": 4, "block_size": 16, "packing": False,
                                "validation_split_percentage": 0, "output_dir": str(tmp_path / "out"),
                                "report_to": "none", "save_final_model": False, "optim": "sgd"})
    out = capsys.readouterr().out
    if streaming:  # 20 rows with text: 5 steps of 4, the stream read to its end
        assert summary["steps"] == 5 and summary["train_rows"] == 20 and summary["epochs"] == 1.0
        assert out.count("the stream dropped 10 rows with no text (null, empty or not a string) in column 'text'") == 1
    else:
        assert summary["steps"] == 20
        assert out.count("dropped the rows with no text (null, empty or not a string) in column 'text': 10 of 30 in "
                         "the train split") == 1
    assert summary["dropped_rows"] == {"train": 10}  # summary.json counts them on both paths
    if streaming:
        from transformers import AutoTokenizer

        keep, _ = CausalLM().stream_rows(AutoTokenizer.from_pretrained(tiny_model), DataArguments(), 16)
        assert keep({"text": 5}) is None and keep({"text": None}) is None and keep({"text": ""}) is None


def _read_ahead_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "toolkit-stream-read-ahead"]


def test_the_next_step_is_read_ahead_in_a_thread_that_never_outlives_the_stream(shards):
    """The next step is read and tokenized while the caller trains the current one (one step ahead, no more), and
    the thread ends with the stream: closed early, dropped, at the end of the data, and on an error in it (raised
    in the caller). A daemon: a process that exits mid-stream is not held by it."""
    import time

    calls = []

    def stream(fail_at=None):
        def encode(rows):
            calls.append(len(rows))
            if len(calls) == fail_at:
                raise ValueError("a tokenizer failure")
            return [r["text"] for r in rows]

        return TrainStream(StreamSpec(shards, 10, 3, True), keep=lambda r: bool(r["text"]), encode=encode,
                           collate=list, micro=4, accumulation=1)

    steps = stream().steps()
    next(steps)
    deadline = time.time() + 60
    while len(calls) < 2 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(calls) == 2 and len(_read_ahead_threads()) == 1  # step 1 read while step 0 is with the caller
    assert _read_ahead_threads()[0].daemon  # the interpreter's exit does not wait for it (threading joins the others)
    steps.close()
    assert not _read_ahead_threads()
    steps = stream().steps()
    next(steps)
    del steps  # dropped without a close: the thread goes with it
    assert not _read_ahead_threads()
    whole = list(stream().steps())  # to the end of the data
    assert len(whole) == len(_global_steps(shards, 1, 4, 1)[0]) and not _read_ahead_threads()
    calls.clear()
    steps = stream(fail_at=3).steps()
    assert next(steps) == whole[0] and next(steps) == whole[1]  # the steps before the failure come, in order
    with pytest.raises(ValueError, match="a tokenizer failure"):  # step 2's, read ahead: raised when it is asked for
        next(steps)
    assert not _read_ahead_threads()


@pytest.mark.slow  # an in-process run: ~2 s alone
def test_a_run_that_raises_mid_stream_leaves_no_read_ahead_thread(tiny_model, tmp_path):
    """The error's traceback holds the loop's frame (and so its stream) alive: the loop closes the stream itself."""
    from helpers import train_in_process

    class Fail:
        def on_step_end(self, state, **_):
            if state.step == 2:
                raise RuntimeError("a failure at step 2")

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i} of the stream"}) + "\n" for i in range(40)))
    with pytest.raises(RuntimeError, match="a failure at step 2") as err:  # held, as a notebook holds its last error
        train_in_process({"model_name_or_path": tiny_model, "train_file": str(path), "streaming": True,
                          "max_steps": 8, "per_device_train_batch_size": 2, "block_size": 16,
                          "output_dir": str(tmp_path / "out"), "report_to": "none", "save_final_model": False,
                          "optim": "sgd"}, callbacks=[Fail()])
    assert err.value.__traceback__ is not None and not _read_ahead_threads()


def test_a_chat_stream_drops_and_counts_a_row_that_fits_no_format_instead_of_stopping_mid_run(bpe_2048):
    """Mid-run, a chat row with null messages (or no chat format at all) is dropped and counted like a text stream's
    null text: a ConfigError there ended the run without its summary, evaluation or export, and a resume stopped at
    the same row again."""
    from toolkit.config import DataArguments
    from toolkit.tasks.sft import ChatSFT

    keep, _ = ChatSFT().stream_rows(bpe_2048, DataArguments(), 64)
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert keep(good) is True
    assert keep({"messages": None}) is None and keep({"other": 1}) is None
    assert "fit no chat format" in keep.drops


def test_a_chat_stream_that_goes_on_in_another_format_is_refused_as_the_loaded_set_is(tmp_path, tiny_model, chats,
                                                                                      bpe_2048):
    """A file of messages rows that goes on in valid Alpaca rows: the loaded set refuses it in one line (its columns
    name messages, the Alpaca rows hold nulls there); a stream dropped every Alpaca row as fitting no chat format
    and ended with data_ran_out. Same data, same answer: where the first window holds the change, the check before
    the weights (and toolkit train's) refuses it; further on, the stream stops at it on every rank alike (an
    UnreadableLine: the loop logs and saves the step before, test_run_end.py). (Files of other columns in one stream
    were already refused: datasets' reader cannot cast a file to the first one's columns.)"""
    from toolkit.cli import train as launch
    from toolkit.data.stream import UnreadableLine
    from toolkit.tasks.sft import ChatSFT

    def chat(i):
        return {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}

    def alpaca(i):
        return {"instruction": f"do {i}", "input": "", "output": f"done {i}"}

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(row) + "\n" for row in [*map(chat, range(10)), *map(alpaca, range(30))]))
    argv = ["--model_name_or_path", tiny_model, "--train_file", str(mixed), "--chat_template", chats["chat_template"],
            "--output_dir", str(tmp_path / "out"), "--max_steps", "3", "--per_device_train_batch_size", "2"]
    for streaming, words in (("false", "the train split, row 10: column 'messages' holds None"),
                             ("true", "the stream's rows are in the messages format (its first rows'), but a row "
                                      "further on is in the alpaca format ({'instruction': 'do 0', 'input': ''")):
        with pytest.raises(ConfigError) as err:
            launch.check("chat-sft", launch.strategy_config("ddp"), 1, [*argv, "--streaming", streaming])
        assert err.value.field_name == "dataset_format" and err.value.message.startswith(words), err.value.message
    # further on: after the first window, mid-run
    later = tmp_path / "later.jsonl"
    later.write_text("".join(json.dumps(row) + "\n" for row in [*map(chat, range(8)), *map(alpaca, range(8))]))
    keep, _ = ChatSFT().stream_rows(bpe_2048, DataArguments(), 64, "messages")
    stream = TrainStream(StreamSpec([str(later)], 4, 3, False), keep=keep, collate=list, micro=2, accumulation=1,
                         encode=lambda rows: [row["messages"][0]["content"] for row in rows])
    steps = stream.steps()
    assert [next(steps) for _ in range(4)] == [[[f"q {i}", f"q {i + 1}"]] for i in range(0, 8, 2)]
    with pytest.raises(UnreadableLine, match="dataset_format: the stream's rows are in the messages format"):
        next(steps)


def test_a_later_file_of_a_stream_that_switches_format_stops_at_its_first_other_row(tmp_path, bpe_2048):
    """The switch in a later file than the first (the matrix's stream_switch cells): ``datasets`` casts every file to
    the first one's columns, so the Alpaca rows came as rows of nulls (``{'messages': None}``), each dropped as
    fitting no chat format, and the run ended with data_ran_out. Now the stream gives the rows before the switch,
    then stops at the first Alpaca row, naming its file and row (an UnreadableLine: every rank alike)."""
    from toolkit.data.stream import UnreadableLine
    from toolkit.tasks.sft import ChatSFT

    def chat(i):
        return {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}

    first, second = tmp_path / "part-0.jsonl", tmp_path / "part-1.jsonl"
    first.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(4)))
    second.write_text("".join(json.dumps(row) + "\n" for row in [chat(4), chat(5), *(
        {"instruction": f"do {i}", "input": "", "output": f"done {i}"} for i in range(6))]))
    keep, _ = ChatSFT().stream_rows(bpe_2048, DataArguments(), 64, "messages")
    stream = TrainStream(StreamSpec([str(first), str(second)], 2, 3, False), keep=keep, collate=list, micro=2,
                         accumulation=1, encode=lambda rows: [row["messages"][0]["content"] for row in rows])
    steps = stream.steps()
    assert [next(steps) for _ in range(3)] == [[[f"q {i}", f"q {i + 1}"]] for i in range(0, 6, 2)]
    with pytest.raises(UnreadableLine, match=r"dataset_format: the stream's rows have the columns \['messages'\] "
                                             r"\(its first file's\), but .*part-1.jsonl row 3 has others"):
        next(steps)  # (without the fix: StopIteration, the 6 Alpaca rows dropped as rows of nulls)


def test_a_later_file_with_a_column_of_nulls_only_streams_on(tmp_path):
    """A later file's extra column that holds no value (``"meta": null`` on every row) is no other format: its rows
    stream on (a CastError stopped the stream at that file before: datasets cannot cast a column it does not know,
    even one of nulls)."""
    from toolkit.data.stream import open_source, source_rows

    def chat(i):
        return {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(3)))
    second.write_text("".join(json.dumps({**chat(i), "meta": None}) + "\n" for i in range(3, 6)))
    files = [str(first), str(second)]
    assert [row["messages"][0]["content"] for row in source_rows(open_source(files, 0, False), files)] == [
        f"q {i}" for i in range(6)]


def test_a_malformed_json_line_in_a_stream_is_dropped_and_counted_and_a_resume_reads_the_same_rows(tmp_path, capsys):
    """A malformed line in the middle of a stream was pyarrow's traceback (its JSON reader parses a chunk at once and
    cannot skip a line). The file is read on from that chunk line by line: the line is a row of nulls, dropped and
    counted like a null text, and named in the log; the rows keep their indices, so a resume reads the same rows.
    A reader that cannot go on (a CSV row with too many fields) is one ConfigError naming the file and the line."""
    from toolkit.data.stream import eval_rows

    good, bad = tmp_path / "part-0.jsonl", tmp_path / "part-1.jsonl"
    good.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)))
    bad.write_text('{"text": "row 8"}\n{"text": "a line cut sho\n[9, 10]\n{"text": "row 11"}\n{"text": "row 12"}\n')
    said = []

    def stream():
        keep = lambda row: True if row["text"] else None  # noqa: E731
        keep.drops = "rows with no text"
        return TrainStream(StreamSpec([str(good), str(bad)], 4, 3, False), keep=keep,
                           encode=lambda rows: [r["text"] for r in rows], collate=list, micro=2, accumulation=1,
                           log=said.append)

    steps = list(stream().steps())
    assert [row for step in steps for row in step[0]] == [f"row {i}" for i in (*range(9), 11, 12)][:10]
    assert said[0].startswith("the stream dropped 2 rows with no text")
    out = capsys.readouterr().out
    assert f"the stream skips {bad} line 2 (Unterminated string" in out and f"{bad} line 3 (a JSON list" in out
    resumed = stream()
    assert list(resumed.steps(4, _position_after(stream, 4))) == steps[4:]  # the same rows after a resume
    validation = eval_rows([str(bad)], lambda row: True if row["text"] else None, lambda rows: rows, None, None,
                           log=lambda line: None)
    assert validation["text"] == ["row 8", "row 11", "row 12"]
    first, csv = tmp_path / "part-0.csv", tmp_path / "part-1.csv"
    first.write_text("text\nrow 0\nrow 1\nrow 2\nrow 3\n")
    csv.write_text("text\nrow 8\nrow 9,with,commas\nrow 10\n")

    def csv_stream():
        return TrainStream(StreamSpec([str(first), str(csv)], 2, 3, False), keep=lambda row: True,
                           encode=lambda rows: [r["text"] for r in rows], collate=list, micro=1, accumulation=1)

    for start, position in ((0, None), (2, _position_after(csv_stream, 2))):  # a resume meets it again
        steps = csv_stream().steps(start, position)
        assert [next(steps) for _ in range(start, 4)][-1] == [["row 3"]]
        with pytest.raises(ConfigError) as err:  # an UnreadableLine: the loop ends the run on it (test_run_end.py)
            next(steps)
        assert err.value.field_name == "train_file"
        assert err.value.message.startswith(f"cannot read ['{csv}']: ParserError")
        assert "Expected 1 fields in line 3, saw 3" in err.value.message
        assert err.value.message.endswith("fix or remove the row it names")


def _position_after(make, step: int) -> dict:
    """The checkpoint's stream record after ``step`` steps of a fresh stream."""
    stream = make()
    steps = stream.steps()
    for _ in range(step):
        next(steps)
    position = stream.position(step)
    steps.close()
    return position

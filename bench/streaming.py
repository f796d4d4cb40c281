"""Streaming (``streaming: true``, toolkit/data/stream.py): memory on a corpus that is never stored, and the time to the
first optimizer step against the map-style path on the same file.

    python bench/streaming.py                      # both parts; writes bench/results/streaming.{json,md}
    python bench/streaming.py --tokens 10_000_000  # the size of the file of part 2

1. A synthetic stream of ``--stream-tokens`` (1e9) GPT-2 tokens, generated on the fly by a ``datasets`` generator in
   64 shards (random words of CPython's docs, seeded per shard; nothing is written), trained ``--steps`` steps of a
   tiny GPT-2 (1 process, windows of ``--window`` rows): the resident memory after every step and its peak
   (``VmHWM``); then the same stream's data path alone (read, shuffle, tokenize, pack, collate) over ``--data-rows``
   rows, the memory every 1,000. Constant means: nothing of the stream is held beyond its current window. Freed
   heap memory goes back to the system here (``cpu_memory_reuse: false``), so the memory shown is what is live.
2. A text file of about ``--tokens`` tokens (bench/data_memory.py's corpus), trained to its first step map-style
   (every document tokenized and packed first: the causal LM's defaults, wrapped packing) and streamed (the first
   window read, each step's rows tokenized as they come; bfd, the stream's default), each in a fresh process with an
   empty ``datasets`` cache: seconds from the start of ``build`` to the end of step 1, and peak memory.
3. The cost of a step once training runs (``--parts step``): ``--step-steps`` steps on one file of about
   ``--step-tokens`` tokens, map-style and streamed, one document per row and ``shuffle: false`` (so that both paths
   train the same documents at every step, padded alike), each in a fresh process, alternating ``--rounds`` times; the wall
   time between the ends of consecutive steps after the first ``--warmup``, pooled over the rounds. The stream as it
   runs (the next step read ahead in a thread) and with each step read in the loop's thread, against the map-style
   baseline measured in the same command: the ratios of the medians.
Each measurement runs in its own process so that peaks do not mix.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def rss_mb() -> tuple[float, float]:
    """(resident, peak resident) MB of this process, from /proc/self/status."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def synthetic_rows(shards: list[int], rows_per_shard: int, words_per_row: int):
    """Rows of random words of CPython's docs, seeded per shard: generated as read, never stored."""
    from pydoc_data.topics import topics

    import numpy as np

    vocabulary = sorted({w for k in sorted(topics)[:50] for w in topics[k].split()})
    for shard in shards:
        rng = np.random.default_rng([7, shard])
        for _ in range(rows_per_shard):
            yield {"text": " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), words_per_row))}


class StepClock:
    """on_step_end: the wall and CPU seconds (this process, its threads included: the shared machine's contention
    shows in the first, less in the second) from its creation to the end of step 1, and the memory after every step."""

    def __init__(self):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.first_step = self.first_step_cpu = None
        self.rss = []

    def on_step_end(self, accelerator, state, row):
        if self.first_step is None:
            self.first_step = time.perf_counter() - self.start
            self.first_step_cpu = time.process_time() - self.cpu_start
        self.rss.append(rss_mb()[0])


def _config(model: str, train_file: str, out: str, steps: int, streaming: bool, window: int, block_size: int,
            **extra):
    from toolkit.config import config_from_dict

    return config_from_dict({"model_name_or_path": model, "train_file": train_file, "streaming": streaming,
                             "shuffle_buffer_size": window, "block_size": block_size, "max_steps": steps,
                             "per_device_train_batch_size": 4, "validation_split_percentage": 0,
                             "output_dir": out, "report_to": "none", "save_final_model": False, "logging_steps": 50,
                             "cpu_memory_reuse": False,
                             "optim": "sgd", "learning_rate": 1e-3, **extra})


class StepTimes:
    """on_step_end: the wall and CPU seconds between the ends of consecutive steps."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, accelerator, state, row):
        self.ends.append((time.perf_counter(), time.process_time()))


def run_steps(args) -> dict:
    """Part 3, in this process: ``--step-steps`` steps of one path on ``args.file`` (one document per row)."""
    from toolkit.parallel.accelerator import make_accelerator
    from toolkit.training.build import build
    from toolkit.training.loop import train

    work = tempfile.mkdtemp()
    cfg = _config(args.model, args.file, os.path.join(work, "out"), args.step_steps, args.streaming, args.window,
                  args.block_size, packing=False, per_device_train_batch_size=args.micro, shuffle=False)
    accelerator = make_accelerator(cfg.train)
    parts, times = build(cfg, accelerator), StepTimes()
    if args.streaming:
        parts.train_dataset.read_ahead = args.read_ahead
    train(cfg, accelerator, **parts.train_kwargs(), callbacks=[times])
    ends = times.ends[args.warmup:]
    out = {"wall_s": [b[0] - a[0] for a, b in zip(ends, ends[1:])],
           "cpu_s": [b[1] - a[1] for a, b in zip(ends, ends[1:])]}
    if args.streaming:  # the stream's data path alone (read, shuffle, tokenize, collate), in this thread
        stream, start = parts.train_dataset, time.process_time()
        stream.read_ahead = False
        for _ in zip(range(args.step_steps), stream.steps()):
            pass
        out["data_path_cpu_s"] = [(time.process_time() - start) / args.step_steps]
    return out


def step_part(args, corpus: str) -> dict:
    """Part 3: the three paths alternating in fresh processes, ``args.rounds`` times; the medians and ratios."""
    import statistics

    paths = {"map_style": ["--streaming", "false"], "stream": ["--streaming", "true"],
             "stream_no_read_ahead": ["--streaming", "true", "--read-ahead", "false"]}
    pooled = {name: {"wall_s": [], "cpu_s": []} for name in paths}
    for _ in range(args.rounds):
        for name, flags in paths.items():
            got = child(args, "steps", "--file", corpus, *flags)
            for key, values in got.items():
                pooled[name].setdefault(key, []).extend(values)
    out = {"tokens": args.step_tokens, "steps": args.step_steps, "warmup": args.warmup, "rounds": args.rounds,
           "micro": args.micro, "block_size": args.block_size, "threads": args.threads or None,
           "load_average": os.getloadavg()}
    for name, values in pooled.items():
        out[name] = {f"median_{key}_ms": 1000 * statistics.median(v) for key, v in values.items()}
        out[name]["steps_timed"] = len(values["wall_s"])
    base = out["map_style"]["median_wall_s_ms"]
    for name in ("stream", "stream_no_read_ahead"):
        out[f"{name}_over_map_style"] = out[name]["median_wall_s_ms"] / base
        out[f"{name}_over_map_style_cpu"] = out[name]["median_cpu_s_ms"] / out["map_style"]["median_cpu_s_ms"]
    return out


def run_stream(args) -> dict:
    """Part 1, in this process."""
    from datasets import IterableDataset

    from toolkit.data.stream import StreamSpec, TrainStream
    from toolkit.parallel.accelerator import make_accelerator
    from toolkit.training.build import build
    from toolkit.training.loop import train

    work = tempfile.mkdtemp()
    placeholder = os.path.join(work, "placeholder.jsonl")  # the config needs a file; the stream replaces it
    with open(placeholder, "w") as f:
        f.write(json.dumps({"text": "placeholder"}) + "\n")
    cfg = _config(args.model, placeholder, os.path.join(work, "out"), args.steps, True, args.window, args.block_size)
    accelerator = make_accelerator(cfg.train)
    clock = StepClock()
    parts = build(cfg, accelerator)
    probe = parts.task.stream_rows(parts.tokenizer, cfg.data, 10**9)[1]  # untruncated: the tokens of a row
    sample = [len(r["input_ids"]) for r in probe(list(synthetic_rows([0], 64, args.words_per_row)))]
    rows = round(args.stream_tokens / (sum(sample) / len(sample)))
    shards = 64

    def source(state):
        stream = IterableDataset.from_generator(synthetic_rows, gen_kwargs={
            "shards": list(range(shards)), "rows_per_shard": rows // shards, "words_per_row": args.words_per_row})
        if state is not None:
            stream.load_state_dict(state)
        return stream

    old = parts.train_dataset
    parts.train_dataset = TrainStream(StreamSpec([], args.window, cfg.train.seed, True), keep=old.keep,
                                      encode=old.encode, collate=old.collate, micro=old.micro,
                                      accumulation=old.accumulation, bfd_block_size=old.bfd_block_size,
                                      max_steps=args.steps, source=source)
    summary = train(cfg, accelerator, **parts.train_kwargs(), callbacks=[clock])
    data_rss, per_step = [], parts.train_dataset.global_batch_size
    for step, _ in enumerate(parts.train_dataset.steps()):  # the data path alone, from the stream's start
        if step * per_step % 1000 == 0:
            data_rss.append((step * per_step, rss_mb()[0]))
        if (step + 1) * per_step >= args.data_rows:
            break
    return {"data_rows": args.data_rows, "data_rss_mb_by_rows": data_rss,"stream_tokens": rows * sum(sample) // len(sample), "stream_rows": rows, "tokens_per_row": sum(sample) / len(sample),
            "steps": summary["steps"], "rows_read": summary["train_rows"], "window": args.window,
            "first_step_s": clock.first_step, "first_step_cpu_s": clock.first_step_cpu, "rss_mb_by_step": clock.rss, "peak_rss_mb": rss_mb()[1]}


def run_file(args) -> dict:
    """Part 2, in this process: one of the two paths on ``args.file``."""
    from toolkit.parallel.accelerator import make_accelerator
    from toolkit.training.build import build
    from toolkit.training.loop import train

    work = tempfile.mkdtemp()
    cfg = _config(args.model, args.file, os.path.join(work, "out"), 1, args.streaming, args.window, args.block_size)
    accelerator = make_accelerator(cfg.train)
    clock = StepClock()
    train(cfg, accelerator, **build(cfg, accelerator).train_kwargs(), callbacks=[clock])
    return {"streaming": args.streaming, "first_step_s": clock.first_step, "first_step_cpu_s": clock.first_step_cpu,
            "peak_rss_mb": rss_mb()[1]}


def child(args, *extra) -> dict:
    """A measurement in a fresh process (and an empty datasets cache)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_DATASETS_CACHE": cache, "PYTHONPATH": ROOT}
        if args.threads:  # torch's threads (OMP): fewer on a shared machine, where spinning threads add noise
            env["OMP_NUM_THREADS"] = str(args.threads)
        out = subprocess.run([sys.executable, __file__, "--child", *extra, "--model", args.model, "--window",
                              str(args.window), "--block-size", str(args.block_size), "--steps", str(args.steps),
                              "--data-rows", str(args.data_rows),
                              "--stream-tokens", str(args.stream_tokens), "--step-steps", str(args.step_steps),
                              "--warmup", str(args.warmup), "--micro", str(args.micro)],
                             env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=10_000_000, help="tokens of the file of part 2")
    p.add_argument("--stream-tokens", type=int, default=1_000_000_000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--data-rows", type=int, default=20_000)
    p.add_argument("--window", type=int, default=256, help="shuffle_buffer_size")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--words-per-row", type=int, default=200)
    p.add_argument("--model", default=None)
    p.add_argument("--parts", default="stream,file,step", help="which parts to (re)measure; the others are kept from "
                                                           "bench/results/streaming.json")
    p.add_argument("--step-tokens", type=int, default=1_000_000, help="tokens of the file of part 3")
    p.add_argument("--step-steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10, help="part 3: steps not timed")
    p.add_argument("--rounds", type=int, default=2, help="part 3: each path this many times, alternating")
    p.add_argument("--micro", type=int, default=8, help="part 3: per_device_train_batch_size")
    p.add_argument("--read-ahead", type=lambda v: v == "true", default=True)
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the measured processes (0: unset)")
    p.add_argument("--child", choices=["stream", "file", "steps"])
    p.add_argument("--file")
    p.add_argument("--streaming", type=lambda v: v == "true", default=False)
    args = p.parse_args()
    if args.child:
        result = {"stream": run_stream, "file": run_file, "steps": run_steps}[args.child](args)
        print(json.dumps(result))
        return
    from data_memory import write_corpus

    from toolkit.models.offline import save_tiny_gpt2

    work = tempfile.mkdtemp()
    args.model = args.model or save_tiny_gpt2(os.path.join(work, "tiny"), n_layer=2, n_embd=32, n_head=2,
                                              n_positions=args.block_size, seed=0)
    path = os.path.join(ROOT, "bench", "results", "streaming.json")
    results = json.load(open(path)) if os.path.isfile(path) else {}
    if "stream" in args.parts.split(","):
        results["stream"] = child(args, "stream")
    if "file" in args.parts.split(","):
        corpus = os.path.join(work, "corpus.txt")
        write_corpus(corpus, args.tokens)
        results["file_tokens"] = args.tokens
        for streaming in ("false", "true"):
            results[f"file_streaming_{streaming}"] = child(args, "file", "--file", corpus, "--streaming", streaming)
    if "step" in args.parts.split(","):
        corpus = os.path.join(work, "step_corpus.txt")
        write_corpus(corpus, args.step_tokens)
        results["step"] = step_part(args, corpus)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if "_by_" not in kk} if isinstance(v, dict) else v)
                      for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()

"""Peak memory of tokenizing and packing a large text file: bounded packing batches vs one batch over the split.

    python bench/data_memory.py --tokens 100_000_000

Writes a text file of about ``--tokens`` GPT-2 tokens (CPython's docs, repeated), then, each in a fresh process so
that the peaks do not mix, runs ``toolkit.data.loading.tokenize_and_group`` with packing twice: with the toolkit's bounded
map batches (``PACK_BATCH_ROWS`` documents) and with one map batch over the whole split (what the toolkit did before,
the baseline). Prints the peak resident memory (``ru_maxrss``) and wall time of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(path: str, tokens: int) -> None:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    lines = [line for line in text.splitlines() if line.strip()]  # 8716 documents, one per line
    per_copy = 146_157  # GPT-2 tokens of one copy, EOS included (measured with toolkit.models.offline.gpt2_tokenizer)
    copies = max(1, round(tokens / per_copy))
    with open(path, "w") as f:
        for i in range(copies):
            for line in lines:
                f.write(f"{line} {i}\n")  # a different last word per copy: no two documents are equal


def measure(path: str, batch_rows: int | None, cache_dir: str) -> dict:
    """In this (fresh) process: tokenize + pack ``path``; the peak RSS and the time."""
    sys.path.insert(0, ROOT)
    import datasets

    from toolkit.config import DataArguments
    from toolkit.data import loading as data
    from toolkit.models.offline import gpt2_tokenizer

    datasets.config.HF_DATASETS_CACHE = cache_dir
    tokenizer = gpt2_tokenizer()
    args = DataArguments(train_file=path, validation_split_percentage=0, packing=True, overwrite_cache=True)
    raw = data.load_raw_datasets(args)
    if batch_rows is None:  # the baseline: one map batch over the whole split
        data.PACK_BATCH_ROWS = len(raw["train"])
    started = time.time()
    packed = data.tokenize_and_group(raw, tokenizer, args, block_size=1024)
    seconds = time.time() - started
    return {"mode": "one batch (before)" if batch_rows is None else f"{data.PACK_BATCH_ROWS}-row batches (now)",
            "documents": len(raw["train"]), "blocks": len(packed["train"]), "tokens": len(packed["train"]) * 1024,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--workdir", default=None, help="where the text file and the datasets cache go (a temp dir)")
    parser.add_argument("--measure", choices=["bounded", "one-batch"], help=argparse.SUPPRESS)  # the child mode
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        result = measure(args.file, None if args.measure == "one-batch" else 0, os.path.join(args.workdir, "cache"))
        print("RESULT " + json.dumps(result))
        return

    workdir = args.workdir or tempfile.mkdtemp(prefix="data-memory-")
    path = os.path.join(workdir, "corpus.txt")
    write_corpus(path, args.tokens)
    print(f"corpus: {path} ({os.path.getsize(path) / 2**20:.0f} MiB)")
    results = []
    for mode in ("bounded", "one-batch"):
        proc = subprocess.run([sys.executable, __file__, "--measure", mode, "--file", path, "--workdir", workdir],
                              capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "true"})
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{mode}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        results.append(json.loads(line[7:]))
        print(json.dumps(results[-1]))
    if len(results) == 2:
        print(f"peak memory, one batch / bounded: {results[1]['peak_rss_gb'] / results[0]['peak_rss_gb']:.1f}x")


if __name__ == "__main__":
    main()

"""Data preparation speed: the toolkit's tokenize + pack vs run_clm's ``tokenize_function`` + ``group_texts``.

    python bench/data_prep.py [--tokens 3_000_000 --rounds 3 --num-proc 1,2 --block-size 1024]

Same input for both: CPython's reference docs (``toolkit.data.loading.pydoc_dataset``'s training paragraphs, one document
each) repeated to about ``--tokens`` GPT-2 tokens, written once as a JSON-lines file and loaded with
``datasets.load_dataset("json")`` (file-backed, as a user's data is: every ``map`` writes Arrow cache files); the same
tokenizer (``toolkit.models.offline.gpt2_tokenizer``, the real GPT-2 BPE, fast); block size 1024, ``num_proc`` 1 and 2, no
cache reuse (``load_from_cache_file=False`` and a fresh cache folder per run).

- toolkit: ``toolkit.data.loading.tokenize_and_group`` with ``DataArguments(packing=True)`` (EOS after every document; the
  stream is cut into blocks across map batches, only the last partial block is left out).
- run_clm: transformers' ``examples/pytorch/language-modeling/run_clm.py``, copied: ``tokenizer(examples[text])``
  inside ``CaptureLogger`` (input_ids and attention_mask), batched map (batch size 1000), then ``group_texts``
  (concatenate with ``itertools.chain``, drop each 1000-row batch's remainder, split, ``labels`` = a copy of
  ``input_ids``).

Each (system, num_proc, round) runs in a fresh process (load outside the clock, then the two maps timed), the systems
interleaved round by round and their order alternated, so a slow moment of the machine (tests may run beside it)
hits both. Reported per num_proc: the median seconds (min-max over rounds), documents/s and tokens/s, and the ratio
toolkit / run_clm of documents/s (the same documents in, so the inverse of the time ratio), taken per round then
the median; plus the tokens each keeps. Writes ``bench/results/data_prep.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
SYSTEMS = ("toolkit", "run_clm")
TOKENS_PER_COPY = 97_635  # GPT-2 tokens of pydoc_dataset()'s training paragraphs, no EOS (measured)


def write_corpus(path: str, tokens: int) -> int:
    """The pydoc training paragraphs, ``tokens // TOKENS_PER_COPY`` times, one JSON line each; the copy number ends
    each document so that no two are equal. Returns the documents written."""
    sys.path.insert(0, ROOT)
    from toolkit.data.loading import pydoc_dataset

    paragraphs = list(pydoc_dataset()["train"]["text"])
    copies = max(1, round(tokens / TOKENS_PER_COPY))
    with open(path, "w") as f:
        for i in range(copies):
            for p in paragraphs:
                f.write(json.dumps({"text": f"{p} {i}"}) + "\n")
    return copies * len(paragraphs)


# ------------------------------------------------------------------ run_clm's recipe, as transformers ships it
def run_clm_prepare(raw, tokenizer, block_size: int, num_proc: int, clock: dict):
    """``run_clm.py``'s two maps (transformers 5.x, examples/pytorch/language-modeling), unchanged but for the
    arguments it reads from ``data_args`` (here: text column "text", overwrite_cache=True, no streaming); ``clock``
    gets the seconds of each map."""
    from itertools import chain

    import transformers
    from transformers.testing_utils import CaptureLogger  # imported before the clock starts (run_one), as run_clm does

    column_names = list(raw["train"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]
    tok_logger = transformers.utils.logging.get_logger("transformers.tokenization_utils_base")

    def tokenize_function(examples):
        with CaptureLogger(tok_logger) as cl:
            output = tokenizer(examples[text_column_name])
        # clm input could be much much longer than block_size
        if "Token indices sequence length is longer than the" in cl.out:
            tok_logger.warning(
                "^^^^^^^^^^^^^^^^ Please ignore the warning above - this long input will be chunked into smaller bits"
                " before being passed to the model."
            )
        return output

    started = time.perf_counter()
    tokenized_datasets = raw.map(tokenize_function, batched=True, num_proc=num_proc, remove_columns=column_names,
                                 load_from_cache_file=False, desc="Running tokenizer on dataset")
    clock["tokenize_s"] = time.perf_counter() - started

    # Main data processing function that will concatenate all texts from our dataset and generate chunks of block_size.
    def group_texts(examples):
        # Concatenate all texts.
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        # We drop the small remainder, and if the total_length < block_size  we exclude this batch and return an empty
        # dict. We could add padding if the model supported it instead of this drop.
        total_length = (total_length // block_size) * block_size
        # Split by chunks of max_len.
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    started = time.perf_counter()
    lm_datasets = tokenized_datasets.map(group_texts, batched=True, num_proc=num_proc, load_from_cache_file=False,
                                         desc=f"Grouping texts in chunks of {block_size}")
    clock["group_s"] = time.perf_counter() - started
    return tokenized_datasets, lm_datasets


def _rows_sha(dataset) -> str:
    import hashlib

    h = hashlib.sha256()
    for row in dataset["input_ids"]:
        h.update(repr(list(row)).encode())
    return h.hexdigest()


def run_one(system: str, opts) -> dict:
    """In this (fresh) process: load the corpus (not timed), then prepare it with ``system``, timed."""
    sys.path.insert(0, ROOT)
    import datasets

    from toolkit.config import DataArguments
    from toolkit.data import loading as data
    from toolkit.models.offline import gpt2_tokenizer

    datasets.disable_progress_bars()
    import transformers.testing_utils  # noqa: F401  run_clm's imports, loaded before the clock as its script does
    tokenizer = gpt2_tokenizer()
    args = DataArguments(train_file=opts.file, validation_split_percentage=0, packing=True, overwrite_cache=True,
                         preprocessing_num_workers=opts.num_proc if opts.num_proc > 1 else None)
    raw = data.load_raw_datasets(args)
    documents = len(raw["train"])
    phases, tokenized = {}, {}
    if system == "toolkit":
        pack = data.pack

        def timed_pack(split, *a, **k):  # the toolkit's packing map, clocked on its own (tokenize = the rest)
            started = time.perf_counter()
            out = pack(split, *a, **k)
            phases["group_s"] = phases.get("group_s", 0.0) + time.perf_counter() - started
            tokenized["train"] = split
            return out

        data.pack = timed_pack
        started = time.perf_counter()
        out = data.tokenize_and_group(raw, tokenizer, args, opts.block_size)["train"]
        seconds = time.perf_counter() - started
        phases["tokenize_s"] = seconds - phases["group_s"]
    else:
        started = time.perf_counter()
        tokenized, out = run_clm_prepare(raw, tokenizer, opts.block_size,
                                         opts.num_proc if opts.num_proc > 1 else None, phases)
        seconds = time.perf_counter() - started
        out = out["train"]
    column = tokenized["train"].data.column("input_ids")
    tokenized_tokens = sum(len(chunk.flatten()) for chunk in column.chunks)
    blocks = len(out)
    return {"system": system, "num_proc": opts.num_proc, "seconds": seconds, **phases, "documents": documents,
            "blocks": blocks, "kept_tokens": blocks * opts.block_size, "tokenized_tokens": tokenized_tokens,
            "columns": out.column_names, "rows_sha256": _rows_sha(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=3_000_000, help="about this many GPT-2 tokens of text")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-proc", default="1,2", help="comma-separated num_proc values")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="run_clm is the baseline of the ratios")
    parser.add_argument("--workdir", default=None, help="where the corpus and the datasets caches go (a temp dir)")
    parser.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)  # the child mode
    parser.add_argument("--file", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        opts.num_proc = int(opts.num_proc)
        print("RESULT " + json.dumps(run_one(opts.one, opts)))
        return

    workdir = opts.workdir or tempfile.mkdtemp(prefix="data-prep-")
    os.makedirs(workdir, exist_ok=True)
    corpus = os.path.join(workdir, "corpus.jsonl")
    documents = write_corpus(corpus, opts.tokens)
    print(f"corpus: {corpus} ({documents} documents, {os.path.getsize(corpus) / 2**20:.1f} MiB)", flush=True)
    procs = [int(x) for x in opts.num_proc.split(",")]
    systems = opts.systems.split(",")
    runs = []
    for r in range(opts.rounds):
        for n in procs:
            k = (r + n) % len(systems)
            for system in systems[k:] + systems[:k]:  # who goes first rotates from round to round
                cache = tempfile.mkdtemp(prefix="cache-", dir=workdir)
                env = {**os.environ, "HF_DATASETS_CACHE": cache, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
                proc = subprocess.run([sys.executable, __file__, "--one", system, "--num-proc", str(n), "--file", corpus,
                                       "--block-size", str(opts.block_size)], capture_output=True, text=True, env=env)
                shutil.rmtree(cache, ignore_errors=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"{system} num_proc={n} failed:\n{proc.stderr[-4000:]}")
                runs.append({"round": r, **json.loads(line[7:])})
                print(f"round {r + 1} num_proc {n} {system}: {runs[-1]['seconds']:.2f} s", flush=True)
    if not opts.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    write_results(runs, opts, procs, systems)


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write_results(runs: list[dict], opts, procs: list[int], systems: list[str]) -> None:
    base = "run_clm"
    summary = {}
    for n in procs:
        by = {s: {x["round"]: x for x in runs if x["system"] == s and x["num_proc"] == n} for s in systems}
        row = {}
        for s, xs in by.items():
            xs_ = list(xs.values())
            one = xs_[0]
            row[s] = {"seconds": _stats([x["seconds"] for x in xs_]),
                      "documents_per_s": _stats([one["documents"] / x["seconds"] for x in xs_]),
                      "tokens_per_s": _stats([x["tokenized_tokens"] / x["seconds"] for x in xs_]),
                      "tokenize_s": _stats([x["tokenize_s"] for x in xs_]),
                      "group_s": _stats([x["group_s"] for x in xs_]),
                      "blocks": one["blocks"], "kept_tokens": one["kept_tokens"],
                      "tokenized_tokens": one["tokenized_tokens"], "rows_sha256": one["rows_sha256"]}
            if base in by and s != base:  # per round: this system's documents/s over run_clm's, the same round
                row[s]["over_run_clm"] = _stats([by[base][r]["seconds"] / x["seconds"] for r, x in xs.items()])
        summary[str(n)] = row
    documents = runs[0]["documents"]
    out = {"job": {k: v for k, v in vars(opts).items() if k not in ("one", "file", "workdir")} | {"documents": documents},
           "summary": summary, "runs": runs,
           "env": {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"), "cpus": os.cpu_count()}}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "data_prep.json"), "w") as f:
        json.dump(out, f, indent=2)

    def mm(s, fmt="{:.2f}"):
        return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"

    lines = ["| num_proc | system | seconds, median (min-max) | tokenize / pack s | documents/s | tokens/s | rows "
             "| kept tokens | documents/s vs run_clm, median (min-max) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n in procs:
        for s in systems:
            x = summary[str(n)][s]
            ratio = mm(x["over_run_clm"], "{:.2f}x") if "over_run_clm" in x else "1.00x"
            lines.append(f"| {n} | {s} | {mm(x['seconds'])} | {x['tokenize_s']['median']:.2f} / "
                         f"{x['group_s']['median']:.2f} | {x['documents_per_s']['median']:,.0f} | "
                         f"{x['tokens_per_s']['median']:,.0f} | {x['blocks']:,} | {x['kept_tokens']:,} "
                         f"({x['kept_tokens'] / x['tokenized_tokens']:.2%}) | {ratio} |")
    lines.append("")
    lines.append(f"{documents:,} documents; tokens/s counts the tokens tokenized (the toolkit adds one EOS per document, "
                 f"run_clm none); kept tokens: in the {opts.block_size}-token rows, as a share of those tokenized.")
    with open(os.path.join(RESULTS, "data_prep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.3))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        st = [summary[str(n)][s]["documents_per_s"] for n in procs]
        med = [x["median"] for x in st]
        ax.bar([j + (i - (len(systems) - 1) / 2) * width for j in range(len(procs))], med, width,
               yerr=[[m - x["min"] for m, x in zip(med, st)], [x["max"] - m for m, x in zip(med, st)]], capsize=3,
               label=s)
    ax.set_xticks(range(len(procs)), [f"num_proc {n}" for n in procs])
    ax.set_ylabel("documents / s (median, min-max)")
    ax.set_title(f"tokenize + pack: {documents:,} docs, GPT-2 BPE, {opts.block_size}-token rows", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "data_prep.png"), dpi=120)


if __name__ == "__main__":
    main()

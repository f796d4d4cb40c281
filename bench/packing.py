"""Real tokens/s of padded, bfd-packed (bfd_split too) and wrapped rows (``packing_strategy``, toolkit/data/packing.py), in one process.

    python bench/packing.py [--rounds 5 --steps 3 --layers 2 --width 128 --block 256 --rows 4 --threads 1]

Two jobs, each as its recipe builds the rows: chat SFT on the built-in ``pydoc-chats`` (34-276 tokens a chat with a
ChatML-like template; ``wrapped`` does not apply to chats) and the causal LM on CPython's documentation paragraphs
(``pydoc``: 1-~600 tokens a paragraph). A GPT-2 shape (vocab 50257, random init, one seed) trains with SGD on each kind
of micro-batch through the toolkit's own forward (``CausalLM.row_losses``: padded rows with their attention mask,
a micro-batch of bfd rows flattened into one row with per-document ``position_ids``, no mask, no cache; wrapped rows
full). The packed modes take ``--rows``
rows of up to ``--block`` tokens per micro-batch; padded takes as many documents as ``--rows`` bfd rows hold on
average (the same documents per step), padded to the longest of them. The modes run interleaved, ``--steps`` micro-steps each per round, for ``--rounds`` rounds, so that a slow
moment of a shared machine hits all of them; the figure is real (non-pad) tokens per CPU second of this process
(``time.process_time``, all its threads: less disturbed by other processes than the wall clock), and the wall-clock
rate beside it. The fill rate is real tokens / positions computed. Writes ``bench/results/packing.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _rows(job: str, mode: str, block: int):
    from toolkit.config import DataArguments
    from toolkit.data.chat import set_chat_template
    from toolkit.data.loading import load_raw_datasets, tokenize_and_group
    from toolkit.models.offline import gpt2_tokenizer
    from toolkit.tasks.sft import load_raw_chats, tokenize_chats

    tok = gpt2_tokenizer()
    packing = {"padded": dict(packing=False), "bfd": dict(packing=True, packing_strategy="bfd"),
               "bfd_split": dict(packing=True, packing_strategy="bfd_split"),
               "wrapped": dict(packing=True, packing_strategy="wrapped")}[mode]
    if job == "chat":
        set_chat_template(tok, TEMPLATE)
        args = DataArguments(dataset_name="pydoc-chats", **packing)
        return tokenize_chats(load_raw_chats(args), tok, args, block)["train"], tok
    args = DataArguments(dataset_name="pydoc", **packing)
    return tokenize_and_group(load_raw_datasets(args), tok, args, block)["train"], tok


def _batches(rows, tok, micro: int, count: int, seed: int = 0):
    """``count`` micro-batches of ``micro`` rows, drawn in a seeded order (the same rows every round)."""
    import torch

    from toolkit.data.loading import CausalLMCollator

    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    collate = CausalLMCollator(tok.eos_token_id)
    return [collate([rows[order[(i * micro + j) % len(rows)]] for j in range(micro)]) for i in range(count)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    opts = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.tasks.lm import CausalLM

    torch.set_num_threads(opts.threads)
    jobs = {"chat": ("padded", "bfd"), "text": ("padded", "bfd", "bfd_split", "wrapped")}
    data, fill, micro = {}, {}, {}
    for job, modes in jobs.items():
        built = {mode: _rows(job, mode, opts.block) for mode in modes}
        packed = built["bfd"][0]
        per_row = sum(len(n) for n in packed["seq_lengths"]) / len(packed)
        # the same documents per micro-batch on average: padded takes as many as --rows bfd rows hold
        micro[job] = {mode: opts.rows if mode != "padded" else max(1, round(opts.rows * per_row)) for mode in modes}
        for mode, (rows, tok) in built.items():
            batches = _batches(rows, tok, micro[job][mode], opts.steps * opts.rounds)
            data[job, mode] = batches
            fill[f"{job}/{mode}"] = sum(b["num_tokens"] for b in batches) / sum(b["num_slots"] for b in batches)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=opts.layers, n_embd=opts.width, n_head=max(1, opts.width // 64),
                                       n_positions=opts.block, vocab_size=50257, attn_implementation="sdpa"))
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    task = CausalLM()
    cpu_rates: dict[str, list[float]] = {f"{job}/{mode}": [] for job, modes in jobs.items() for mode in modes}
    wall_rates: dict[str, list[float]] = {k: [] for k in cpu_rates}
    step = lambda b: (task.row_losses(model, b).sum() / b["num_targets"]).backward()  # noqa: E731
    step(data["text", "padded"][0])  # warm-up
    optimizer.zero_grad(set_to_none=True)
    for r in range(opts.rounds):
        for job, modes in jobs.items():
            for mode in modes:
                batches = data[job, mode][r * opts.steps:(r + 1) * opts.steps]
                cpu, wall = time.process_time(), time.perf_counter()
                for b in batches:
                    step(b)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                tokens = sum(b["num_tokens"] for b in batches)
                cpu_rates[f"{job}/{mode}"].append(tokens / cpu)
                wall_rates[f"{job}/{mode}"].append(tokens / wall)
    result = {"options": vars(opts), "rows_per_micro_batch": micro, "fill_rate": fill,
              "real_tokens_per_cpu_s": {k: statistics.median(v) for k, v in cpu_rates.items()},
              "real_tokens_per_wall_s": {k: statistics.median(v) for k, v in wall_rates.items()}}
    result["ratio_to_padded_cpu"] = {k: v / result["real_tokens_per_cpu_s"][k.split("/")[0] + "/padded"]
                                     for k, v in result["real_tokens_per_cpu_s"].items()}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "packing.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = ["| job / rows | fill rate | real tokens per CPU s | x padded | real tokens per wall s |",
             "| --- | --- | --- | --- | --- |"]
    for k in cpu_rates:
        lines.append(f"| {k} | {fill[k]:.3f} | {result['real_tokens_per_cpu_s'][k]:,.0f} | "
                     f"{result['ratio_to_padded_cpu'][k]:.2f}x | {result['real_tokens_per_wall_s'][k]:,.0f} |")
    with open(os.path.join(RESULTS, "packing.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()

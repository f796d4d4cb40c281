"""``python -m toolkit report RUN [RUN ...]``: re-draw the loss plot and the summary of finished runs.

Everything comes from what a run leaves in its ``output_dir``: ``metrics.jsonl`` (required), ``config.yaml`` and,
where the loop wrote one, ``summary.json`` (wall time, world size, strategy). One run: its summary and
``RUN/loss.png`` re-drawn. Two or more: one plot with every run's loss curves and a table with a column per run, to
compare strategies or layouts (e.g. 2 ranks x 4 against 1 process x 4 x 2 accumulation: same global batch, same
sample order, so the curves should lie on top of each other).

    python -m toolkit report outputs/tiny-gpt2-pydoc
    python -m toolkit report outputs/ddp outputs/zero3 --markdown compare.md    # the plot: outputs/compare.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from toolkit import layout
from toolkit.reporting.metrics import read_metrics
from toolkit.reporting.plots import plot_runs


class ReportError(ValueError):
    """A run folder that cannot be reported on; the message names the folder and what to do."""


def load_run(output_dir: str) -> dict:
    """metrics rows, config (or {}) and the loop's summary (or {}) of one output_dir."""
    path = layout.path(output_dir, layout.METRICS)
    if not os.path.isdir(output_dir):
        raise ReportError(f"{output_dir}: no such folder; pass the output_dir of a run")
    if not os.path.isfile(path):
        raise ReportError(f"{output_dir}: no {layout.METRICS}; is it the output_dir of a toolkit run (it holds "
                          f"config.yaml, runs/, final/)?")
    try:
        rows = read_metrics(path)
    except ValueError as e:
        raise ReportError(str(e)) from None
    config, summary = {}, {}
    cfg_path = layout.path(output_dir, layout.CONFIG)
    if os.path.isfile(cfg_path):
        import yaml

        with open(cfg_path) as f:
            config = yaml.safe_load(f) or {}
    sum_path = layout.path(output_dir, layout.SUMMARY)
    if os.path.isfile(sum_path):
        with open(sum_path) as f:
            summary = json.load(f)
    return {"output_dir": output_dir, "rows": rows, "config": config, "summary": summary}


def _training_tokens_per_s(rows: list[dict]) -> float | None:
    """Tokens over training seconds, from the per-window rates the loop logs (eval time is already excluded).

    Each logged row's rate covers the tokens since the previous logged row, so the run's rate is
    sum(tokens) / sum(tokens / rate): a plain mean of the rates would weight a short last window like a full one.
    """
    tokens = seconds = 0.0
    previous = 0
    for r in rows:
        if r.get("tokens_per_s") is None or "tokens_seen" not in r:
            continue
        window = r["tokens_seen"] - previous
        previous = r["tokens_seen"]
        if r["tokens_per_s"] > 0 and window > 0:
            tokens += window
            seconds += window / r["tokens_per_s"]
    return tokens / seconds if seconds > 0 else None


def _inferred_world(rows: list[dict], config: dict) -> int | None:
    """With packing every row holds block_size real tokens, so tokens per step = world x micro x accumulation x block
    (not with packing_strategy bfd: whole documents leave a row's end empty)."""
    if not config.get("packing") or config.get("packing_strategy") == "bfd" or not config.get("block_size"):
        return None
    steps = [r for r in rows if r.get("step") and r.get("tokens_seen")]
    if not steps:
        return None
    last = steps[-1]
    per_rank = config["per_device_train_batch_size"] * config["gradient_accumulation_steps"] * config["block_size"]
    world = last["tokens_seen"] / (last["step"] * per_rank)
    return int(round(world)) if world >= 1 and abs(world - round(world)) < 1e-9 else None


def summarize(run: dict) -> dict:
    """The numbers of one run, from its files. Missing values are None."""
    rows, config, summary = run["rows"], run["config"], run["summary"]
    train = [r for r in rows if r.get("loss") is not None]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    best = min(evals, key=lambda r: r["eval_loss"]) if evals else None
    world = summary.get("world_size")
    world_source = "summary" if world is not None else None
    if world is None:
        world = _inferred_world(rows, config)
        world_source = "inferred from tokens/step" if world is not None else None
    micro, accum = config.get("per_device_train_batch_size"), config.get("gradient_accumulation_steps")
    tokens_per_s = _training_tokens_per_s(rows)
    return {
        "output_dir": run["output_dir"],
        "world_size": world,
        "world_size_source": world_source,
        "strategy": summary.get("distributed_type"),
        "micro_batch": micro,
        "accumulation": accum,
        # Under tensor parallelism the ranks of a group share rows: the batch splits over the data-parallel degree.
        "global_batch": micro * accum * (summary.get("data_parallel_size") or world) if micro and accum and world
        else None,
        "row_unit": summary.get("row_unit", "sequences"),  # the task's (pairs for DPO, examples for a classifier)
        "steps": max((r.get("step", 0) for r in rows), default=0),
        "tokens_seen": max((r.get("tokens_seen", 0) for r in rows), default=0),
        "first_train_loss": train[0]["loss"] if train else None,
        "final_train_loss": train[-1]["loss"] if train else None,
        "first_eval_loss": evals[0]["eval_loss"] if evals else None,
        "best_eval_loss": best["eval_loss"] if best else None,
        "best_eval_step": best["step"] if best else None,
        "best_perplexity": math.exp(min(best["eval_loss"], 50.0)) if best and "perplexity" in best else None,
        "best_accuracy": max((r["accuracy"] for r in evals if r.get("accuracy") is not None), default=None),
        **_first_and_last(evals, "eval_rewards/accuracies", "reward_accuracy"),
        **_first_and_last(evals, "eval_rewards/margins", "reward_margin"),
        **_first_and_last(rows, "reward", "reward"),  # GRPO's mean reward of each logged window (its loss is ~0)
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / world if world and tokens_per_s else None,
        "steps_per_s": summary.get("steps_per_s"),
        "mfu": _mean(r.get("mfu") for r in train),
        "peak_memory_gb": max((r["peak_memory_gb"] for r in rows if r.get("peak_memory_gb") is not None), default=None),
        "peak_memory_gb_per_rank": summary.get("peak_memory_gb_per_rank") or next(
            (r["peak_memory_gb_per_rank"] for r in reversed(rows) if r.get("peak_memory_gb_per_rank")), None),
        "seconds": summary.get("seconds"),
        "final_model": _final_model(run),
    }


def _first_and_last(evals: list[dict], metric: str, name: str) -> dict:
    """``first_<name>`` and ``final_<name>``: ``metric`` (e.g. DPO's eval_rewards/accuracies, GRPO's reward) in the
    first and the last row that has it; None where none has."""
    values = [r[metric] for r in evals if r.get(metric) is not None]
    return {f"first_{name}": values[0] if values else None, f"final_{name}": values[-1] if values else None}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _final_model(run: dict) -> str | None:
    return layout.final_dir(run["output_dir"]) if layout.has_final_model(run["output_dir"]) else None


# --------------------------------------------------------------------------------------------------- formatting
ROWS = (  # (label, key, format)
    ("world size", "world_size", "d"),
    ("strategy", "strategy", "s"),
    ("micro batch x accumulation", None, None),
    ("global batch", "global_batch", "d"),
    ("optimizer steps", "steps", "d"),
    ("tokens seen", "tokens_seen", ","),
    ("train loss first -> final", None, None),
    ("eval loss first -> best", None, None),
    ("best eval perplexity", "best_perplexity", ".2f"),
    ("best eval accuracy (classifiers)", "best_accuracy", ".4f"),
    ("eval reward accuracy first -> last (DPO)", "reward_accuracy", ".4f"),
    ("eval reward margin first -> last (DPO)", "reward_margin", ".4f"),
    ("mean reward first -> last (GRPO)", "reward", ".4f"),
    ("training tokens/s", "tokens_per_s", ",.0f"),
    ("tokens/s per device", "tokens_per_s_per_device", ",.0f"),
    ("optimizer steps/s (wall)", "steps_per_s", ".3f"),
    ("MFU (mean of logged steps)", "mfu", ".1%"),
    ("peak memory, busiest rank (GB)", "peak_memory_gb", ".2f"),
    ("peak memory per rank (GB)", "peak_memory_gb_per_rank", None),
    ("wall time (s)", "seconds", ".1f"),
    ("final model", "final_model", "s"),
)


def _fmt(value, spec) -> str:
    if value is None:
        return "?"
    if spec == "s":
        return str(value)
    return format(value, spec)


def _cell(s: dict, label: str, key, spec) -> str:
    if key == "peak_memory_gb_per_rank":
        return " ".join(f"{v:.2f}" for v in s[key]) if s.get(key) else "?"
    if label.startswith("micro batch"):
        return f"{_fmt(s['micro_batch'], 'd')} x {_fmt(s['accumulation'], 'd')}"
    if label.startswith("train loss"):
        return f"{_fmt(s['first_train_loss'], '.4f')} -> {_fmt(s['final_train_loss'], '.4f')}"
    if label.startswith("eval loss"):
        best = _fmt(s["best_eval_loss"], ".4f")
        at = f" (step {s['best_eval_step']})" if s["best_eval_step"] is not None else ""
        return f"{_fmt(s['first_eval_loss'], '.4f')} -> {best}{at}"
    if key in ("reward_accuracy", "reward_margin", "reward"):
        return f"{_fmt(s['first_' + key], spec)} -> {_fmt(s['final_' + key], spec)}"
    value = _fmt(s[key], spec)
    if key == "global_batch" and s[key] is not None:
        value += f" {s['row_unit']}"
    if key == "world_size" and s["world_size_source"] == "inferred from tokens/step":
        value += " (inferred)"
    return value


def run_names(summaries: list[dict]) -> list[str]:
    """Folder names, made longer (parent/name) only where two runs share a name."""
    names = [os.path.basename(os.path.normpath(s["output_dir"])) for s in summaries]
    if len(set(names)) < len(names):
        names = [os.path.join(*os.path.normpath(os.path.abspath(s["output_dir"])).split(os.sep)[-2:])
                 for s in summaries]
    return names


def table(summaries: list[dict], markdown: bool = False) -> str:
    """One column per run; markdown=True gives a GitHub table, otherwise aligned plain text."""
    names = run_names(summaries)
    body = [[label] + [_cell(s, label, key, spec) for s in summaries] for label, key, spec in ROWS]
    header = [""] + names
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + body)


COMPARE_PLOT = "compare.png"


def compare_plot_path(output_dirs: list[str]) -> str:
    """Where several runs' plot goes unless ``--out`` says: beside the runs, in the folder that holds them all
    (``outputs/ddp outputs/zero3`` -> ``outputs/compare.png``), not wherever the command happened to be typed."""
    parents = [os.path.dirname(os.path.abspath(d)) for d in output_dirs]
    return os.path.join(os.path.commonpath(parents), COMPARE_PLOT)


def report(output_dirs: list[str], out: str | None = None, markdown_path: str | None = None,
           fmt: str = "text") -> tuple[str, str]:
    """Draw the plot and build the table; returns (image path, table text in the requested format)."""
    runs = [load_run(d) for d in output_dirs]
    summaries = [summarize(r) for r in runs]
    names = run_names(summaries)
    if out is None:
        out = layout.path(output_dirs[0], layout.LOSS_PLOT) if len(runs) == 1 else compare_plot_path(output_dirs)
    title = names[0] if len(runs) == 1 else " vs ".join(names)
    plot_runs({n: r["rows"] for n, r in zip(names, runs)}, out, title=title)
    if markdown_path:
        os.makedirs(os.path.dirname(os.path.abspath(markdown_path)), exist_ok=True)
        with open(markdown_path, "w") as f:
            f.write(table(summaries, markdown=True) + "\n\n" + f"![loss curves]({os.path.abspath(out)})\n")
    if fmt == "json":
        return out, json.dumps(summaries if len(summaries) > 1 else summaries[0], indent=2)
    return out, table(summaries, markdown=fmt == "md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit report",
        description="Re-draw the loss plot and print the summary of one run, or compare several side by side.",
    )
    parser.add_argument("output_dirs", nargs="+", metavar="OUTPUT_DIR", help="output_dir of a run (metrics.jsonl)")
    parser.add_argument("--out", "--output", dest="out", default=None,
                        help="image to write (default: OUTPUT_DIR/loss.png for one run; for several, compare.png in "
                             "the folder that holds them all)")
    parser.add_argument("--format", choices=("text", "md", "json"), default="text", help="how to print the summary")
    parser.add_argument("--markdown", default=None, metavar="FILE.md", help="also write the table as markdown here")
    args = parser.parse_args(argv)
    try:
        out, text = report(args.output_dirs, args.out, args.markdown, args.format)
    except ReportError as e:
        print(f"report error: {e}", file=sys.stderr)
        return 2
    print(text)
    print(f"plot: {out}", file=sys.stderr if args.format == "json" else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run metrics: ``output_dir/metrics.jsonl`` (one JSON object per logging step), accelerate trackers, progress bar,
the log window (loss, throughput, MFU and peak memory between two logged steps) and the run summary.

Only the main process writes. Values are global (reduced over ranks: ``LogWindow.flush`` does it) before they are
written. torch is imported where it is used, so that readers of finished runs (``toolkit report``) start fast.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from toolkit import layout

# How a run ended (summary.json's "ended"): it trained total_steps; its stream ran out before them (it still ends
# with its final evaluation and export); SIGTERM or a lost launcher (a checkpoint, no export: relaunch to continue);
# TrainingStopped, e.g. a non-finite gradient (no export; the latest checkpoint is the last good step).
ENDED_COMPLETED, ENDED_DATA_RAN_OUT = "completed", "data_ran_out"
ENDED_PREEMPTED, ENDED_STOPPED = "preempted", "stopped"


def read_metrics(output_dir_or_file: str) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (an output_dir or the file itself).

    A run killed while writing leaves its last line cut short: that line is dropped with a warning (a resume then
    rewrites the file). Any other line that is not JSON means the file was damaged otherwise, and stops the read.
    """
    path = output_dir_or_file
    if os.path.isdir(path):
        path = layout.path(path, layout.METRICS)
    with open(path) as f:
        lines = f.read().split("\n")
    # A complete file ends with a newline, so its last piece is "": a non-empty last piece was cut mid-write.
    unterminated = lines.pop()
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {lineno} is not JSON ({e.msg}); the file is damaged: delete that "
                             "line and try again") from None
    if unterminated.strip():
        try:
            rows.append(json.loads(unterminated))
        except json.JSONDecodeError:
            warnings.warn(f"{path}: the last line was cut short (a run killed while writing it); ignoring it",
                          stacklevel=2)
    return rows


def write_summary(output_dir: str, summary: dict) -> str:
    """``output_dir/summary.json``: world size, strategy and wall time are in no other file of the run."""
    path = layout.path(output_dir, layout.SUMMARY)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    return path


def best_key(metric: str) -> str:
    """The summary's key for the best value of the eval metric ``metric``: ``best_eval_perplexity``,
    ``best_eval_accuracy``; an eval metric already named ``eval_*`` (DPO's ``eval_loss``) is not prefixed twice."""
    return "best_eval_" + metric.removeprefix("eval_")


def format_run_summary(summary: dict) -> str:
    """The loop's end-of-run summary dict (``toolkit.training.loop.train``'s return value) as a few readable lines."""
    best = next(((key[len("best_eval_"):], value) for key, value in summary.items() if key.startswith("best_eval_")),
                ("perplexity", None))
    lines = [
        "run summary",
        f"  {summary['steps']} optimizer steps, {summary['tokens_seen']:,} tokens in {summary['seconds']:.1f} s "
        f"({summary['tokens_per_s']:,.0f} tokens/s, wall clock incl. evaluation and export)",
        f"  {summary.get('tokens_per_s_per_device', 0):,.0f} tokens/s per device, "
        f"{summary.get('steps_per_s', 0):.3f} optimizer steps/s, MFU "
        + (f"{100 * summary['mfu']:.1f}%" if summary.get("mfu") is not None else "n/a (peak FLOP/s unknown: "
                                                                                  "set peak_flops)")
        + f", peak memory per rank {summary.get('peak_memory_gb_per_rank', [])} GB",
        f"  world size {summary.get('world_size', '?')} ({summary.get('distributed_type', '?')}"
        + (f"; {summary['parallelism']}" if summary.get("parallelism") else "") + "), "
        f"{summary.get('train_rows', '?')} training {summary.get('row_unit', 'rows')}, fill rate "
        + (f"{summary['fill_rate']:.3f}" if summary.get("fill_rate") is not None else "n/a"),
        f"  best eval {best[0]}: {best[1]:.4f}" if best[1] is not None else f"  best eval {best[0]}: no evaluation",
        *([f"  last eval: rewards/accuracies {summary['eval_rewards/accuracies']:.4f}, rewards/margins "
           f"{summary['eval_rewards/margins']:.4f}"] if summary.get("eval_rewards/accuracies") is not None else []),
        *_ended_line(summary),
        f"  model: {summary['final_model']}" if summary.get("final_model") else (
            "  model: not exported (preempted: relaunch with resume_from_checkpoint: latest)"
            if summary.get("preempted") else _stopped_model_line(summary) if summary.get("ended") == ENDED_STOPPED
            else "  model: not saved (save_final_model false)"),
        *[f"  warning: {w}" for w in summary.get("warnings") or []],
    ]
    return "\n".join(lines)


def _stopped_model_line(summary: dict) -> str:
    """A stopped run's model line: which checkpoint a relaunch would continue from, if the run (or the run it resumed)
    wrote any (``latest_checkpoint``); a run stopped before its first checkpoint has nothing to continue from."""
    latest = summary.get("latest_checkpoint")
    if latest is None:
        return "  model: not exported (training stopped before any checkpoint was written: a relaunch starts over)"
    return f"  model: not exported (training stopped; the latest checkpoint, {latest}, holds step {_step_of(latest)})"


def _step_of(checkpoint: str) -> str:
    """The step a checkpoint folder's name holds (``step-12`` -> 12)."""
    return os.path.basename(os.path.normpath(checkpoint)).removeprefix("step-")


def _ended_line(summary: dict) -> list[str]:
    """Why the run ended, when it ended before its steps were done (summary.json's ``ended``)."""
    ended, at = summary.get("ended"), f"at step {summary['steps']} of {summary.get('total_steps')}"
    return {ENDED_DATA_RAN_OUT: [f"  ended {at}: the training data ran out"],
            ENDED_PREEMPTED: [f"  ended {at}: preempted"],
            ENDED_STOPPED: [f"  ended {at}: training stopped: {summary.get('stop_reason')}"]}.get(ended, [])


# The eval metrics the progress bar prints, of any task (DPO's: TRL's reward accuracy and margin, named as TRL names
# them in evaluation).
EVAL_SHOWN = ("eval_loss", "perplexity", "accuracy", "macro_f1", "eval_rewards/accuracies", "eval_rewards/margins")


class MetricsLogger:
    def __init__(self, accelerator, output_dir: str, total_steps: int, start_step: int = 0, resume: bool = False,
                 loss_unit: str | None = None):
        self.accelerator = accelerator
        self.loss_unit = loss_unit  # the task's (nats/token, nats/example, per pair): in each row with a loss
        self.path = layout.path(output_dir, layout.METRICS)
        self.main = accelerator.is_main_process
        if self.main:
            os.makedirs(output_dir, exist_ok=True)
            if resume and os.path.isfile(self.path):
                # Keep what happened up to the checkpoint; later lines belong to the interrupted attempt.
                kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
                self._rewrite(kept)
            else:
                self._rewrite([])
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not self.main, desc="train", dynamic_ncols=True)
        # While the bar is drawn, the libraries' log lines (accelerate's "[RANK 0] ...", transformers') go through
        # tqdm.write: a line of their own, not glued to the end of the bar.
        self._logs_above_bar = logging_redirect_tqdm(loggers=[logging.getLogger(), logging.getLogger("transformers")])
        if self.main:
            self._logs_above_bar.__enter__()

    def _rewrite(self, rows):
        with open(self.path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def log(self, row: dict) -> None:
        row = {k: (float(v) if isinstance(v, float) else v) for k, v in row.items()}
        if self.loss_unit and ("loss" in row or "eval_loss" in row):
            # in the file itself, so that its readers (loss.png, toolkit report) label a run's loss without its task
            row["loss_unit"] = self.loss_unit
        if self.main:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
            if self.accelerator.trackers:
                self.accelerator.log(scalars, step=row["step"])
            if "loss" in row:
                post = {"loss": f"{row['loss']:.4f}", "lr": f"{row.get('lr', 0):.2e}",
                        "tok_s": f"{row.get('tokens_per_s', 0):.0f}",
                        "tok_s_dev": f"{row.get('tokens_per_s_per_device', 0):.0f}",
                        "steps_s": f"{row.get('steps_per_s', 0):.3g}",
                        "mem": f"{row.get('peak_memory_gb', 0):.2f}GB"}
                if row.get("mfu") is not None:
                    post["mfu"] = f"{100 * row['mfu']:.1f}%"
                self.bar.set_postfix(**post)
            if "eval_loss" in row:
                shown = [f"{k} {row[k]:.4f}" for k in EVAL_SHOWN if k in row]
                self.bar.write(f"step {row['step']}: " + " ".join(shown))

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
        if self.main and not self.bar.disable:
            self._logs_above_bar.__exit__(None, None, None)
        self.bar.close()


class Throughput:
    """Tokens per second over a logging window (wall time on the main process)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int):
        self.tokens += tokens

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def rate(self) -> float:
        dt = self.seconds()
        return self.tokens / dt if dt > 0 else 0.0


class LogWindow:
    """Training loss, throughput, MFU and peak memory since the last logged step. The loss is reduced over ranks only
    when logged (``toolkit.reporting.accounting`` says how MFU is counted)."""

    def __init__(self, accelerator, flops_per_token: float, peak_flops: float | None, replicas: int = 1):
        import torch

        self.accelerator = accelerator
        self.replicas = replicas  # ranks holding the same rows (tensor parallel): their losses are the same rows
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        self.targets = 0
        self.steps = 0
        self.slots = 0
        self.run_tokens = self.run_slots = 0  # this attempt's, for the summary's fill rate
        self.throughput = Throughput()

    def add(self, result) -> None:
        """Count a ``toolkit.training.state.StepResult``."""
        self.loss += result.loss_sum
        self.targets += result.targets
        self.steps += 1
        self.slots += result.slots
        self.run_tokens += result.tokens
        self.run_slots += result.slots
        self.throughput.add(result.tokens)

    def run_fill_rate(self) -> float | None:
        """Real tokens / positions computed over every step counted so far (this attempt)."""
        return self.run_tokens / self.run_slots if self.run_slots else None

    def exclude(self, seconds: float) -> None:
        self.throughput.t0 += seconds  # tokens/s counts training time only (not evaluation)

    def flush(self) -> dict:
        """Collective: the window's mean token loss, throughput, MFU and the peak memory of every rank."""
        from toolkit.reporting.accounting import mfu

        total = float(self.accelerator.reduce(self.loss.clone(), reduction="sum")) / self.replicas
        memory = peak_memory_per_rank(self.accelerator)
        tokens_per_s, world = self.throughput.rate(), self.accelerator.num_processes
        out = {"loss": total / max(self.targets, 1), "tokens_per_s": tokens_per_s,
               "tokens_per_s_per_device": tokens_per_s / world,
               "steps_per_s": self.steps / max(self.throughput.seconds(), 1e-9),
               "peak_memory_gb": float(memory.max()),
               "peak_memory_gb_per_rank": [round(float(m), 3) for m in memory.tolist()]}
        if self.peak_flops:
            out["mfu"] = mfu(self.flops_per_token, tokens_per_s, world, self.peak_flops)
        if self.slots:  # real tokens / positions computed (padding and packing's empty ends are the rest)
            out["fill_rate"] = self.throughput.tokens / self.slots
        self.loss.zero_()
        self.targets = self.steps = self.slots = 0
        self.throughput.reset()
        return out


def peak_memory_per_rank(accelerator):
    """Collective: every rank's peak memory so far, in GB (``toolkit.reporting.accounting.peak_memory_gb``), as a tensor."""
    import torch

    from toolkit.reporting.accounting import peak_memory_gb

    return accelerator.gather(torch.tensor([peak_memory_gb(accelerator.device)], device=accelerator.device))


def parallel_degrees(accelerator) -> str:
    """How the ranks split beyond plain data parallelism: 'dp_replicate 2 x dp_shard 2' (HSDP) or 'tp 2' from
    accelerate's ParallelismConfig, 'pp 2 x dp 2' for a pipeline's stages (``pipeline_parallel_size``, which no
    accelerate config holds) and its replicas; '' when every rank is a data-parallel one."""
    config = getattr(accelerator, "parallelism_config", None)
    parts = [] if config is None or config.total_size <= 1 else [
        f"{name} {getattr(config, name + '_size')}" for name in ("dp_replicate", "dp_shard", "tp", "cp")
        if getattr(config, name + "_size", 1) > 1]
    stages = getattr(accelerator, "pipeline_parallel_size", 1)
    if stages > 1:
        replicas = accelerator.num_processes // stages
        parts += [f"pp {stages}"] + ([f"dp {replicas}"] if replicas > 1 else [])
    return " x ".join(parts)


def run_summary(accelerator, state, *, epochs: float, seconds: float, tokens: int, steps: int, flops_per_token: float,
                peak_flops: float | None, best: tuple[str, float | None], final_model: str | None, ended: str,
                total_steps: int, data_parallel_size: int, stop_reason: str | None = None,
                train_rows: int | None = None, fill_rate: float | None = None) -> dict:
    """Collective (peak memory is gathered): the end-of-run summary (``summary.json``). ``tokens`` and ``steps``: what
    this attempt trained (a resumed run's rates count this attempt only); ``best``: (metric name, best value);
    ``final_model``: the export this run wrote, or None; ``ended``: one of the ENDED_* above, after ``state.step``
    of ``total_steps``; ``stop_reason``: a stopped run's message; ``train_rows``: the training split's rows (after
    packing); ``fill_rate``: real tokens / positions computed."""
    from toolkit.reporting.accounting import mfu

    world = accelerator.num_processes
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    return {
        "steps": state.step,
        "epochs": epochs,
        "tokens_seen": state.tokens_seen,
        "seconds": seconds,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / world,
        "steps_per_s": steps / seconds if seconds > 0 else 0.0,
        "mfu": mfu(flops_per_token, tokens_per_s, world, peak_flops),
        "peak_memory_gb_per_rank": [round(float(m), 3) for m in peak_memory_per_rank(accelerator)],
        best_key(best[0]): best[1],
        "final_model": final_model,
        "ended": ended,
        "total_steps": total_steps,  # the steps the run was to train (max_steps, or the epochs' steps)
        "stop_reason": stop_reason,
        "preempted": ended == ENDED_PREEMPTED,
        "world_size": world,
        "data_parallel_size": data_parallel_size,  # ranks taking other rows: world / (tp_size or pp stages)
        "distributed_type": accelerator.distributed_type.value,
        "parallelism": parallel_degrees(accelerator) or None,  # e.g. "pp 2 x dp 2", "tp 2"; None: data parallel
        "train_rows": train_rows,
        "fill_rate": fill_rate,
    }

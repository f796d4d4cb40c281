"""Run metrics: ``output_dir/metrics.jsonl`` (one JSON object per logging step), accelerate trackers, progress bar.

Only the main process writes. Values are global (already reduced over ranks) before they get here.
"""

from __future__ import annotations

import json
import math
import os
import time

from tqdm.auto import tqdm

METRICS_FILE = "metrics.jsonl"


def read_metrics(output_dir_or_file: str) -> list[dict]:
    path = output_dir_or_file
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                # Typically the last line of a run killed mid-write.
                raise ValueError(f"{path}: line {lineno} is not JSON ({e.msg}); the file is damaged: delete that "
                                 "line and try again") from None
    return rows


class MetricsLogger:
    def __init__(self, accelerator, output_dir: str, total_steps: int, start_step: int = 0, resume: bool = False):
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, METRICS_FILE)
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

    def _rewrite(self, rows):
        with open(self.path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def log(self, row: dict) -> None:
        row = {k: (float(v) if isinstance(v, float) else v) for k, v in row.items()}
        if self.main:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
            if self.accelerator.trackers:
                self.accelerator.log(scalars, step=row["step"])
            post = {k: row[k] for k in ("loss", "lr", "tokens_per_s") if k in row}
            if "loss" in post:
                self.bar.set_postfix(loss=f"{post['loss']:.4f}", lr=f"{post.get('lr', 0):.2e}",
                                     tok_s=f"{post.get('tokens_per_s', 0):.0f}")
            if "eval_loss" in row:
                self.bar.write(f"step {row['step']}: eval_loss {row['eval_loss']:.4f} perplexity {row['perplexity']:.2f}")

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
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

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

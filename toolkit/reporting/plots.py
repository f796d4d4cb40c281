"""``output_dir/loss.png``: train and eval loss (GRPO: the mean reward) against tokens seen, learning rate on a second
axis.

Drawn from ``metrics.jsonl`` alone, so a finished (or interrupted) run can be re-drawn later by ``toolkit report``.

The figure is a bare ``matplotlib.figure.Figure`` on an Agg canvas, never pyplot: ``matplotlib.use("Agg")`` (or any
pyplot figure) inside a training run would switch a notebook kernel's backend, and every later plot in the user's
notebook would stop showing inline. A Figure that pyplot does not know about also cannot leak between runs.
"""

from __future__ import annotations

import os

from toolkit import layout
from toolkit.reporting.metrics import read_metrics


def _points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["tokens_seen"], r[key]) for r in rows if r.get(key) is not None and "tokens_seen" in r]


def loss_label(runs: dict[str, list[dict]]) -> str:
    """The loss axis' label: the unit the runs' rows name (``loss_unit``, the task's: nats/token for a language model,
    nats/example for a classifier, per pair for DPO), or none where they name none or several."""
    units = {r["loss_unit"] for rows in runs.values() for r in rows if r.get("loss_unit")}
    return f"loss ({units.pop()})" if len(units) == 1 else "loss"


def train_key(rows: list[dict]) -> str:
    """The training curve: the mean reward where the rows log one (GRPO: a reward rises, its loss hovers near 0 by
    construction), else the loss."""
    return "reward" if any("reward" in r for r in rows) else "loss"


def plot_runs(runs: dict[str, list[dict]], path: str, title: str | None = None) -> str:
    """One figure with every run's curves (one run: train/eval loss + lr; several: loss curves side by side)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    single = len(runs) == 1
    lr_ax = ax.twinx() if single else None
    for i, (name, rows) in enumerate(runs.items()):
        # One run: train and eval in two colours. Several: one colour per run, eval dashed with markers.
        train_color, eval_color = ("C0", "C1") if single else (f"C{i}", f"C{i}")
        label = "" if single else f"{name}: "
        # Runs that should agree (same job, another strategy) lie exactly on top of each other: draw earlier runs
        # wider and translucent so every curve stays visible.
        width = 1.5 if single else max(4.0 - 1.25 * i, 1.2)
        alpha = 1.0 if single else (0.45 if i < len(runs) - 1 else 1.0)
        key = train_key(rows)
        train, evals = _points(rows, key), _points(rows, "eval_loss")
        if train:
            ax.plot(*zip(*train), color=train_color, linewidth=width, alpha=alpha, label=f"{label}train {key}")
        if evals:
            ax.plot(*zip(*evals), color=eval_color, linewidth=width, alpha=alpha, linestyle="--", marker="o",
                    markersize=3 + width, label=f"{label}eval loss")
        if lr_ax is not None:
            lrs = _points(rows, "lr")
            if lrs:
                lr_ax.plot(*zip(*lrs), color="gray", alpha=0.6, linewidth=1, label="learning rate")
                lr_ax.set_ylabel("learning rate")
                lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.set_xlabel("tokens seen (all ranks)")
    rewards = all(train_key(rows) == "reward" for rows in runs.values())
    ax.set_ylabel("mean reward" if rewards else loss_label(runs))
    ax.set_title(title or ", ".join(runs))
    handles, labels = ax.get_legend_handles_labels()
    if lr_ax is not None:
        h2, l2 = lr_ax.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="upper right", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no logged loss yet", transform=ax.transAxes, ha="center", va="center")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_run(output_dir: str, path: str | None = None) -> str:
    """Draw ``output_dir/loss.png`` (or ``path``) from ``output_dir/metrics.jsonl``; returns the file written."""
    return plot_runs({os.path.basename(os.path.normpath(output_dir)): read_metrics(output_dir)},
                     path or layout.path(output_dir, layout.LOSS_PLOT))

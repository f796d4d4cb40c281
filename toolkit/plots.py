"""``output_dir/loss.png``: train and eval loss against tokens seen, learning rate on a second axis.

Drawn from ``metrics.jsonl`` alone, so a finished (or interrupted) run can be re-drawn later by ``toolkit report``.
"""

from __future__ import annotations

import os

from toolkit.metrics import read_metrics


def plot_runs(runs: dict[str, list[dict]], path: str, title: str | None = None) -> str:
    """One figure with every run's curves (one run: train/eval loss + lr; several: loss curves side by side)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    lr_ax = ax.twinx() if len(runs) == 1 else None
    for i, (name, rows) in enumerate(runs.items()):
        color = f"C{i}"
        train = [(r["tokens_seen"], r["loss"]) for r in rows if r.get("loss") is not None]
        evals = [(r["tokens_seen"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
        label = "" if len(runs) == 1 else f"{name}: "
        if train:
            ax.plot(*zip(*train), color=color, label=f"{label}train loss")
        if evals:
            ax.plot(*zip(*evals), color=color, linestyle="--", marker="o", label=f"{label}eval loss")
        if lr_ax is not None:
            lrs = [(r["tokens_seen"], r["lr"]) for r in rows if r.get("lr") is not None]
            if lrs:
                lr_ax.plot(*zip(*lrs), color="gray", alpha=0.6, linewidth=1, label="learning rate")
                lr_ax.set_ylabel("learning rate")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or ", ".join(runs))
    handles, labels = ax.get_legend_handles_labels()
    if lr_ax is not None:
        h2, l2 = lr_ax.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(output_dir: str) -> str:
    return plot_runs({os.path.basename(os.path.normpath(output_dir)): read_metrics(output_dir)},
                     os.path.join(output_dir, "loss.png"))

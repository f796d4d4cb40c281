"""``python -m toolkit report`` on the quickstart notebook's two real runs (1 process with accumulation, 2 gloo ranks):
the arithmetic on what the loop actually writes, through the command line. Synthetic metrics files are checked in
process in tests/unit/test_report.py."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, subprocess_env

from toolkit.reporting.report import load_run, summarize


@pytest.mark.slow
def test_report_on_real_runs(quickstart, tmp_path):
    """The notebook's 1-process and 2-rank runs, through the command line, as a user would compare strategies."""
    kernel, launch = quickstart["kernel_run"], quickstart["launch_run"]
    out = tmp_path / "compare.png"
    proc = subprocess.run([sys.executable, "-m", "toolkit", "report", kernel, launch, "--out", str(out), "--format",
                           "md"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "|  | kernel-1x4x2 | launcher-2x4x1 |"
    # "(inferred)" from tokens per step until the loop writes summary.json, then read from it
    world = next(line for line in lines if line.startswith("| world size |"))
    assert world.replace(" (inferred)", "") == "| world size | 1 | 2 |", world
    assert "| micro batch x accumulation | 4 x 2 | 4 x 1 |" in lines
    assert "| global batch | 8 sequences | 8 sequences |" in lines
    assert "| optimizer steps | 12 | 12 |" in lines and "| tokens seen | 3,072 | 3,072 |" in lines
    assert os.path.getsize(out) > 10_000
    s = summarize(load_run(launch))
    r = quickstart["result"]
    assert s["final_train_loss"] == r["launch_loss"][-1] and s["best_eval_loss"] == min(r["launch_eval_loss"])
    assert s["final_model"] == os.path.join(launch, "final") and s["tokens_per_s"] > 0
    # the accounting every run carries: per device rates, steps/s, peak memory of every rank (no MFU on a CPU)
    assert s["tokens_per_s_per_device"] == pytest.approx(s["tokens_per_s"] / 2) and s["steps_per_s"] > 0
    assert 0.05 < s["peak_memory_gb"] < 20 and s["mfu"] is None
    summary = json.load(open(os.path.join(launch, "summary.json")))
    assert len(summary["peak_memory_gb_per_rank"]) == 2 and summary["mfu"] is None
    assert summary["data_parallel_size"] == 2
    assert s["peak_memory_gb_per_rank"] == summary["peak_memory_gb_per_rank"]
    assert "| peak memory, busiest rank (GB) |" in proc.stdout
    per_rank = next(line for line in lines if line.startswith("| peak memory per rank (GB) |"))
    assert len(per_rank.split("|")[3].split()) == 2  # the 2-rank run: one figure per rank
    rows = [json.loads(line) for line in open(os.path.join(launch, "metrics.jsonl"))]
    logged = [r for r in rows if "loss" in r]
    assert all(len(r["peak_memory_gb_per_rank"]) == 2 and max(r["peak_memory_gb_per_rank"]) == pytest.approx(
        r["peak_memory_gb"], abs=1e-3) for r in logged)

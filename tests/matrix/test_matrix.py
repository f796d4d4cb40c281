"""The capability matrix (issue 47): a pairwise covering array over dimensions.py's dimensions, each cell's
expectation decided by the pre-launch check (``toolkit.cli.train.check``, what ``toolkit train`` runs before it
launches), and each cell held to its promises:

- refused: ``toolkit train`` (its ``main``, in this process) exits 2 with one line, and writes nothing;
- accepted: the cell's run (real ranks, in the shared launch of its launch config and world size) keeps
  1. its final weights equal one process on the same global batch (SGD; FP32_TOLERANCE, BF16_TOLERANCE below);
  2. it ends: exit 0 within its watchdog, ``final/`` loadable with ``from_pretrained`` (the merged export too, with
     the one-process export's logits), ``summary.json`` true to what is on disk (steps, how it ended, world);
  3. interrupted (SIGTERM to rank 0), it resumes to the uninterrupted weights.

``python -m pytest tests/matrix -m ""`` runs every cell (the default deselects ``matrix_full``: the suite runs the
SUITE cells only) and prints the table: cell, expectation, result, figure. ``TOOLKIT_MATRIX_CELLS=name,name`` runs
the cells named (in the array or not) without making the array. docs/testing.md#the-capability-matrix.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import time

import covering
import dimensions as D
import pytest
from helpers import CONFIGS, ROOT, CopyCheckpoint, Runs, launch_runs, tree_hash

SEED = 0
WATCHDOG_S = 180  # a run of a cell still going after this ends its launch (a tiny run takes 1-20 s here, 60 s on a loaded machine)
# Cells the default suite runs (by name: any cell, in the array or not; stable while the dimensions are); the rest
# are marked matrix_full. bf16 under DDP, FSDP2, ZeRO-2 and ZeRO-3 (test_precision.py's bf16 test was these, in five
# launches of their own: here they ride in the shared ones), cells of features no other test combines, and four
# refusals.
SUITE: tuple[str, ...] = (
    "lm-ddp-none-padded-gpt2-even-bf16-steps",
    "lm-fsdp2-none-padded-gpt2-even-bf16-steps",
    "lm-zero2-none-padded-gpt2-even-bf16-steps",
    "lm-zero3-none-padded-gpt2-even-bf16-steps",
    "lm-tp-none-mixture-llama-even-fp32-sigterm",
    "classify-hsdp-none-padded-gpt2-one-fp32-steps",
    "sft-hsdp-none-bfd-qwen2-even-fp32-data_end",
    "lm-tp-none-padded-gpt2-even-fp32-steps",
    "lm-one-none-padded-gpt2-even-fp32-merge",
    "grpo-one-none-stream-gpt2-even-fp32-steps",
    "dpo-pp-none-padded-gpt2-even-fp32-steps",
    # refusals of the later values: compiled blocks under ZeRO-2; optim muon under ZeRO-3 and for a classifier (its
    # head would get Muon). Their accepted cells (aot_eager under FSDP2, async_save through a SIGTERM, muon under
    # FSDP2 through a SIGTERM) run in the full array only: test_strategies' compile tests, test_reliability's
    # async_save test and test_muon launch the same layouts and check more (bitwise against eager, on_save, the
    # Newton-Schulz path each matrix took), so a suite cell would repeat their launches.
    "lm-zero2-none-padded-gpt2-even-fp32-steps-aot_eager",
    "lm-zero3-none-padded-gpt2-even-fp32-steps-muon",
    "classify-ddp-none-padded-gpt2-even-fp32-steps-muon",
)

# max |w - w_one_process| over every tensor of final/ (the adapters for LoRA), and the measurement behind each (AMD
# EPYC, gloo ranks, SGD, 3-6 steps). fp32: the ranks' summed gradients differ from one process's by fp32 rounding
# only: <= 1.6e-7 measured in every passing fp32 cell of the matrix's first full run (docs/testing.md), under every
# layout and adapter (QLoRA's base dequantized alike on every rank; test_qlora.py: 1e-6 too).
FP32_TOLERANCE = 1e-6
# bf16 autocast (DDP, FSDP: fp32 parameters) or DeepSpeed's bf16 mode (bf16 weights, fp32 master partitions), 2 ranks
# against one bf16 process. Measured (what was test_precision.py's bf16 test, lm x GPT-2, 3 steps): DDP 6.5e-4, FSDP2
# 1.2e-3, ZeRO-2 and ZeRO-3 3.9e-3 (bf16 weights round every update); in the matrix's first run <= 2.8e-4 under
# FSDP1, HSDP, pipelines; the ring (cp) 7.9e-4 (lm x GPT-2). About 3x the measured value, by layout.
BF16_TOLERANCE = {"ddp": 2e-3, "fsdp2": 4e-3, "zero2": 1.2e-2, "zero3": 1.2e-2, "fsdp1": 4e-3, "hsdp": 4e-3,
                  "tp": 4e-3, "pp": 4e-3, "pp_fsdp2": 4e-3, "cp": 2e-3}


def tolerance(cell: D.Cell) -> float:
    if cell["precision"] == "bf16":
        return MUON_BF16_TOLERANCE if cell["optim"] == "muon" else BF16_TOLERANCE[cell["layout"]]
    return FP32_TOLERANCE


# optim muon's AdamW group (eps 1e-6): AdamW turns fp32 noise in tiny gradients into visible steps
# (docs/pitfalls.md#adamw-eps); measured 1.1e-5 (dpo x DDP x GPT-2), 3.1e-6 (lm x TP x Llama), 1.4e-6 (lm x FSDP2):
# about 3x the largest, still 20x below a missing clip's 5e-4
MUON_ADAMW_TOLERANCE = 3e-5
# optim muon under bf16 autocast: the gradients' bf16 rounding differs by split, and the Muon group ends as far apart
# as with bf16 iterations (docs/pitfalls.md#muon-bf16; SGD's cells stay within BF16_TOLERANCE): measured 4.7e-3
# (sft x HSDP x Qwen2, 3 steps, fp32 iterations); about 3x
MUON_BF16_TOLERANCE = 1.5e-2
RESUME_TOLERANCE = {"fp32": 1e-6, "bf16": 1e-6}  # resumed against uninterrupted, the same layout: exact
# the merged export's logits against one process's merged export: fp32 measured <= 1.2e-7 (lm x FSDP2 x LoRA);
# bf16 measured 1.6e-4 (lm x HSDP x LoRA, the adapters 1e-3 apart)
MERGED_LOGITS_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}

MATRIX: dict = {}  # filled at collection: the files, the array, the selected cells' indices
RESULTS: dict[int, dict] = {}  # cell index -> its table row


def _refusal(files: dict):
    never = os.path.join(str(files["root"]), "never-written")

    def refused(values: dict) -> str | None:
        message = _refusal_of(D.run_of(D.Cell.of(values), files), never)
        assert not os.path.exists(never), "the check wrote its output_dir"
        return message

    return refused


def named_cells() -> tuple[str, ...]:
    """TOOLKIT_MATRIX_CELLS: cells by name, comma-separated (any cell, in the array or not), built and run instead of
    SUITE or the array (``TOOLKIT_MATRIX_CELLS=lm-zero3-lora-bfd-qwen2-one-bf16-resume_new_rank python -m pytest
    tests/matrix``): one cell of the full array without generating it."""
    return tuple(name.strip() for name in os.environ.get("TOOLKIT_MATRIX_CELLS", "").split(",") if name.strip())


def full_matrix(config) -> bool:
    """The whole array (``-m ""``, ``-m matrix_full`` or TOOLKIT_MATRIX=full), or else the SUITE cells alone: the
    array's generation (about 400 checks) is paid only when the whole matrix runs."""
    return os.environ.get("TOOLKIT_MATRIX") == "full" or (config.option.markexpr or "").strip() in ("", "matrix_full")


def build(config) -> dict:
    """The matrix's files and cells, once per session (at collection: the cells parametrize the test): the covering
    array, or the SUITE cells alone (each checked)."""
    if MATRIX:
        return MATRIX
    from toolkit.models.offline import bpe_from_file

    named = named_cells() or SUITE
    started, full = time.time(), full_matrix(config) and not named_cells()
    root = config._tmp_path_factory.mktemp("matrix")
    tasks = D.DIMENSIONS["task"] if full else sorted({D.Cell.from_name(name)["task"] for name in named})
    files = D.write_files(root, bpe_from_file(os.path.join(ROOT, "tests", "data", "bpe-2048", "tokenizer.json")),
                          tasks)
    files["root"] = root
    made = time.time()
    refused = _refusal(files)
    if full:
        array = covering.covering_array(D.DIMENSIONS, refused, D.SEAMS, seed=SEED)
        cells = [D.Cell.of(values, seam) for values, _, seam in array.cells]
        refusals, checks = [m for _, m, _ in array.cells], array.checks
    else:
        array, cells = None, [D.Cell.from_name(name) for name in named]
        refusals, checks = [refused(dict(c.values)) for c in cells], len(cells)
    MATRIX.update(files=files, array=array, cells=cells, refusals=refusals, selected=set(), checks=checks,
                  seconds={"files": made - started, "array": time.time() - made})
    return MATRIX


def pytest_generate_tests(metafunc):
    if "cell_index" not in metafunc.fixturenames:
        return
    matrix = build(metafunc.config)
    params = []
    for i, cell in enumerate(matrix["cells"]):
        marks = [] if matrix["refusals"][i] is not None else [pytest.mark.slow]
        if cell.name not in (named_cells() or SUITE):
            marks.append(pytest.mark.matrix_full)
        params.append(pytest.param(i, marks=marks, id=f"{i:02d}-{cell.name}"))
    metafunc.parametrize("cell_index", params)


# ------------------------------------------------------------------ the runs, planned into the session's launches
def _reference_name(ref: D.Run) -> str:
    import hashlib

    return "ref-" + hashlib.sha256(json.dumps([ref.recipe, sorted(ref.fields.items()), ref.env], default=str)
                                   .encode()).hexdigest()[:10]


def _plan(r: Runs, name: str, run: D.Run, extra: dict | None = None, copy_from=None, **options) -> None:
    options = {"watchdog_s": WATCHDOG_S, "keep_going": True, **({"env": run.env} if run.env else {}), **options}
    r.plan(name, run.config, run.world, run.micro, run.accum, {**run.fields, **(extra or {})}, copy_from=copy_from,
           recipe=run.recipe, probe=False, options=options)


def plan_runs(pool, tmp_path_factory):
    """The selected accepted cells' runs (each cell's run; its one-process reference, shared between cells with
    the same one; an interrupted cell's SIGTERMed run and its relaunch), into the session's shared launches. The
    seam cells go last in their launch, so that a launch a hang ends loses the fewest cells."""
    r = Runs(tmp_path_factory.mktemp("matrix-runs"), None, {}, {}, pool=pool)
    cells = MATRIX.get("cells", [])
    order = sorted(MATRIX.get("selected", ()), key=lambda i: (cells[i].seam is not None, i))
    planned_refs = set()
    for i in order:
        if MATRIX["refusals"][i] is not None:
            continue
        cell, run = cells[i], D.run_of(cells[i], MATRIX["files"])
        refs = [D.reference_of(run)] if cell["layout"] != "one" else []
        if run.mixed_precision:  # and its fp32 twin: bf16 must have changed the result (autocast ran)
            refs.append(D.reference_of(run, precision=None))
        for ref in refs:
            name = _reference_name(ref)
            if name not in planned_refs:
                planned_refs.add(name)
                _plan(r, name, ref)
        _plan(r, f"c{i:02d}", run)
        if cell["ending"] in ("sigterm", "resume_new_rank"):
            _plan(r, f"c{i:02d}-interrupted", run, sigterm_at=D.SIGTERM_AT)
            relaunch = {"resume_from_checkpoint": "latest", **(D.NEW_RANK if cell["ending"] == "resume_new_rank"
                                                               else {})}
            _plan(r, f"c{i:02d}-resumed", run, relaunch, copy_from=(f"c{i:02d}-interrupted", D.SIGTERM_AT + 1))
    return {"matrix": r}


@pytest.fixture(scope="module")
def matrix_runs(run_pool) -> Runs:
    return run_pool.modules[(__name__, "matrix")]


def _get(runs: Runs, name: str) -> str:
    """A planned run's output_dir, also where a later run failed its launch (what the run left says how it ended).
    A run its launch never reached (a run before it hung and the watchdog ended the launch) is launched again, with
    every other unreached run of that launch config and world size, in one launch: a hang fails its own cell, not
    the cells after it."""
    try:
        return runs.get_planned(name)
    except AssertionError:
        out = str(runs.tmp / name)
    pool = runs.pool
    if not _started(out):
        _relaunch(pool, out)
    if not _started(out):
        return runs.get_planned(name)  # its launch's error
    pool.failed.pop(out, None)  # what it left says how it ended (summary, error, watchdog), whatever came after it
    pool.done[out] = out
    return out


def _relaunch(pool, out: str) -> None:
    """``out``'s run and every other run of its launch config and world size that its launch never reached, in one
    launch."""
    kind = pool.specs[out]["kind"]
    batch = [o for o, s in pool.specs.items() if s["kind"] == kind and o in pool.failed and not _started(o)]
    specs = []
    for o in batch:
        s = pool.specs[o]
        spec = {"out": o, "argv": s["argv"], "recipe": s["recipe"], "probe": s["probe"], **s["options"]}
        if s["copy_from"]:
            source, step = s["copy_from"]
            if source in batch:
                spec["copy_from"] = [source, step, o]
            elif source in pool.done and os.path.isdir(os.path.join(pool.done[source], "checkpoints", f"step-{step}")):
                CopyCheckpoint(pool.done[source], step)(o)
            elif source not in pool.done:
                continue  # its source's launch failed: this run fails with it
        specs.append(spec)
        del pool.failed[o]
    if not specs:
        return
    try:
        launch_runs(os.path.dirname(out), specs, num_processes=kind[1], config=kind[0])
    except AssertionError as e:
        for spec in specs:
            pool.failed[spec["out"]] = str(e)[-20000:]
    else:
        pool.done.update({spec["out"]: spec["out"] for spec in specs})


def _started(out: str) -> bool:
    """The run began (its config written) or was seeded with a checkpoint by its launch."""
    return any(glob.glob(os.path.join(out, name)) for name in ("config.yaml", "watchdog.txt", "error_rank*.txt"))


@pytest.fixture(scope="module", autouse=True)
def _table():
    """The table of the cells that ran in this session, written beside the runs (matrix-table.md) at the end of the
    module; tests/matrix/conftest.py prints it in the session's summary."""
    yield
    if RESULTS:
        with open(os.path.join(str(MATRIX["files"]["root"]), "matrix-table.md"), "w") as f:
            f.write("\n".join(table(RESULTS, MATRIX)) + "\n")


def table(results: dict, matrix: dict) -> list[str]:
    ran = [r for r in results.values() if r["expect"] == "run"]
    lines = ["| # | cell | seam | expectation | result | figure | cost (s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for i in sorted(results):
        row = results[i]
        lines.append(f"| {i:02d} | {row['cell']} | {row['seam'] or ''} | {row['expect']} | {row['result']} | "
                     f"{row['figure']} | {row['cost']:.1f} |")
    seconds = matrix["seconds"]
    lines.append(f"{len(results)} cells ({len(ran)} run, {len(results) - len(ran)} refused), "
                 f"{sum(r['result'] == 'pass' for r in results.values())} pass; cells decided in {seconds['array']:.1f} s "
                 f"({matrix['checks']} checks), files written in {seconds['files']:.1f} s")
    if matrix["array"] is not None:
        array = matrix["array"]
        lines.append(f"pairs: {len(array.uncoverable)} in no cell, {len(array.refused_pairs)} refused in every cell "
                     f"(a dimension each of whose values completes a refused set), the rest in a cell above")
    return lines


# ------------------------------------------------------------------ the promises
def test_cell(cell_index, matrix_runs, tmp_path):
    cell, refusal = MATRIX["cells"][cell_index], MATRIX["refusals"][cell_index]
    row = RESULTS[cell_index] = {"cell": cell.name, "seam": cell.seam, "expect": "run" if refusal is None else
                                 "refused", "result": "FAIL", "figure": "", "cost": 0.0}
    started = time.time()
    try:
        if refusal is not None:
            row["figure"] = _refused_before_work(cell, tmp_path)
        else:
            row["figure"] = _keeps_promises(cell_index, cell, matrix_runs, tmp_path)
        row["result"] = "pass"
    except AssertionError as e:
        row["figure"] = row["figure"] or str(e).splitlines()[0][:160].replace("|", "/")
        raise
    finally:  # a refused cell's cost is its check here; a run's, its runs' own seconds (summary.json)
        if refusal is not None:
            row["cost"] += time.time() - started


def _refusal_of(run: D.Run, output_dir: str) -> str | None:
    from toolkit.cli.train import check
    from toolkit.errors import ConfigError

    try:
        check(run.task, os.path.join(CONFIGS, run.config), run.world, run.argv(output_dir), run.mixed_precision)
    except ConfigError as e:
        return str(e)
    return None


def _toolkit_train(run: D.Run, output_dir: str) -> tuple[int, list[str]]:
    """``toolkit train`` in this process (its main: the check, then the launch: only for a run the check refuses,
    which never reaches the launch): exit code and stderr lines."""
    import contextlib
    import io

    from toolkit.cli import train

    short = {v: k for k, v in train.TASKS.items()}[run.task]
    argv = [short, "--strategy", os.path.join(CONFIGS, run.config), "--num_processes", str(run.world),
            *(["--mixed_precision", run.mixed_precision] if run.mixed_precision else []), *run.argv(output_dir)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train.main(argv)
    return code, err.getvalue().strip().splitlines()


def _refused_before_work(cell: D.Cell, tmp_path) -> str:
    out = str(tmp_path / "out")
    code, lines = _toolkit_train(D.run_of(cell, MATRIX["files"]), out)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: "), (code, lines)
    assert not os.path.exists(out), "a refused run wrote its output_dir"
    return lines[0][len("config error: "):][:140].replace("|", "/")


def _keeps_promises(i: int, cell: D.Cell, runs: Runs, tmp_path) -> str:
    run = D.run_of(cell, MATRIX["files"])
    out = _get(runs, f"c{i:02d}")
    cost = _seconds(out)
    figures = []
    if cell["layout"] == "one":  # the reference itself
        _ended(out, run, cell)
    else:
        ref = _get(runs, _reference_name(D.reference_of(run)))
        cost += _seconds(ref)
        rows = [_ended(o, r, cell)["train_rows"] for o, r in ((ref, D.reference_of(run)), (out, run))]
        assert rows[0] == rows[1], f"promise 2: summary.json's train_rows {rows[1]}, one process's {rows[0]}"
        if cell["optim"] == "muon":  # the Muon group at the tolerance, the AdamW group at AdamW's
            muon, adamw = _weights_diff(out, ref, muon=True), _weights_diff(out, ref, muon=False)
            figures.append(f"dw Muon group {muon:.1e}, AdamW group {adamw:.1e}")
            assert muon <= tolerance(cell), f"promise 1: the Muon group {muon:.2e} from one process"
            assert adamw <= max(tolerance(cell), MUON_ADAMW_TOLERANCE), f"promise 1: the AdamW group {adamw:.2e}"
        else:
            diff = _weights_diff(out, ref)
            figures.append(f"dw {diff:.1e}")
            assert diff <= tolerance(cell), f"promise 1: final weights {diff:.2e} from one process ({tolerance(cell):g})"
        if cell["ending"] == "merge":
            logits = _merged_logits_diff(out, ref, run)
            figures.append(f"merged logits {logits:.1e}")
            assert logits <= MERGED_LOGITS_TOLERANCE[cell["precision"]], f"promise 2: merged logits {logits:.2e} off"
    if (cell["task"], cell["arch"]) in D.GRPO_MODELS:
        figures.append(_ends_turns(out))
    if run.mixed_precision:
        bf16 = out if cell["layout"] == "one" else _get(runs, _reference_name(D.reference_of(run)))
        moved = _weights_diff(bf16, _get(runs, _reference_name(D.reference_of(run, precision=None))))
        figures.append(f"bf16-fp32 {moved:.1e}")
        assert moved > 0, "bf16 ended with the fp32 weights: autocast did not run"
    if cell["ending"] in ("sigterm", "resume_new_rank"):
        figures.append(_resumes(i, cell, run, out, runs, tmp_path))
        cost += _seconds(_get(runs, f"c{i:02d}-interrupted")) + _seconds(_get(runs, f"c{i:02d}-resumed"))
    RESULTS[i]["cost"] += cost
    return "; ".join(figures) or "ran"


def _ends_turns(out: str) -> str:
    """GRPO on a chat model whose turns end with a token its tokenizer does not call EOS (Qwen2's <|im_end|>): every
    completion ends at the end of its turn or at max_completion_length; nothing after <|im_end|> is scored or trained
    (the cell's reward logs, of the completions' ids as the loss takes them, how many reached <|im_end|> and how many
    tokens came after one). Without a completion that reached it, the promise went untested: a failure too."""
    from toolkit.reporting.metrics import read_metrics

    rows = [r for r in read_metrics(out) if "turns/tokens_after_end" in r]
    assert rows, "promise 2 (GRPO): no generation logged where its completions end (turns/ in metrics.jsonl)"
    reached, after = sum(r["turns/reached_end"] for r in rows), sum(r["turns/tokens_after_end"] for r in rows)
    assert reached > 0, "promise 2 (GRPO): no completion reached <|im_end|>: the end of a turn went untested"
    assert after == 0, (f"promise 2 (GRPO): completions went on past <|im_end|>: tokens after the end of a turn "
                        f"scored and trained ({after:.2f}: the logged generations' means, summed)")
    return f"{reached / len(rows):.1f} a generation ended at im_end, 0 tokens after"


def _seconds(out: str) -> float:
    path = os.path.join(out, "summary.json")
    return json.load(open(path))["seconds"] if os.path.isfile(path) else 0.0


def _ended(out: str, run: D.Run, cell: D.Cell, preempted: bool = False) -> dict:
    """Promise 2: no error and no watchdog; summary.json true to the files; final/ loads (unless preempted)."""
    from toolkit.reporting.metrics import read_metrics

    errors = sorted(glob.glob(os.path.join(out, "error_rank*.txt")) + glob.glob(os.path.join(out, "watchdog.txt")))
    assert not errors, f"promise 2: {os.path.basename(errors[0])}: " + _last_line(errors[0])
    assert os.path.isfile(os.path.join(out, "summary.json")), "promise 2: no summary.json (its launch ended it)"
    summary = json.load(open(os.path.join(out, "summary.json")))
    steps = [row["step"] for row in read_metrics(out) if "loss" in row]
    assert steps and summary["steps"] == max(steps), ("promise 2: summary steps", summary["steps"], steps[-3:])
    assert summary["world_size"] == run.world, ("promise 2: summary world_size", summary["world_size"])
    if preempted:
        assert summary["ended"] == "preempted" and summary["final_model"] is None, summary["ended"]
        assert summary["steps"] == D.SIGTERM_AT + 1, ("promise 3: stopped at", summary["steps"])
        assert os.path.isdir(os.path.join(out, "checkpoints", f"step-{D.SIGTERM_AT + 1}"))
        return summary
    streamed_out = cell["ending"] == "data_end" and cell["data"].startswith("stream")
    assert summary["ended"] == ("data_ran_out" if streamed_out else "completed"), ("promise 2: ended", summary["ended"])
    if cell["ending"] != "data_end":
        assert summary["steps"] == summary["total_steps"] == run.fields["max_steps"], summary["steps"]
    if streamed_out:  # read to its end: every row on disk trained or counted as dropped, one epoch
        lines = sum(1 for path in glob.glob(run.fields["train_file"]) for line in open(path) if line.strip())
        seen = summary["train_rows"] + (summary.get("dropped_rows") or {}).get("train", 0)
        assert seen == lines, f"promise 2: a stream read to its end: {seen} rows trained or dropped, {lines} on disk"
        assert summary["epochs"] == 1.0, f"promise 2: a stream read to its end says epochs {summary['epochs']}"
    final = os.path.join(out, "final")
    assert summary["final_model"] and os.path.realpath(summary["final_model"]) == os.path.realpath(final), summary
    _loads(final, run)
    if cell["ending"] == "merge":
        _loads(os.path.join(final, "merged"), run)
    return summary


def _last_line(path: str) -> str:
    lines = [line for line in open(path).read().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _loads(folder: str, run: D.Run):
    """from_pretrained of a model, or of an adapter with its base (peft's AutoPeftModel classes, which read the
    base's path from adapter_config.json)."""
    import peft
    import transformers

    classify = run.task == "sequence-classification"
    if os.path.isfile(os.path.join(folder, "adapter_config.json")):
        cls = peft.AutoPeftModelForSequenceClassification if classify else peft.AutoPeftModelForCausalLM
    else:
        cls = transformers.AutoModelForSequenceClassification if classify else transformers.AutoModelForCausalLM
    try:
        return cls.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 (what from_pretrained raised is the finding)
        raise AssertionError(f"promise 2: {os.path.relpath(folder, os.path.dirname(os.path.dirname(folder)))} does "
                             f"not load with from_pretrained: {type(e).__name__}: {str(e)[:150]}") from None


def _tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update({k: v.double() for k, v in load_file(path).items()})
    assert out, f"no weights in {folder}"
    return out


def _weights_diff(a: str, b: str, muon: bool | None = None) -> float:
    """max |a - b| over final/'s tensors; ``muon`` True or False: over optim muon's Muon group, or the rest."""
    from helpers import max_abs_diff

    from toolkit.training.optimizers import saved_muon_names

    x, y = _tensors(os.path.join(a, "final")), _tensors(os.path.join(b, "final"))
    if muon is not None:
        names = saved_muon_names(os.path.join(b, "final"))
        x, y = ({k: v for k, v in t.items() if (k in names) is muon} for t in (x, y))
    return max_abs_diff(x, y)


def _merged_logits_diff(a: str, b: str, run: D.Run) -> float:
    """The merged exports' logits on the same ids, each loaded as its task's model (a classifier's as one: loaded as
    a causal LM, Qwen2's untied head came up random on each side, 0.66 apart)."""
    import torch
    import transformers

    ids = torch.arange(100, 124).view(2, 12)
    auto = (transformers.AutoModelForSequenceClassification if run.task == "sequence-classification"
            else transformers.AutoModelForCausalLM)
    logits = []
    for out in (a, b):
        model = auto.from_pretrained(os.path.join(out, "final", "merged"), dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(ids).logits.double())
    return float((logits[0] - logits[1]).abs().max())


def _resumes(i: int, cell: D.Cell, run: D.Run, out: str, runs: Runs, tmp_path) -> str:
    """Promise 3: the SIGTERMed run stopped after the next step with a checkpoint and no export, and its relaunch
    ends with the uninterrupted weights. resume_new_rank's relaunch changes the LoRA rank and alpha: the check,
    given the checkpoint, decides whether it must be refused before work."""
    interrupted = _get(runs, f"c{i:02d}-interrupted")
    _ended(interrupted, run, cell, preempted=True)
    resumed = _get(runs, f"c{i:02d}-resumed")
    if cell["ending"] == "resume_new_rank":
        copy = str(tmp_path / "relaunch")
        shutil.copytree(interrupted, copy)
        before = tree_hash(copy)
        relaunch = dataclasses.replace(run, fields={**run.fields, **D.NEW_RANK, "resume_from_checkpoint": "latest"})
        refusal = _refusal_of(relaunch, copy)
        if refusal is not None:  # refused before work: toolkit train says it in one line, exit 2, nothing written
            code, lines = _toolkit_train(relaunch, copy)
            assert code == 2 and len(lines) == 1 and tree_hash(copy) == before, ("refused in one line", code, lines)
            return "relaunch refused: " + refusal[:100].replace("|", "/")
    _ended(resumed, run, cell)
    diff = _weights_diff(out, resumed)
    assert diff <= RESUME_TOLERANCE[cell["precision"]], f"promise 3: resumed {diff:.2e} from the uninterrupted run"
    return f"resumed {diff:.1e}"


@pytest.mark.slow  # the array's ~700 checks: only with the whole matrix
@pytest.mark.matrix_full
def test_every_pair_is_in_a_cell_that_runs_or_a_refused_set(request):
    """The array's own promise: every pair of values of two dimensions is in a cell that runs or inside a set the
    check refuses (``covering.Array.uncoverable`` empty); a pair in neither would be a seam no cell tries."""
    array = build(request.config)["array"]
    if array is None:
        pytest.skip("the array is generated only for the whole matrix (-m '' or TOOLKIT_MATRIX=full)")
    assert not array.uncoverable, f"{len(array.uncoverable)} pairs in no cell: {array.uncoverable[:20]}"

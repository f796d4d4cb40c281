"""``python -m toolkit verify``: does a launch config train exactly like one process? Check before paying for GPUs.

    python -m toolkit verify --config_file accelerate_configs/zero3.yaml [--num_processes 2] [--checks sgd,adamw,muon]
        [--steps 3] [--recipe recipes/gpt2.py] [--work_dir DIR]  RECIPE ARGS (--config ..., any field)

For each check asked for, it runs the recipe, unchanged, twice for a few steps, the way a user would, with
``--disable_dropout true`` and fp32 (``--mixed_precision no``), shuffle on, the recipe's seed and data, a linear
schedule, and compares the exported ``final/`` weights:

  1. under the launch config: ``accelerate launch --config_file ... --num_processes N recipe ...``, micro batch m,
     accumulation k;
  2. as one plain process, ``python recipe ...``, with the same global batch: micro batch N x m x k, no accumulation.

It prints max |dw| and the two loss curves side by side, then PASS or FAIL: SGD without clipping must agree to 1e-6
(SGD is linear in the gradient, so any error in the loss normalisation, the accumulation boundary or the gradient
reduction shows) and AdamW, clipped at the recipe's max_grad_norm, to 1e-5. The Muon check (``--checks muon``, not
run by default: its Newton-Schulz iterations cost minutes on a CPU for a real model) runs ``optim muon`` at 0.02
with its AdamW group at ``--adamw_lr``, clipped, with ``muon_ns_dtype float32`` (bf16 iterations differ between any
two splits of a batch, one process included: docs/pitfalls.md#muon-bf16): its Muon group must agree to 1e-6 and the
rest (the AdamW group) to 1e-5, the proofs' tolerances (tests/launch/test_muon.py). The AdamW check runs with eps 1e-6:
Adam's update is about lr * g / (|g| + eps), so with the usual 1e-8 a parameter whose gradient is near 1e-8 turns
fp32 rounding noise (another summation order on another CPU) into a visible change of its step, and the verdict would
depend on the machine (docs/pitfalls.md#adamw-eps). 1e-5 still catches a missing clip and a norm taken over one
shard (off by sqrt(2)) by a wide margin (figures: docs/strategies.md, tests/launch/test_core.py). DeepSpeed clips inside its
engine at the recipe's max_grad_norm (``toolkit.parallel.accelerator.configure_deepspeed``), so both runs clip alike.
Exit code 0 on PASS, 1 on FAIL or a failed run, 2 on a usage or config error, found before any launch: the
fields, and what a rank of the launch would refuse (``toolkit train``'s checks, ``toolkit.cli.train.check``). A failed
run's own error line (``config error: ...``, or the last exception a rank raised) is printed with its log's path,
not the launcher's traceback, which only says that a rank failed.

verify's own options are named so that no recipe field can be taken for one (a test keeps it so): every other
argument goes to the recipe. The fields verify must fix for a fair comparison are listed when it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from toolkit import layout
from toolkit.cli.train import check, packaged
from toolkit.config import ARGUMENT_CLASSES, ConfigError, field_names, parse_args
from toolkit.config.help import recipe_task, takes

SGD_TOLERANCE = 1e-6
ADAMW_TOLERANCE = 1e-5
ADAMW_EPSILON = 1e-6
MUON_LR = 0.02  # Keller Jordan's, torch's Muon's docstring example
TOLERANCES = {"sgd": SGD_TOLERANCE, "adamw": ADAMW_TOLERANCE, "muon": SGD_TOLERANCE}  # muon: its AdamW group 1e-5
UNUSED_OUTPUT = os.devnull + "-unused"  # an output_dir for parsing and checking only: no run writes there


def default_recipe() -> str:
    """recipes/gpt2.py: beside the package in a source checkout, inside it (toolkit/recipes) in an installed wheel
    (reported as missing by _plan when neither has it)."""
    return packaged("recipes", "gpt2.py")


def _optimizer_overrides(name: str, args) -> list[str]:
    """Appended after the user's arguments (the command line's last value wins)."""
    if name == "sgd":
        # Plain SGD is linear in the gradient, so this run has no clipping: on CPU the fp32 norm of a large gradient
        # is itself off by a little, differently for every sharding, which clipping would turn into a visible dw
        # (docs/strategies.md, toolkit verify). Clipping is checked by the AdamW run.
        return ["--optim", "sgd", "--learning_rate", str(args.sgd_lr), "--weight_decay", "0", "--max_grad_norm", "0"]
    adamw = ["--weight_decay", "0.01", "--adam_epsilon", str(ADAMW_EPSILON)]
    if name == "muon":  # fp32 iterations: the only ones that are the same under every split (module docstring)
        return ["--optim", "muon", "--learning_rate", str(MUON_LR), "--muon_adamw_learning_rate", str(args.adamw_lr),
                "--muon_ns_dtype", "float32", *adamw]
    return ["--optim", "adamw_torch", "--learning_rate", str(args.adamw_lr), *adamw]


def _recipe_argv(args, recipe_args: list[str], name: str) -> list[str]:
    """The recipe's arguments for check ``name``: the user's, then what verify fixes (the last value wins)."""
    return [*recipe_args, *_fixed_overrides(args.steps, recipe_task(args.recipe)), *_optimizer_overrides(name, args)]


def _checks(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names or any(n not in TOLERANCES for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(TOLERANCES)}, got {value!r}")
    return list(dict.fromkeys(names))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toolkit verify", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--config_file", required=True, help="the accelerate launch config to verify")
    p.add_argument("--num_processes", type=int, default=None, help="ranks to launch (default: the config's)")
    p.add_argument("--checks", type=_checks, default=["sgd", "adamw"],
                   help="comma-separated: sgd, adamw, muon (default sgd,adamw)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--recipe", default=None, help="recipe script (default: recipes/gpt2.py)")
    p.add_argument("--work_dir", default=None, help="where the runs go (default: a new temporary folder)")
    p.add_argument("--sgd_lr", type=float, default=0.5, help="SGD learning rate (large, so that errors show)")
    p.add_argument("--adamw_lr", type=float, default=3e-3, help="AdamW learning rate (the muon check's AdamW group's too)")
    return p


def own_options() -> set[str]:
    """verify's option names; none may also be a recipe field, or a user's recipe value would be taken as verify's."""
    return {a.dest for a in _parser()._actions if a.dest != "help"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    clash = own_options() & set(field_names())
    if clash:  # a programming error, kept out by a test; never let a recipe value be read as verify's own
        raise RuntimeError(f"verify options {sorted(clash)} are also recipe fields; rename them")
    args, recipe_args = _parser().parse_known_args(argv)
    args.recipe = args.recipe or default_recipe()
    try:
        plan = _plan(args, recipe_args)
        task = recipe_task(args.recipe)
        # what a rank of the launch would refuse (toolkit train's checks), before any launch: the first check's
        # fields, and muon's (the one optimizer some strategies refuse)
        for name in dict.fromkeys([args.checks[0], *(n for n in args.checks if n == "muon")]) if task else ():
            check(task, args.config_file, plan["world"],
                  [*_recipe_argv(args, recipe_args, name), "--output_dir", UNUSED_OUTPUT], mixed_precision="no")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    work = args.work_dir or tempfile.mkdtemp(prefix="toolkit-verify-")
    degree = f" (data-parallel degree {plan['dp']})" if plan["dp"] != plan["world"] else ""
    print(f"verify {args.config_file}: {plan['world']} processes{degree} x micro batch {plan['micro']} x accumulation "
          f"{plan['accum']} vs 1 process x micro batch {plan['global']}; {args.steps} steps, fp32, dropout off, "
          f"shuffle on; recipe {args.recipe}; runs in {work}", flush=True)
    print(f"  verify sets: {' '.join(_fixed_overrides(args.steps, task))} and, per check, optim, learning_rate, "
          "weight_decay (sgd: max_grad_norm 0; adamw: adam_epsilon 1e-6; muon: muon_adamw_learning_rate, "
          "muon_ns_dtype float32, adam_epsilon 1e-6)", flush=True)
    ok = True
    for name in args.checks:
        common = _recipe_argv(args, recipe_args, name)
        runs = {}
        for label in ("strategy", "reference"):
            out = os.path.join(work, f"{name}-{label}")
            if label == "strategy":
                # --quiet: the launcher's own traceback (a ChildFailedError raised in accelerate) stays out of the log
                cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--config_file", args.config_file,
                       "--num_processes", str(plan["world"]), "--mixed_precision", "no",
                       "--main_process_port", str(_free_port()), args.recipe, *common, "--output_dir", out]
            else:
                cmd = [sys.executable, args.recipe, *common, *reference_argv(plan), "--output_dir", out]
            started = time.time()
            log = out + ".log"
            rc = _run(cmd, log, single=label == "reference")
            print(f"  {name} {label}: exit {rc} in {time.time() - started:.0f} s (log: {log})", flush=True)
            if rc != 0:
                print(failure_cause(log), file=sys.stderr)
                return 1
            runs[label] = out
        ok &= _compare(name, runs["strategy"], runs["reference"], TOLERANCES[name])
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


def reference_argv(plan: dict) -> list[str]:
    """The one-process reference's fields after the recipe's: the whole global batch in one micro-batch, no pipeline
    and no sequence split (one process holds every stage and every position)."""
    return ["--per_device_train_batch_size", str(plan["global"]), "--gradient_accumulation_steps", "1",
            "--pipeline_parallel_size", "1", "--sequence_parallel_size", "1", "--context_parallel_size", "1"]


def _plan(args, recipe_args: list[str]) -> dict:
    """Parse (and validate) the recipe's arguments here, before any launch: errors come back in a second."""
    if not os.path.isfile(args.config_file):
        raise ConfigError("config_file", f"file not found: {args.config_file}")
    if not os.path.isfile(args.recipe):
        raise ConfigError("recipe", f"file not found: {args.recipe}")
    if args.steps < 1:
        raise ConfigError("steps", "must be >= 1")
    world = args.num_processes or _config_processes(args.config_file)
    if world < 2:
        raise ConfigError("num_processes", f"is {world}; verify compares a multi-process launch with one process: "
                                           "pass --num_processes 2 or more")
    task = recipe_task(args.recipe)
    cfg = parse_args([*recipe_args, *_fixed_overrides(args.steps, task), "--output_dir", UNUSED_OUTPUT],
                     task=task)  # the recipe's own fields, as the recipe will parse them
    micro, accum = cfg.train.per_device_train_batch_size, cfg.train.gradient_accumulation_steps
    # The ranks of a tensor- (or context-) parallel group take the same rows: the global batch the reference must
    # match is micro x accumulation x the data-parallel degree, not x the process count.
    # A pipeline's stages (pipeline_parallel_size) and a sequence-parallel group's ranks take the same rows as well.
    model_parallel = (_config_model_parallel(args.config_file) * cfg.train.pipeline_parallel_size
                      * cfg.train.split_size)
    if world % model_parallel:
        raise ConfigError("num_processes", f"is {world}, not a multiple of the config's tp_size x cp_size x "
                                           f"pipeline_parallel_size x {cfg.train.split_field} ({model_parallel})")
    dp = world // model_parallel
    return {"world": world, "dp": dp, "micro": micro, "accum": accum, "global": dp * micro * accum}


def _read_config(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def _config_processes(path: str) -> int:
    return int(_read_config(path).get("num_processes", 1))


def _config_model_parallel(path: str) -> int:
    """tp_size x cp_size of the launch config's ``parallelism_config`` (1 without one)."""
    parallel = _read_config(path).get("parallelism_config") or {}
    return (int(parallel.get("parallelism_config_tp_size", 1) or 1)
            * int(parallel.get("parallelism_config_cp_size", 1) or 1))


def _fixed_overrides(steps: int, task: str | None = None) -> list[str]:
    # Appended after the user's arguments: the command line's last value wins. Only the fields the recipe's task takes
    # (GRPO has no held-out evaluation: its recipe refuses max_eval_samples).
    fixed = {"max_steps": str(steps), "logging_steps": "1", "shuffle": "true", "lr_scheduler_type": "linear",
             "warmup_steps": "0", "eval_on_start": "false", "max_eval_samples": "32", "disable_dropout": "true",
             "report_to": "none", "overwrite_output_dir": "true", "save_final_model": "true"}
    taken = {f.name for cls in ARGUMENT_CLASSES for f in dataclasses.fields(cls) if takes(f, task)}
    return [token for name, value in fixed.items() if name in taken for token in (f"--{name}", value)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], log: str, single: bool) -> int:
    env = dict(os.environ)
    if single:
        # A reference run is one plain process, even when verify itself was started inside a launched job.
        for key in list(env):
            if key.startswith(("ACCELERATE_", "FSDP_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key)
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


# The lines toolkit.cli.recipe prints for a recipe's own errors; and the last line of a Python traceback ("OSError: ...").
_OWN_LINES = ("config error:", "training stopped:")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
# What the launchers raise when a rank failed: they only say that it did (the rank's own line is above them).
_LAUNCHER_ERRORS = ("ChildFailedError", "CalledProcessError", "ProcessRaisedException", "ProcessExitedException")


def failure_cause(log: str, lines: int = 40) -> str:
    """Why a run failed, from its log: the recipe's own lines (once each), else the last exception a rank raised,
    else the log's last ``lines`` lines; and where the whole log is."""
    with open(log, errors="replace") as f:
        text = f.read().splitlines()
    cause = list(dict.fromkeys(line for line in text if line.startswith(_OWN_LINES)))
    if not cause:
        cause = [line for line in text if _RAISED.match(line) and not any(e in line for e in _LAUNCHER_ERRORS)][-1:]
    return "\n".join(cause or text[-lines:]) + f"\n(the run's whole output: {log})"


def _load_final(out: str) -> tuple[dict, set[str]]:
    """The exported weights as fp64, and the dtypes they were stored in (the dtype the run trained in). A LoRA run
    (``use_peft``) exports its adapter: that is what is compared (the base weights do not train)."""
    from safetensors.torch import load_file

    final = layout.final_dir(out)
    index = os.path.join(final, "model.safetensors.index.json")
    if os.path.isfile(os.path.join(final, "adapter_model.safetensors")):
        files = ["adapter_model.safetensors"]
    elif os.path.isfile(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights, dtypes = {}, set()
    for name in files:
        for key, tensor in load_file(os.path.join(final, name)).items():
            dtypes.add(str(tensor.dtype).replace("torch.", ""))
            weights[key] = tensor.double()
    return weights, dtypes


def _metrics(out: str) -> list[dict]:
    from toolkit.reporting.metrics import read_metrics

    return [r for r in read_metrics(out) if "loss" in r]


def _compare(name: str, strategy: str, reference: str, tolerance: float) -> bool:
    (a, dtypes_a), (b, dtypes_b) = _load_final(strategy), _load_final(reference)
    if dtypes_a | dtypes_b != {"float32"}:
        # Tolerances are for fp32 arithmetic; a model trained in bf16 would fail (or pass) for the wrong reason.
        print(f"  {name}: the runs trained in {sorted(dtypes_a | dtypes_b)}, verify compares fp32 training; "
              "load the model in float32: FAIL")
        return False
    if set(a) != set(b):
        print(f"  {name}: the exports hold different tensors: {sorted(set(a) ^ set(b))[:5]}")
        return False
    diffs = {k: float((a[k] - b[k]).abs().max()) for k in a}
    # the muon check: its Muon group at the tolerance, the rest (its AdamW group) at AdamW's
    if name == "muon":
        from toolkit.training.optimizers import saved_muon_names

        muon = saved_muon_names(layout.final_dir(reference))
    else:
        muon = set(diffs)
    worst = max(muon & set(diffs), key=diffs.get)
    dw, others = diffs[worst], {k: d for k, d in diffs.items() if k not in muon}
    ra, rb = _metrics(strategy), _metrics(reference)
    print(f"\n  {name}: step | loss (strategy)  loss (1 process) |  grad norm (strategy)  (1 process) | lr")
    for x, y in zip(ra, rb):
        gx, gy = x.get("grad_norm"), y.get("grad_norm")
        print(f"  {name}: {x['step']:>4} | {x['loss']:.8f}  {y['loss']:.8f} | "
              f"{gx if gx is None else f'{gx:.6f}':>12}  {gy if gy is None else f'{gy:.6f}':>12} | {x['lr']:.3e}")
    same_steps = [r["step"] for r in ra] == [r["step"] for r in rb]
    passed = dw <= tolerance and same_steps
    group = ""
    if name == "muon":
        rest = max(others, key=others.get)
        passed &= others[rest] <= ADAMW_TOLERANCE
        group = (f" (Muon group); AdamW group max |dw| = {others[rest]:.3e} (at {rest}), tolerance "
                 f"{ADAMW_TOLERANCE:.0e}")
    print(f"  {name}: max |dw| = {dw:.3e} (at {worst}), tolerance {tolerance:.0e}{group}: "
          f"{'PASS' if passed else 'FAIL'}" + ("" if same_steps else " (the runs logged different steps)") + "\n",
          flush=True)
    return passed


if __name__ == "__main__":
    sys.exit(main())

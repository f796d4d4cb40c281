"""Any recipe, unchanged, on a Ray cluster: Ray Train's ``TorchTrainer`` starts the workers and their process group,
each worker runs the recipe's ``main``, and the launch config's strategy is applied as ``accelerate launch`` applies it.

    python scripts/ray_train.py [--address ADDR] [--num-workers N] [--use-gpu] [--max-failures K]
        [--config_file accelerate_configs/X.yaml] RECIPE [recipe arguments...]

- The cluster: ``--address`` (``auto``, ``ray://host:10001``, ...), or a local one this script starts (with Ray's
  token authentication off, ``RAY_AUTH_MODE=disabled``: only for that local cluster).
- The strategy: the launch config is read by accelerate's own launcher code (``_validate_launch_command``, then
  ``prepare_deepspeed_cmd_env`` or ``prepare_multi_gpu_env``) and the ``ACCELERATE_*`` / ``FSDP_*`` / ... variables it
  would give the ranks are set in each worker before the recipe runs; Ray sets RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR/PORT and creates the process group, which the Accelerator adopts.
- Checked first: the recipe's config is parsed here, so a bad field stops with one line and exit code 2 before any
  worker starts. ``output_dir`` must be on storage every node sees; Ray's own files go to ``<output_dir>/ray``.
- Failures: Ray restarts the whole worker group up to ``--max-failures`` times (``FailureConfig``); each worker counts
  its starts in ``<output_dir>/ray/attempts-<job>/rank<r>`` and tells the toolkit through
  ``TORCHELASTIC_RESTART_COUNT``, the variable torch elastic restarts set, so a restart continues the run from
  ``latest`` exactly as an elastic restart does (toolkit.elastic).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Set by Ray for each worker (its process group, its threads) or by the cluster (the path): not taken from accelerate.
RAY_OWNS = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/ray_train.py", allow_abbrev=False,
                                     description="Run a recipe on a Ray cluster (Ray Train's TorchTrainer).")
    parser.add_argument("--address", help="an existing cluster (ray.init's address); default: start a local one")
    parser.add_argument("--num-workers", type=int, default=2, help="ranks (one per GPU with --use-gpu)")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker (NCCL); default: CPU ranks (gloo)")
    parser.add_argument("--max-failures", type=int, default=3, help="worker group restarts before the run fails")
    parser.add_argument("--config_file", help="the launch config (accelerate_configs/*.yaml); default: plain DDP")
    parser.add_argument("recipe", help="recipes/gpt2.py, sft.py, classify.py, dpo.py, or any script with main()")
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def launch_env(config_file: str | None, processes: int) -> dict[str, str]:
    """The variables ``accelerate launch --config_file X --num_processes N`` gives its ranks beyond this process's own
    (none without a launch config), from accelerate's own code."""
    if config_file is None:
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = ["--config_file", config_file, "--num_processes", str(processes), "--num_machines", "1",
            "--main_process_port", "0", "ray_train"]
    args, defaults, mixed_precision_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_deepspeed:  # what accelerate's launch_command adds before its deepspeed_launcher
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(
            fields + (["mixed_precision"] if mixed_precision_from_config else []))
        env = prepare_deepspeed_cmd_env(args)[1]
    elif args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    else:
        return {}
    return {k: v for k, v in env.items() if os.environ.get(k) != v and k not in RAY_OWNS}


def attempt(folder: str, rank: int) -> int:
    """How many times this rank started before in this job (0 on the first attempt); counts this start. Ray restarts
    the whole group, so every rank counts alike."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}")
    before = int(open(path).read()) if os.path.exists(path) else 0
    with open(path, "w") as f:
        f.write(str(before + 1))
    return before


def worker(config: dict) -> None:
    """One Ray Train worker: the launch config's variables, the attempt, then the recipe's ``main`` as a script."""
    import ray.train

    os.environ.update(config["env"])
    rank = ray.train.get_context().get_world_rank()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt(config["attempts"], rank))
    recipe = config["recipe"]
    sys.argv = [recipe, *config["recipe_args"]]
    sys.path[:0] = [os.path.dirname(recipe), ROOT]
    spec = importlib.util.spec_from_file_location(f"ray_train_recipe_{rank}", recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()


def check_recipe_args(recipe_args: list[str]) -> str:
    """The recipe's config parsed here, before any worker: a mistake is one line and exit code 2 (toolkit.cli's
    form). Returns the absolute output_dir."""
    from toolkit.config import ConfigError, parse_args

    try:
        cfg = parse_args(recipe_args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return os.path.abspath(cfg.train.output_dir)


def fit(args: argparse.Namespace):
    """The run on the cluster ``ray.init`` connected to (a local one started here when none is)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    output_dir = check_recipe_args(args.recipe_args)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # the toolkit's lines as it prints them
    if not ray.is_initialized():
        if args.address is None:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster of this process only
        ray.init(address=args.address, include_dashboard=False)
    if worker.__module__ != "__main__":  # imported (the tests): ship the worker by value, as a script's would be
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[worker.__module__])
    storage = os.path.join(output_dir, "ray")
    config = {"env": launch_env(args.config_file, args.num_workers), "recipe": os.path.abspath(args.recipe),
              "recipe_args": args.recipe_args, "attempts": os.path.join(storage, f"attempts-{uuid.uuid4().hex}")}
    trainer = TorchTrainer(worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
                           run_config=RunConfig(name="train", storage_path=storage,
                                                failure_config=FailureConfig(max_failures=args.max_failures)))
    return trainer.fit()


def main(argv: list[str] | None = None) -> None:
    # A run that fails past --max-failures raises Ray's TrainingFailedError here, with each worker's error (a
    # ConfigError from a check that runs in the workers, the data's, arrives as itself: toolkit/errors.py).
    fit(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()

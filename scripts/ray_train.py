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
- Failures: Ray restarts the whole worker group up to ``--max-failures`` times (``FailureConfig``). Every toolkit
  checkpoint (``save_steps``, a preemption) is reported to Ray as it is written (``ray.train.report``): a pointer
  (``toolkit_checkpoint.json``: its path in ``output_dir``, its step, the attempt) is what Ray stores, the checkpoint
  stays where the toolkit wrote it. Each attempt reports one such pointer when it starts too. A restarted group learns
  the last one from Ray (``ray.train.get_checkpoint()``, the same on every rank): it is attempt n + 1, resumes that
  checkpoint and tells the toolkit through ``TORCHELASTIC_RESTART_COUNT``, the variable torch elastic restarts set,
  so that the earlier attempt's files are its own (``toolkit.env.elastic``). ``Result.checkpoint`` is the last pointer
  (``reported_checkpoint`` reads it). Ray Train's v2 API (Ray 2.60's default) is used throughout.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Set by Ray for each worker (its process group, its threads) or by the cluster (the path): not taken from accelerate.
RAY_OWNS = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH")
POINTER = "toolkit_checkpoint.json"  # what Ray stores for a toolkit checkpoint (a pointer: no copy of the weights)


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
    """The variables ``accelerate launch --config_file X --num_processes N`` sets for its ranks (none without a launch
    config), from accelerate's own code (``toolkit.cli.train.launch_env``): all of them, also those this process already
    holds, since a worker on another machine has only the environment its node was started with. Ray's own
    (``RAY_OWNS``) are left to Ray."""
    if config_file is None:
        return {}
    from toolkit.cli.train import launch_env as accelerate_env

    return {k: v for k, v in accelerate_env(config_file, processes).items() if k not in RAY_OWNS}


# ------------------------------------------------------------------------ restarts: Ray's record of the checkpoints
def reported_checkpoint(checkpoint) -> dict | None:
    """What a pointer Ray stores says (``ray.train.get_checkpoint()``, ``Result.checkpoint``): {"checkpoint": the
    toolkit checkpoint's folder or None, "step", "attempt"}; None for no checkpoint."""
    if checkpoint is None:
        return None
    with open(os.path.join(checkpoint.path, POINTER)) as f:
        return json.load(f)


def restart(previous: dict | None, recipe_args: list[str]) -> tuple[int, list[str]]:
    """(attempt, the recipe's arguments) for a worker group whose last reported pointer is ``previous`` (the same on
    every rank): none, the first attempt with the arguments as given; else the next attempt, resuming the checkpoint
    Ray holds (the toolkit's restart policy still takes ``latest`` where it is newer: one written and not reported
    before the group died)."""
    if previous is None:
        return 0, list(recipe_args)
    resume = ["--resume_from_checkpoint", previous["checkpoint"]] if previous["checkpoint"] else []
    return previous["attempt"] + 1, [*recipe_args, *resume]


def report(rank: int, record: dict) -> None:
    """Every rank: hand Ray a pointer to a toolkit checkpoint (rank 0 writes it; Ray copies its one small file into
    the run's storage), and wait until Ray has committed it, so that a group that dies after this call restarts
    knowing of it."""
    import ray.train
    from ray.train import Checkpoint, CheckpointConsistencyMode

    metrics = {"attempt": record["attempt"], "step": record["step"] or 0}
    if rank == 0:
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, POINTER), "w") as f:
                json.dump(record, f)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
    else:
        ray.train.report(metrics, checkpoint=None)
    ray.train.get_all_reported_checkpoints(CheckpointConsistencyMode.COMMITTED)


class ReportCheckpoints:
    """A toolkit callback (``toolkit.training.loop.train``): every checkpoint written, reported to Ray."""

    def __init__(self, rank: int, attempt: int):
        self.rank, self.attempt = rank, attempt

    def on_save(self, accelerator, state, checkpoint):
        report(self.rank, {"checkpoint": os.path.abspath(checkpoint), "step": state.step, "attempt": self.attempt})


def worker(config: dict) -> None:
    """One Ray Train worker: the launch config's variables, the attempt (from Ray's last reported checkpoint), then
    the recipe's ``main`` as a script, its checkpoints reported to Ray."""
    import ray.train

    os.environ.update(config["env"])
    rank = ray.train.get_context().get_world_rank()
    previous = reported_checkpoint(ray.train.get_checkpoint())
    attempt, recipe_args = restart(previous, config["recipe_args"])
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    # This attempt's start, carrying the checkpoint it resumes: a restart before its first save is known as one.
    report(rank, {"checkpoint": previous and previous["checkpoint"], "step": previous and previous["step"],
                  "attempt": attempt})
    recipe = config["recipe"]
    sys.argv = [recipe, *recipe_args]
    sys.path[:0] = [os.path.dirname(recipe), ROOT]
    spec = importlib.util.spec_from_file_location(f"ray_train_recipe_{rank}", recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if "callbacks" in inspect.signature(module.main).parameters:  # the recipes' main(callbacks=None)
        module.main(callbacks=[ReportCheckpoints(rank, attempt)])
    else:  # a script of its own: its checkpoints are not reported (a restart resumes latest)
        module.main()


def check_recipe_args(recipe_args: list[str]) -> str:
    """The recipe's config parsed here, before any worker: a mistake is one line and exit code 2 (toolkit.cli.recipe's
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
    config = {"env": launch_env(args.config_file, args.num_workers), "recipe": os.path.abspath(args.recipe),
              "recipe_args": args.recipe_args}
    # A run of its own per driver run: Ray's record of another run's checkpoints (a driver started again) never
    # passes for this one's; that driver continues with resume_from_checkpoint: latest, as after any launcher.
    name = f"train-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    trainer = TorchTrainer(worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
                           run_config=RunConfig(name=name, storage_path=os.path.join(output_dir, "ray"),
                                                failure_config=FailureConfig(max_failures=args.max_failures)))
    return trainer.fit()


def main(argv: list[str] | None = None) -> None:
    # A run that fails past --max-failures raises Ray's TrainingFailedError here, with each worker's error (a
    # ConfigError from a check that runs in the workers, the data's, arrives as itself: toolkit/errors.py).
    result = fit(parse(sys.argv[1:] if argv is None else argv))
    last = reported_checkpoint(result.checkpoint)
    if last is not None and last["checkpoint"]:
        print(f"ray train: last checkpoint {last['checkpoint']} (step {last['step']}, attempt {last['attempt']})",
              flush=True)


if __name__ == "__main__":
    main()

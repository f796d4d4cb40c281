"""Torch elastic restarts: what the launcher's environment says about this attempt, and what a restart does to a run.

``torchrun`` / ``accelerate launch`` with ``--max_restarts K`` restart every rank with the same command line when one
dies; the agent tells the workers which attempt they are through the environment (read here, and only here):

    TORCHELASTIC_RUN_ID           set on every worker a torch elastic agent started (never on a plain process)
    TORCHELASTIC_RESTART_COUNT    the attempt: 0 first, n after n restarts (unset outside torch elastic)
    TORCHELASTIC_MAX_RESTARTS     the launcher's --max_restarts
    TORCHELASTIC_USE_AGENT_STORE  "True": the ranks share the agent's rendezvous store, across attempts
    GROUP_WORLD_SIZE              machines (agents) in the job
    TORCHELASTIC_ERROR_FILE       <the launch's temp dir>/attempt_<n>/<local rank>/error.json, one per rank

What the cluster scheduler says (``check_machines``): ``PET_NNODES`` (Kubeflow's operators) or
``SLURM_STEP_NUM_NODES`` (srun) above 1 while the process group will span one machine is refused.

The launcher itself: ``record_launcher`` notes this process's parent when it starts (``toolkit.training.preemption`` stops
a rank whose launcher is gone). The policy (``continue_restart``): a restart continues the attempt before it. ``toolkit.config`` calls it while it
checks a config; ``toolkit.parallel.accelerator`` starts the process group of each attempt under a key prefix of its own.

Imports only ``errors``, ``layout`` and yaml: it runs while a config is parsed, before torch is imported.
"""

from __future__ import annotations

import os
import sys

import yaml

from toolkit import layout
from toolkit.errors import ConfigError


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, str(default)))
    except ValueError:
        return default


def first_to_report(what: str) -> bool:
    """Whether this rank is the first of its machine's ranks in this attempt to report ``what`` (a kind of error),
    so that a mistake every rank makes alike prints one line, not one per rank (two ranks writing at once once glued
    theirs into one line). The first rank to fail claims a file in the attempt's folder, which torch elastic
    creates for every launch (the folder of ``TORCHELASTIC_ERROR_FILE``'s folder); a rank that fails alone still
    reports. True outside torch elastic, and whenever the claim cannot be made: a line twice beats no line."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not launched_by_torch_elastic() or not error_file:
        return True
    claim = os.path.join(os.path.dirname(os.path.dirname(error_file)), f"toolkit-{what}-reported")
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def launched_by_torch_elastic() -> bool:
    """Started by torchrun / ``accelerate launch`` (and ``notebook_launcher``): set on every worker, never on a plain
    process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


# pid -> the parent it had when first recorded (its launcher). Keyed by pid: a process forked after the record
# (notebook_launcher's ranks, DataLoader workers) inherits this dict but records its own entry.
_LAUNCHERS: dict[int, int] = {}


def record_launcher() -> None:
    """Remember this process's parent as its launcher, once per process and only under torch elastic: called when
    this module is imported (the config is parsed first thing in every recipe) and by
    ``toolkit.parallel.accelerator.make_accelerator`` (the first toolkit call inside a ``notebook_launcher`` rank, forked
    from a kernel that imported this module outside torch elastic). Recorded this early, a launcher that dies during
    tokenization, model loading or a conversion is seen (``toolkit.training.preemption``); recorded only when ``train()``
    starts, the orphan's new parent would be taken for its launcher."""
    if launched_by_torch_elastic():
        _LAUNCHERS.setdefault(os.getpid(), os.getppid())


def launcher_pid() -> int | None:
    """The parent pid ``record_launcher`` recorded for this process (recorded now if it was not), None outside
    torch elastic."""
    if not launched_by_torch_elastic():
        return None
    record_launcher()
    return _LAUNCHERS.get(os.getpid())


def restart_count() -> int:
    """How many times torch elastic (``torchrun`` / ``accelerate launch`` with ``--max_restarts``) has restarted this
    job's workers: ``TORCHELASTIC_RESTART_COUNT``, which the agent sets on every worker (0 on the first attempt, unset
    outside torch elastic)."""
    return _int_env("TORCHELASTIC_RESTART_COUNT", 0)


def max_restarts() -> int:
    """``--max_restarts`` of the torch elastic launcher that started this process (``TORCHELASTIC_MAX_RESTARTS``)."""
    return _int_env("TORCHELASTIC_MAX_RESTARTS", 0)


def machines() -> int:
    """Machines (agents) in the torch elastic job that started this process (``GROUP_WORLD_SIZE``; 1 outside one)."""
    return _int_env("GROUP_WORLD_SIZE", 1)


def shares_agent_store() -> bool:
    """The ranks use the agent's rendezvous store, the same one across attempts (``TORCHELASTIC_USE_AGENT_STORE``:
    always under a static rendezvous, under c10d unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


# What a cluster scheduler says about the machines of this job, in every process it starts (the variable, and what
# sets it). A process group that spans one of them (python recipe.py in each pod or node, accelerate's one-process
# launch, a launcher told --nnodes 1) trains alone on all the data and exits 0 (scripts/k8s/README.md).
SCHEDULER_MACHINES = (
    ("PET_NNODES", "the Kubeflow training operator (PyTorchJob) or Trainer (TrainJob): pods in the job"),
    ("SLURM_STEP_NUM_NODES", "srun: nodes in this job step"),
)
FIX = {"PET_NNODES": "start each pod with scripts/k8s/launch.py (it passes accelerate launch --num_machines "
                     "$PET_NNODES --machine_rank $PET_NODE_RANK --main_process_ip $PET_MASTER_ADDR "
                     "--main_process_port $PET_MASTER_PORT), or torchrun, which reads PET_*",
       "SLURM_STEP_NUM_NODES": "start one launcher per node with scripts/slurm.sbatch (accelerate launch "
                               "--num_machines $SLURM_NNODES --machine_rank $SLURM_NODEID ...)"}


def scheduler_machines() -> tuple[str, int] | None:
    """(variable, fewest machines) a cluster scheduler says this job spans, None where none says more than one.
    PET_NNODES may be an elastic range, ``MIN:MAX`` (PyTorchJob's elasticPolicy): its minimum counts."""
    for name, _ in SCHEDULER_MACHINES:
        value = os.environ.get(name, "").split(":")[0]
        if value.isdigit() and int(value) > 1:
            return name, int(value)
    return None


def launched_machines() -> int:
    """Machines the process group will span: the torch elastic agents (``GROUP_WORLD_SIZE``) under torchrun /
    accelerate launch; without a launcher each process stands for itself (``WORLD_SIZE``, as a PyTorchJob sets it
    for one process per pod, or 1)."""
    return machines() if launched_by_torch_elastic() else _int_env("WORLD_SIZE", 1)


def check_machines() -> None:
    """Refuse a job the scheduler spread over N > 1 machines whose process group spans one: every machine would train
    alone on all the data, and exit 0."""
    said = scheduler_machines()
    if said is None or launched_machines() > 1:
        return
    name, count = said
    what = dict(SCHEDULER_MACHINES)[name]
    launched = (f"this launcher spans 1 (GROUP_WORLD_SIZE={machines()})" if launched_by_torch_elastic()
                else "this process is alone (no launcher, WORLD_SIZE unset)")
    raise ConfigError("num_machines", f"{name}={os.environ[name]} says {count} machines ({what}) but {launched}: "
                                      f"each machine would train alone on all the data; {FIX[name]}")


def check_restarts_supported() -> None:
    """Refuse restarts across machines on a store shared across attempts (they hang or fail)."""
    if max_restarts() > 0 and shares_agent_store() and machines() > 1:
        # The agent shares its rendezvous store with the ranks, across attempts
        # (docs/pitfalls.md#pytorch-135712-elastic-restarts-on-a-shared-store). On one machine
        # the ranks start their process group under a prefix of the attempt (toolkit.parallel.accelerator
        # ._process_group_per_elastic_attempt); across machines the agents' restart counts can differ (one that
        # restarts its workers for a joining node does not count it), so there each attempt needs a store of
        # its own: c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
        raise ConfigError(
            "max_restarts",
            "elastic restarts across machines need --rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "exported before the launcher on every machine; otherwise a restarted rank can connect to the dead "
            "attempt's addresses and hang or fail (torch 2.13, pytorch #135712)",
        )


# When a rank dies, torch elastic restarts every rank with the same command line and TORCHELASTIC_RESTART_COUNT > 0.
# Such a restart continues the attempt before it: an unset resume_from_checkpoint means 'latest' when output_dir
# holds a checkpoint, and so does a checkpoint named on the command line once the earlier attempt saved a newer one
# (resuming the named one again would redo the steps since and save their step-N again); the files the earlier
# attempt left are not "an earlier run" (no refusal). Only when output_dir/config.yaml, written when that attempt
# started, is this same config: if the first attempt was refused because output_dir held another run, the restart
# is refused the same way instead of quietly continuing that run.
def continue_restart(cfg) -> bool:
    """Whether ``cfg`` (a ``toolkit.config.RunConfig``) continues an earlier attempt of this same job; if so,
    ``resume_from_checkpoint`` becomes 'latest' when output_dir holds a checkpoint newer than the one it names (any,
    when it names none). Refuses what cannot restart."""
    check_restarts_supported()
    args = cfg.train
    restart = restart_count()
    if restart <= 0 or args.resume_from_checkpoint == layout.LATEST or not _config_written_by_this_job(cfg):
        return False
    named = args.resume_from_checkpoint
    checkpoint = layout.latest_checkpoint(args.output_dir)
    if checkpoint is not None and restart_resumes_latest(named, checkpoint):
        args.resume_from_checkpoint = layout.LATEST
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine, like accelerator.print
        if args.resume_from_checkpoint == layout.LATEST:
            what = f"resuming from {layout.LATEST} ({checkpoint})"
        else:
            what = f"resuming from {named} (no newer checkpoint yet)" if named else "no checkpoint yet: starting over"
        given = f"resume_from_checkpoint {named}" if named else "resume_from_checkpoint unset"
        print(f"elastic restart {restart}: {given}, {what}", file=sys.stderr, flush=True)
    return True


def restart_resumes_latest(named: str | None, latest: str) -> bool:
    """A restart resumes ``latest`` (its output_dir's newest checkpoint) rather than the checkpoint the command line
    names (None: none) when that one is newer: written at a later step, or the named one has no step recorded."""
    if named is None:
        return True
    named_step, latest_step = layout.checkpoint_step(named), layout.checkpoint_step(latest)
    if latest_step is None:
        return False
    return named_step is None or latest_step > named_step


def _config_written_by_this_job(cfg) -> bool:
    path = layout.path(cfg.train.output_dir, layout.CONFIG)
    try:
        with open(path) as f:
            written = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    mine = cfg.as_dict()
    if not isinstance(written, dict):
        return False
    # a restart that resumed wrote resume_from_checkpoint: latest; everything else must be equal, but for the fields
    # this command line leaves unset (None), which the earlier attempt's task resolved before it wrote its config
    # (disable_dropout: DPO's true, the others' false; toolkit.tasks.base.Task.defaults)
    written.pop("resume_from_checkpoint", None)
    mine.pop("resume_from_checkpoint", None)
    return set(written) == set(mine) and all(written[k] == v for k, v in mine.items() if v is not None)


record_launcher()  # at import: the earliest point every recipe passes through

"""The container command of scripts/k8s/pytorchjob.yaml and trainjob.yaml: one ``accelerate launch`` per pod, its
machines taken from the variables Kubeflow's operators set (accelerate launch reads none of them).

    python scripts/k8s/launch.py [--config_file accelerate_configs/X.yaml] RECIPE [recipe arguments...]

Variables (what sets each: scripts/k8s/README.md), the first one set wins:
    machines          PET_NNODES (both operators); WORLD_SIZE where PET_NNODES is absent (the v1 operator before 1.8,
                      where it counts pods)
    this machine      PET_NODE_RANK; RANK (v1)
    rendezvous host   PET_MASTER_ADDR (TrainJob); MASTER_ADDR (PyTorchJob)
    rendezvous port   PET_MASTER_PORT; MASTER_PORT; 29500
    ranks per pod     PET_NPROC_PER_NODE, read as torchrun reads it (an int, or auto / gpu / cpu); torchrun's 1
The launch is ``accelerate launch --config_file X --num_machines N --machine_rank R --main_process_ip ADDR
--main_process_port PORT --num_processes N x G RECIPE ...`` (static rendezvous: pod 0 hosts it), exec'd in place so
the operator's signals reach it. A bad or missing variable stops with one line and exit code 2 before anything runs.
"""

from __future__ import annotations

import os
import sys


def _fail(message: str) -> None:
    print(f"config error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _first(env: dict, *names: str) -> tuple[str, str] | tuple[None, None]:
    for name in names:
        if env.get(name, "") != "":
            return name, env[name]
    return None, None


def _int(name: str, value: str, low: int) -> int:
    if not value.isdigit() or int(value) < low:
        _fail(f"{name}={value!r}: expected an integer >= {low}")
    return int(value)


def ranks_per_pod(value: str) -> int:
    """PET_NPROC_PER_NODE as torchrun reads it (its own ``determine_local_world_size``)."""
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(value)
    except ValueError as e:
        _fail(f"PET_NPROC_PER_NODE={value!r}: {e}")


def accelerate_command(argv: list[str], env: dict) -> list[str]:
    """The ``accelerate launch`` command line this pod runs, from this script's arguments and the pod's variables."""
    head = []
    if len(argv) >= 2 and argv[0] == "--config_file":
        head, argv = argv[:2], argv[2:]
    if not argv or argv[0].startswith("-"):
        _fail("usage: launch.py [--config_file accelerate_configs/X.yaml] RECIPE [recipe arguments...]")
    name, value = _first(env, "PET_NNODES", "WORLD_SIZE")
    if name == "PET_NNODES" and ":" in value:
        _fail(f"PET_NNODES={value}: an elastic range (elasticPolicy min/maxReplicas); accelerate launch needs a fixed "
              "number of machines: drop elasticPolicy, or set minReplicas = maxReplicas")
    machines = _int(name, value, 1) if name else 1
    per_pod = ranks_per_pod(env.get("PET_NPROC_PER_NODE") or "1")
    launch = [sys.executable, "-m", "accelerate.commands.launch", *head]
    _, port = _first(env, "PET_MASTER_PORT", "MASTER_PORT")
    port = str(_int("PET_MASTER_PORT", port, 1)) if port else "29500"
    if machines > 1:
        rank_name, rank = _first(env, "PET_NODE_RANK", "RANK")
        _, host = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
        if rank_name is None or host is None:
            _fail(f"{name}={value} machines, but no PET_NODE_RANK/RANK or PET_MASTER_ADDR/MASTER_ADDR: run this in "
                  "a pod of a PyTorchJob or TrainJob (scripts/k8s/README.md), or set them")
        if _int(rank_name, rank, 0) >= machines:
            _fail(f"{rank_name}={rank} is not below the {machines} machines of {name}")
        launch += ["--num_machines", str(machines), "--machine_rank", rank, "--main_process_ip", host]
    return [*launch, "--main_process_port", port, "--num_processes", str(machines * per_pod), *argv]


def main() -> None:
    command = accelerate_command(sys.argv[1:], dict(os.environ))
    print("scripts/k8s/launch.py: " + " ".join(command[1:]), file=sys.stderr, flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()

"""Elastic restarts without a process: what an elastic restart does to the config (resume 'latest', no refusal of its
own files, an earlier different run still refused) and the refusal of restarts across machines on a store shared
across attempts. The real multi-machine and elastic runs are in tests/launch/test_multinode.py."""

import json
import os

import pytest
from helpers import ROOT, args_from

from toolkit import layout
from toolkit.config import ConfigError, parse_args, write_config

COMMON = dict(packing=False, block_size=48, shuffle=True, logging_steps=1, seed=7, report_to="none",
              per_device_eval_batch_size=3, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              lr_scheduler_type="constant", weight_decay=0, max_steps=3)
ELASTIC_ENV = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
               "GROUP_WORLD_SIZE")


@pytest.fixture
def restart(monkeypatch):
    """``restart(n, shared_store=False)``: from now on, be a rank that torch elastic started for attempt ``n``."""
    for name in ELASTIC_ENV:
        monkeypatch.delenv(name, raising=False)

    def become(count: int, shared_store: bool = False, machines: int = 1) -> None:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(shared_store))
        monkeypatch.setenv("GROUP_WORLD_SIZE", str(machines))

    return become


def _argv(tiny_model, padded_data, out, **extra) -> list[str]:
    return args_from({**COMMON, **padded_data, "model_name_or_path": tiny_model, "output_dir": out, **extra})


def _first_attempt(argv, out, checkpoint: bool) -> None:
    """What a first attempt leaves when it dies: config.yaml (as the run writes it: the task's defaults of the fields
    left unset resolved, e.g. disable_dropout), metrics.jsonl and maybe a checkpoint."""
    from toolkit.tasks.lm import CausalLM

    os.makedirs(out, exist_ok=True)
    cfg = parse_args(argv)
    CausalLM().apply_defaults(cfg)
    write_config(cfg, layout.path(out, layout.CONFIG))
    with open(layout.path(out, layout.METRICS), "w") as f:
        f.write('{"step": 1}\n')
    if checkpoint:
        os.makedirs(layout.step_dir(out, 1))


def test_elastic_restart_resumes_latest_of_its_own_attempt(tiny_model, padded_data, tmp_path, restart, capfd):
    out = str(tmp_path / "run")
    argv = _argv(tiny_model, padded_data, out)
    _first_attempt(argv, out, checkpoint=True)
    with pytest.raises(ConfigError, match="already holds checkpoints"):  # a plain relaunch is refused, as before
        parse_args(argv)
    restart(1)
    assert parse_args(argv).train.resume_from_checkpoint == layout.LATEST
    assert "elastic restart 1: resume_from_checkpoint unset, resuming from latest" in capfd.readouterr().err
    restart(2)  # the second restart reads the config.yaml the first one wrote (resume_from_checkpoint: latest)
    cfg = parse_args(argv)
    write_config(cfg, layout.path(out, layout.CONFIG))
    assert parse_args(argv).train.resume_from_checkpoint == layout.LATEST


def test_elastic_restart_before_any_checkpoint_starts_over(tiny_model, padded_data, tmp_path, restart):
    out = str(tmp_path / "run")
    argv = _argv(tiny_model, padded_data, out)
    _first_attempt(argv, out, checkpoint=False)
    with pytest.raises(ConfigError, match="holds the metrics.jsonl of an earlier run"):
        parse_args(argv)
    restart(1)
    assert parse_args(argv).train.resume_from_checkpoint is None  # its own metrics.jsonl is no "earlier run"


def test_elastic_restart_still_refuses_another_run(tiny_model, padded_data, tmp_path, restart):
    # The first attempt was refused because output_dir held another run (here: another learning rate); the restart
    # must not quietly continue that run.
    out = str(tmp_path / "run")
    _first_attempt(_argv(tiny_model, padded_data, out, learning_rate=0.1), out, checkpoint=True)
    restart(1)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        parse_args(_argv(tiny_model, padded_data, out))


def test_restarts_across_machines_on_a_store_shared_across_attempts_are_refused(tiny_model, padded_data, tmp_path,
                                                                                 restart):
    restart(0, shared_store=True)  # one machine: the ranks' process group takes a key space per attempt
    parse_args(_argv(tiny_model, padded_data, str(tmp_path / "one")))
    restart(0, shared_store=True, machines=2)  # static rendezvous, or c10d without TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        parse_args(_argv(tiny_model, padded_data, str(tmp_path / "two")))


def _saved(folder: str, step: int) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, layout.CHECKPOINT_STATE), "w") as f:
        f.write('{"loop": {"step": %d}}' % step)
    return folder


def test_elastic_restart_of_a_run_launched_from_a_named_checkpoint_resumes_its_own_latest(
        tiny_model, padded_data, tmp_path, restart, capfd):
    """issue 25, 4c: launched with --resume_from_checkpoint <another run's step-2>, the first attempt saved step 4
    and died; the restart resumes step-4 (not step-2 again: redone steps and a re-save of step-N)."""
    named = _saved(layout.step_dir(str(tmp_path / "earlier"), 2), 2)
    out = str(tmp_path / "run")
    argv = _argv(tiny_model, padded_data, out, resume_from_checkpoint=named, trust_checkpoint=True)
    restart(0)
    _first_attempt(argv, out, checkpoint=False)
    restart(1)  # no checkpoint of its own yet: the named one again
    assert parse_args(argv).train.resume_from_checkpoint == named
    _saved(layout.step_dir(out, 4), 4)
    assert parse_args(argv).train.resume_from_checkpoint == layout.LATEST
    assert f"elastic restart 1: resume_from_checkpoint {named}, resuming from latest" in capfd.readouterr().err
    restart(0)  # the first attempt of a new job: refused, output_dir holds another run
    with pytest.raises(ConfigError, match="resume_from_checkpoint: .* not a checkpoint of output_dir"):
        parse_args(argv)


@pytest.mark.parametrize("named_step, latest_step, resumes_latest", [
    (None, 3, True),  # nothing named: the latest
    (2, 4, True), (4, 4, False), (6, 4, False),  # the named one unless the latest is newer
])
def test_which_checkpoint_an_elastic_restart_resumes(tmp_path, named_step, latest_step, resumes_latest):
    from toolkit.env.elastic import restart_resumes_latest

    named = None if named_step is None else _saved(str(tmp_path / "named"), named_step)
    assert restart_resumes_latest(named, _saved(str(tmp_path / "latest"), latest_step)) is resumes_latest


def test_the_launcher_is_recorded_when_the_process_starts_not_when_train_does(monkeypatch):
    """issue 25, 4d: a launcher that dies during tokenization or model loading re-parents the rank before train()
    builds its Preemption; recorded then, the new parent passed for the launcher and the orphan trained on. The pid
    is the one of make_accelerator (a notebook_launcher rank's first toolkit call) or of the import."""
    from toolkit.config import TrainingArguments
    from toolkit.env import elastic
    from toolkit.parallel.accelerator import make_accelerator
    from toolkit.training.preemption import Preemption

    parent = {"pid": 111}
    monkeypatch.setattr(os, "getppid", lambda: parent["pid"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(elastic, "_LAUNCHERS", {os.getpid() + 1: 5},  # a parent's record, inherited by fork
                        raising=False)
    from toolkit.parallel import accelerator as distributed

    def stop_here():  # make_accelerator's next call: no Accelerator needed to see what was recorded before it
        raise RuntimeError("stop")

    monkeypatch.setattr(distributed, "launched_strategy", stop_here)
    with pytest.raises(RuntimeError, match="stop"):
        make_accelerator(TrainingArguments(report_to="none"))
    parent["pid"] = 1  # the launcher died while the model loaded: re-parented to init
    preemption = Preemption()
    try:
        assert preemption._launcher == 111 and preemption.launcher_gone() and preemption.reason() == "launcher gone"
    finally:
        preemption.restore()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert elastic.launcher_pid() is None  # a plain process has no launcher to lose


def test_the_first_rank_of_an_attempt_to_fail_reports_and_the_others_do_not(monkeypatch, tmp_path):
    """issue 25, point 6: every rank meets the same config error, and each printed it (two glued on one line); the
    first rank of a machine's attempt to fail reports, through a file in torch elastic's attempt folder (the
    folder of every rank's TORCHELASTIC_ERROR_FILE folder). The real 2-rank launch: tests/launch/test_launcher_errors.py."""
    from toolkit.env import elastic

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert elastic.first_to_report("config-error") and elastic.first_to_report("config-error")  # a plain process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    attempt = tmp_path / "none_abc" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
    reports = []
    for rank in (1, 0):  # rank 1 fails first
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / str(rank) / "error.json"))
        reports.append(elastic.first_to_report("config-error"))
    assert reports == [True, False]
    assert elastic.first_to_report("training-stopped")  # another kind of error is reported on its own
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "0" / "error.json"))
    assert elastic.first_to_report("config-error")  # no attempt folder: report rather than lose the line


# ------------------------------------------------------------------------------ a scheduler's machines, one group
SCHEDULER_ENV = ("PET_NNODES", "SLURM_STEP_NUM_NODES", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "WORLD_SIZE")


@pytest.mark.parametrize("scheduler, launch, refused", [
    # Kubeflow (PyTorchJob, TrainJob): accelerate launch without --num_machines in each of 2 pods
    ({"PET_NNODES": "2"}, {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "1"}, "PET_NNODES=2 says 2 machines"),
    ({"PET_NNODES": "2:4"}, {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "1"}, "PET_NNODES=2:4"),
    ({"PET_NNODES": "2"}, {}, "this process is alone"),  # python recipe.py in each pod of a TrainJob
    ({"SLURM_STEP_NUM_NODES": "2"}, {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "1"}, "scripts/slurm.sbatch"),
    # what runs right: scripts/k8s/launch.py's launch, torchrun reading PET_*, one process per pod, an elastic range
    # starting at 1, one pod, one node
    ({"PET_NNODES": "2"}, {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "2"}, None),
    ({"PET_NNODES": "2"}, {"WORLD_SIZE": "2"}, None),
    ({"PET_NNODES": "1:4"}, {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "1"}, None),
    ({"PET_NNODES": "1"}, {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "1"}, None),
    ({"SLURM_STEP_NUM_NODES": "2"}, {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "2"}, None),
    ({"SLURM_STEP_NUM_NODES": "1"}, {}, None),
])
def test_a_scheduler_saying_several_machines_to_a_one_machine_launch_is_refused(monkeypatch, scheduler, launch,
                                                                                 refused):
    """issue 29, point 2: the scheduler says N > 1 machines (PET_NNODES, SLURM_STEP_NUM_NODES) but the process group
    spans one (GROUP_WORLD_SIZE under a launcher, WORLD_SIZE without): each machine would train alone, so it is
    refused, naming the variables and the fix."""
    from toolkit.env.elastic import check_machines

    for name in SCHEDULER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**scheduler, **launch}.items():
        monkeypatch.setenv(name, value)
    if refused is None:
        check_machines()
        return
    with pytest.raises(ConfigError) as raised:
        check_machines()
    message = str(raised.value)
    assert message.startswith("num_machines: ") and refused in message and "train alone" in message, message


def test_the_scheduler_check_runs_when_a_config_is_parsed(tiny_model, padded_data, tmp_path, monkeypatch):
    for name in SCHEDULER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PET_NNODES", "2")
    with pytest.raises(ConfigError, match="num_machines: PET_NNODES=2 says 2 machines"):
        parse_args(_argv(tiny_model, padded_data, str(tmp_path / "run")))


# ------------------------------------------------------------------------------ Kubernetes: manifests, entrypoint
K8S = os.path.join(ROOT, "scripts", "k8s")


def _k8s_launch():
    import importlib.util

    spec = importlib.util.spec_from_file_location("k8s_launch", os.path.join(K8S, "launch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _containers(doc: dict) -> list[dict]:
    if doc["kind"] == "PyTorchJob":
        return [c for r in doc["spec"]["pytorchReplicaSpecs"].values() for c in r["template"]["spec"]["containers"]]
    return [doc["spec"]["trainer"]]


@pytest.mark.parametrize("manifest, kind", [("pytorchjob.yaml", "PyTorchJob"), ("trainjob.yaml", "TrainJob")])
def test_the_manifests_parse_and_run_the_entrypoint_on_a_shipped_config(manifest, kind):
    import yaml

    doc = yaml.safe_load(open(os.path.join(K8S, manifest)))
    assert doc["kind"] == kind
    for container in _containers(doc):
        command = container["command"]
        assert command[0] == "python" and command[1].endswith("scripts/k8s/launch.py"), command
        config, recipe = command[3].split("toolkit/")[-1], command[4].split("toolkit/")[-1]
        assert command[2] == "--config_file" and os.path.isfile(os.path.join(ROOT, config)), command
        assert os.path.isfile(os.path.join(ROOT, recipe)), command
    if kind == "PyTorchJob":  # the operator sets MASTER_PORT from the container and port of these names
        assert {c["name"] for c in _containers(doc)} == {"pytorch"}
        assert all(p["name"] == "pytorchjob-port" for c in _containers(doc) for p in c["ports"])


# The variables each operator sets in pod 1 of 2 pods x 8 GPUs (scripts/k8s/README.md says where they were read).
TRAINER_V2 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
              "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"}
OPERATOR_V1 = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "16", "RANK": "1",
               "PET_NODE_RANK": "1", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "8"}
OPERATOR_V1_OLD = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1"}


@pytest.mark.parametrize("env, host, port, per_pod", [
    (TRAINER_V2, "job-node-0-0.job", "29500", 8), (OPERATOR_V1, "job-master-0", "23456", 8),
    (OPERATOR_V1_OLD, "job-master-0", "23456", 1),  # before 1.8: no PET_*, WORLD_SIZE counts pods; torchrun's 1
])
def test_the_entrypoint_passes_each_operators_machines_to_accelerate_launch(env, host, port, per_pod):
    command = _k8s_launch().accelerate_command(["--config_file", "zero3.yaml", "recipes/gpt2.py", "--seed", "3"], env)
    assert command[1:] == ["-m", "accelerate.commands.launch", "--config_file", "zero3.yaml", "--num_machines", "2",
                           "--machine_rank", "1", "--main_process_ip", host, "--main_process_port", port,
                           "--num_processes", str(2 * per_pod), "recipes/gpt2.py", "--seed", "3"]


@pytest.mark.parametrize("env, words", [
    ({**TRAINER_V2, "PET_NNODES": "1:4"}, "PET_NNODES=1:4: an elastic range"),
    ({**TRAINER_V2, "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 is not below the 2 machines"),
    ({**TRAINER_V2, "PET_NPROC_PER_NODE": "many"}, "PET_NPROC_PER_NODE='many'"),
    ({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8"}, "no PET_NODE_RANK/RANK or PET_MASTER_ADDR/MASTER_ADDR"),
])
def test_the_entrypoint_refuses_what_it_cannot_launch(env, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        _k8s_launch().accelerate_command(["recipes/gpt2.py"], env)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("config error: ") and words in err, err


# ------------------------------------------------------------------------------ Ray: what the workers are given
def _ray_train():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ray_train", os.path.join(ROOT, "scripts", "ray_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ray_train_gives_its_workers_the_launch_configs_variables_and_the_recipe_its_arguments():
    """issue 29, point 1: the variables accelerate launch would set for the config (accelerate's own code), without
    what Ray sets per worker; the recipe's arguments untouched, --config included."""
    ray_train = _ray_train()
    args = ray_train.parse(["--num-workers", "2", "--config_file", "zero3.yaml", "recipes/sft.py", "--config", "c.yaml",
                            "--num-workers", "9"])
    assert (args.num_workers, args.recipe, args.recipe_args) == (2, "recipes/sft.py", ["--config", "c.yaml",
                                                                                         "--num-workers", "9"])
    zero3, fsdp, ddp = (ray_train.launch_env(os.path.join(ROOT, "accelerate_configs", c), 2)
                        for c in ("zero3.yaml", "fsdp.yaml", "ddp.yaml"))
    assert (zero3["ACCELERATE_USE_DEEPSPEED"], zero3["ACCELERATE_DEEPSPEED_ZERO_STAGE"]) == ("true", "3")
    assert (fsdp["ACCELERATE_USE_FSDP"], fsdp["FSDP_VERSION"]) == ("true", "2")
    assert not any(k.startswith(("ACCELERATE_USE_", "FSDP_")) for k in ddp) and ddp["ACCELERATE_MIXED_PRECISION"] == "no"
    assert not set(ray_train.RAY_OWNS) & (set(zero3) | set(fsdp) | set(ddp))
    assert ray_train.launch_env(None, 2) == {}


def test_ray_train_sends_the_launch_configs_whole_environment_whatever_the_driver_holds(monkeypatch):
    """A worker on another machine has only its node's environment: the launch config's variables go to it all, also
    those the driver holds with the same values (they were left out: FSDP exported in the driver trained plain DDP on
    the workers), and nothing else of the driver's."""
    ray_train = _ray_train()
    fsdp_config = os.path.join(ROOT, "accelerate_configs", "fsdp.yaml")
    clean = ray_train.launch_env(fsdp_config, 2)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("TOOLKIT_DRIVER_ONLY", "1")
    before = dict(os.environ)
    fsdp = ray_train.launch_env(fsdp_config, 2)
    assert (fsdp["ACCELERATE_USE_FSDP"], fsdp["FSDP_VERSION"], fsdp["ACCELERATE_MIXED_PRECISION"]) == ("true", "2", "no")
    assert fsdp == clean and "TOOLKIT_DRIVER_ONLY" not in fsdp and "PATH" not in fsdp
    assert dict(os.environ) == before  # the driver's own environment is back as it was


def test_a_restarted_ray_group_resumes_the_checkpoint_ray_reported(tmp_path):
    """Every worker of a group decides from the pointer Ray hands it (``ray.train.get_checkpoint()``, the same on every
    rank): none, the first attempt with the recipe's arguments as given; else the next attempt, resuming the
    checkpoint the pointer names, or (a restart before the first save) the arguments as given."""
    pytest.importorskip("ray", reason="ray is not installed")
    from ray.train import Checkpoint

    ray_train = _ray_train()
    args = ["--config", "c.yaml", "--output_dir", "/runs/x"]
    step1 = {"checkpoint": "/runs/x/checkpoints/step-1", "step": 1, "attempt": 0}
    pointer = tmp_path / "pointer"
    pointer.mkdir()
    (pointer / ray_train.POINTER).write_text(json.dumps(step1))
    assert ray_train.reported_checkpoint(Checkpoint.from_directory(str(pointer))) == step1
    assert ray_train.reported_checkpoint(None) is None
    assert ray_train.restart(None, args) == (0, args)
    assert ray_train.restart(step1, args) == (1, [*args, "--resume_from_checkpoint", "/runs/x/checkpoints/step-1"])
    assert ray_train.restart({"checkpoint": None, "step": None, "attempt": 1}, args) == (2, args)


def test_a_config_error_survives_pickling_as_a_ray_worker_sends_it():
    """A ConfigError raised in a Ray Train worker (data checks run there, after the driver's parse) travels to the
    driver pickled; before __reduce__ it arrived as 'TypeError: ConfigError.__init__() missing 1 required positional
    argument' (measured with a restart the toolkit was not told of)."""
    import pickle

    error = pickle.loads(pickle.dumps(ConfigError("text_column_name", "'body' not in the data")))
    assert (type(error), error.field_name, str(error)) == (ConfigError, "text_column_name",
                                                           "text_column_name: 'body' not in the data")

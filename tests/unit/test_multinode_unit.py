"""Elastic restarts without a process: what an elastic restart does to the config (resume 'latest', no refusal of its
own files, an earlier different run still refused) and the refusal of restarts across machines on a store shared
across attempts. The real multi-machine and elastic runs are in tests/launch/test_multinode.py."""

import os

import pytest
from helpers import args_from

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
    """What a first attempt leaves when it dies: config.yaml, metrics.jsonl and maybe a checkpoint."""
    os.makedirs(out, exist_ok=True)
    write_config(parse_args(argv), layout.path(out, layout.CONFIG))
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
    from toolkit.elastic import restart_resumes_latest

    named = None if named_step is None else _saved(str(tmp_path / "named"), named_step)
    assert restart_resumes_latest(named, _saved(str(tmp_path / "latest"), latest_step)) is resumes_latest


def test_the_launcher_is_recorded_when_the_process_starts_not_when_train_does(monkeypatch):
    """issue 25, 4d: a launcher that dies during tokenization or model loading re-parents the rank before train()
    builds its Preemption; recorded then, the new parent passed for the launcher and the orphan trained on. The pid
    is the one of make_accelerator (a notebook_launcher rank's first toolkit call) or of the import."""
    from toolkit import elastic
    from toolkit.config import TrainingArguments
    from toolkit.distributed import make_accelerator
    from toolkit.preemption import Preemption

    parent = {"pid": 111}
    monkeypatch.setattr(os, "getppid", lambda: parent["pid"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(elastic, "_LAUNCHERS", {os.getpid() + 1: 5},  # a parent's record, inherited by fork
                        raising=False)
    from toolkit import distributed

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
    from toolkit import elastic

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

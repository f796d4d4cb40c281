"""``toolkit train TASK``: one command for a run, its whole configuration checked here before anything is launched.

    toolkit train sft --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset data/my_chats.jsonl --strategy zero3 --num_processes 8
    toolkit train lm --config recipes/configs/smollm2_pydoc.yaml --strategy ddp --num_processes 2
    toolkit train dpo --help

TASK is ``lm``, ``sft``, ``dpo``, ``classify`` or ``grpo``: the recipe ``recipes/gpt2.py``, ``sft.py``, ``dpo.py``,
``classify.py`` or ``grpo.py``, found beside the package in a checkout and inside it in an installed wheel. ``--model`` names
``model_name_or_path``; ``--dataset`` a local file or glob (``train_file``) or a Hub dataset (``dataset_name``); every
recipe field and ``--config`` are taken as the recipe takes them. ``--strategy`` is a shipped launch config (ddp,
zero2, zero3, zero3_offload, fsdp, fsdp1, hsdp, tp) or a path to one; ``--num_processes`` (the total over every
machine) defaults to the visible GPUs, and without one to what the launch config says; accelerate's
``--num_machines``, ``--machine_rank``, ``--main_process_ip``, ``--main_process_port``, ``--rdzv_backend`` and
``--max_restarts`` are passed on (``LAUNCHER_OPTIONS``).

Before launching, in this process: the launch options (``check_launcher``), the fields (as the recipe parses them),
the launch environment ``accelerate launch`` would give the ranks (strategy x fields x world size:
``distributed.check_launch``; restarts across machines: ``elastic.check_restarts_supported``), and everything a rank
runs before its weights load, by the ranks' own code (``build.build_data``: the tokenizer and chat template, the
model's config, the data's files, columns and format, a tensor-parallel split, the data tokenized and one global
batch of it), and a resume's refusals that read only the checkpoint's files (``resume_from_checkpoint``: another LoRA
layout, quantized base, optimizer, sample order or global batch, or a format this launch cannot load:
``checkpointing.check_resume_before_launch``). A mistake is one line and exit code 2, with no launcher traceback.
Then ``accelerate launch`` runs the recipe, and its exit code is this command's.

The tokenization's cost: a file or Hub dataset is tokenized here once through ``datasets``' cache, which rank 0 then
reads instead of tokenizing it again (the same fingerprints: ``data.map_with_tokenizer``), so a large set costs its
tokenization once, here rather than in rank 0, and the ranks start from the cache; a built-in set (made in memory)
is tokenized again in the ranks. A stream is not read through: its first window (``shuffle_buffer_size`` rows) and
its validation rows, as a rank reads them before its weights.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import subprocess
import sys
from contextlib import contextmanager

from toolkit.config import help as config_help
from toolkit.errors import ConfigError

# toolkit train's TASK -> the task's name (Task.name; config_help.TASK_RECIPES has its recipe) and class
TASKS = {"lm": "causal-lm", "sft": "chat-sft", "dpo": "dpo", "classify": "sequence-classification", "grpo": "grpo"}
TASK_CLASSES = {"causal-lm": "toolkit.tasks.lm:CausalLM", "chat-sft": "toolkit.tasks.sft:ChatSFT",
                "dpo": "toolkit.tasks.dpo:DPO", "sequence-classification": "toolkit.tasks.classification:SequenceClassification",
                "grpo": "toolkit.tasks.grpo.task:GRPO"}
# the data each task reads (docs/recipes.md#dataset-formats)
TASK_DATA = {"causal-lm": "text (a 'text' column, or text_column_name); a .txt file: one document a line",
             "chat-sft": "messages, sharegpt (conversations of {from, value}), prompt_completion (text or messages), "
                         "alpaca (instruction, input, output)",
             "dpo": "preference (prompt, chosen, rejected: text or messages), implicit_preference (chosen and "
                    "rejected chats sharing their first turns)",
             "sequence-classification": "a text column (text_column_name) and a label column (label_column_name)",
             "grpo": "prompt-only (prompt: text or messages); every other column reaches the reward functions"}
STRATEGIES = ("ddp", "zero2", "zero3", "zero3_offload", "fsdp", "fsdp1", "hsdp", "tp")
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".txt", ".parquet")


def packaged(folder: str, name: str) -> str:
    """``folder/name`` of the project (recipes, accelerate_configs): beside the package in a source checkout, inside
    it in an installed wheel (setup.py ships both as toolkit.recipes and toolkit.accelerate_configs)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # toolkit/, above this cli/
    for candidate in (os.path.join(os.path.dirname(package), folder, name), os.path.join(package, folder, name)):
        if os.path.exists(candidate):
            return candidate
    return os.path.join(package, folder, name)


def strategy_config(strategy: str) -> str:
    """A shipped launch config by name, or a path; refused with one line otherwise."""
    if strategy in STRATEGIES:
        return packaged("accelerate_configs", f"{strategy}.yaml")
    if os.path.isfile(strategy):
        return strategy
    raise ConfigError("strategy", f"{strategy!r} is neither a shipped launch config ({', '.join(STRATEGIES)}) nor a "
                                  "file; name one of those or give the path of an accelerate config")


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad value of one of these options as one ConfigError naming it (argparse would print its
    usage and exit)."""

    def error(self, message):
        name, _, rest = message.partition(": ")
        if name.startswith("argument --"):
            raise ConfigError(name[len("argument --"):].split("/")[0].strip(), rest)
        raise ConfigError(None, message)


# accelerate launch's own options that toolkit train passes on as given (after checking them: ``check_launcher``);
# docs/multinode.md says what each does across machines
LAUNCHER_OPTIONS = {
    "num_machines": dict(type=int, help="machines in the job (accelerate's; --num_processes is then the total over "
                                        "them; default 1)"),
    "machine_rank": dict(type=int, help="this machine's rank, 0 to num_machines - 1 (default 0)"),
    "main_process_ip": dict(help="the address of the machine of rank 0 (needed with num_machines > 1)"),
    "main_process_port": dict(type=int, help="the port of the main process: two runs on one machine need two "
                                             "(0: a free one; default: accelerate's, 29500 unless taken)"),
    "rdzv_backend": dict(choices=("static", "c10d"), help="torch elastic's rendezvous (default: static)"),
    "max_restarts": dict(type=int, help="torch elastic's restarts of every rank when one dies (default 0)"),
}


def parser(task: str | None = None) -> argparse.ArgumentParser:
    """toolkit train's own options; the rest of the command line is the recipe's."""
    p = _Parser(prog=f"toolkit train {task or 'TASK'}", add_help=False, allow_abbrev=False)
    p.add_argument("--strategy", default="ddp", help=f"a launch config: {', '.join(STRATEGIES)}, or a path (default: "
                                                     "ddp)")
    p.add_argument("--num_processes", type=int, default=None,
                   help="processes to launch, over every machine (default: the visible GPUs; without one, the launch "
                        "config's)")
    p.add_argument("--mixed_precision", default=None, choices=("no", "bf16", "fp16"),
                   help="accelerate's mixed precision (default: the launch config's)")
    for name, kwargs in LAUNCHER_OPTIONS.items():
        p.add_argument(f"--{name}", default=None, **kwargs)
    p.add_argument("--model", default=None, help="model_name_or_path: a Hub name or a local folder")
    p.add_argument("--dataset", default=None, help="a local file or glob (train_file) or a Hub dataset (dataset_name)")
    return p


def check_launcher(opts: argparse.Namespace) -> None:
    """The launch options' values and combinations, each refused in one line naming the option (accelerate would
    take some of them and fail later: ``--num_processes 0`` launched the default count)."""
    if opts.num_processes is not None and opts.num_processes < 1:
        raise ConfigError("num_processes", f"must be at least 1, got {opts.num_processes}")
    machines = 1 if opts.num_machines is None else opts.num_machines
    if machines < 1:
        raise ConfigError("num_machines", f"must be at least 1, got {machines}")
    if opts.machine_rank is not None and not 0 <= opts.machine_rank < machines:
        raise ConfigError("machine_rank", f"must be in [0, {machines - 1}] with num_machines {machines}, got "
                                          f"{opts.machine_rank}")
    if opts.main_process_port is not None and not 0 <= opts.main_process_port <= 65535:
        raise ConfigError("main_process_port", f"must be a port in [1, 65535] (or 0: a free one), got "
                                               f"{opts.main_process_port}")
    if opts.max_restarts is not None and opts.max_restarts < 0:
        raise ConfigError("max_restarts", f"must be 0 or more, got {opts.max_restarts}")
    if machines > 1:
        if opts.num_processes is None:
            raise ConfigError("num_processes", f"with num_machines {machines}, give the total processes over every "
                                               "machine (accelerate's num_processes), e.g. machines x GPUs a machine")
        if opts.num_processes % machines:
            raise ConfigError("num_processes", f"{opts.num_processes} processes do not split evenly over num_machines "
                                               f"{machines} (num_processes is the total over every machine)")
        if not opts.main_process_ip:
            raise ConfigError("main_process_ip", f"num_machines {machines} needs the address of the machine of rank "
                                                 "0 on every machine")


def launcher_argv(opts: argparse.Namespace) -> list[str]:
    """The launch options given (LAUNCHER_OPTIONS), as accelerate launch takes them."""
    return [token for name in LAUNCHER_OPTIONS if getattr(opts, name) is not None
            for token in (f"--{name}", str(getattr(opts, name)))]


def is_local_data(name: str) -> bool:
    """A file, a glob of files or a path-like name with a data suffix: a train_file, not a Hub dataset's name."""
    return os.path.exists(name) or bool(glob.glob(name)) or name.lower().endswith(DATA_SUFFIXES)


def recipe_argv(opts: argparse.Namespace, rest: list[str]) -> list[str]:
    """The recipe's command line: ``--model`` and ``--dataset`` in the fields' own names, then the rest as given."""
    argv = []
    if opts.model is not None:
        argv += ["--model_name_or_path", opts.model]
    if opts.dataset is not None:
        local = is_local_data(opts.dataset)
        argv += ["--train_file", opts.dataset, "--dataset_name", "null"] if local else ["--dataset_name", opts.dataset]
    return argv + rest


def default_processes(config_file: str) -> int:
    """The visible GPUs, or without one what the launch config says (1 if it says nothing)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    import yaml

    with open(config_file) as f:
        return int((yaml.safe_load(f) or {}).get("num_processes", 1))


def launch_env(config_file: str, processes: int) -> dict[str, str]:
    """The variables ``accelerate launch --config_file X --num_processes N`` sets for its ranks, from accelerate's own
    code: all of them, also those this process already holds (a worker on another machine has only the environment
    its node was started with). Empty for a config that launches one plain process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = ["--config_file", config_file, "--num_processes", str(processes), "--num_machines", "1",
            "--main_process_port", "0", "toolkit"]
    args, defaults, mixed_precision_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_deepspeed:  # what accelerate's launch_command adds before its deepspeed_launcher
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(
            fields + (["mixed_precision"] if mixed_precision_from_config else []))
        prepare = lambda: prepare_deepspeed_cmd_env(args)[1]  # noqa: E731
    elif args.use_fsdp or args.multi_gpu:
        prepare = lambda: prepare_multi_gpu_env(args)  # noqa: E731
    else:
        return {}
    with environment({}):  # accelerate starts from a copy of os.environ: only what it sets is left
        return dict(prepare())


@contextmanager
def environment(values: dict[str, str]):
    """os.environ replaced by ``values`` for the block, restored after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check(task: str, config_file: str, processes: int, argv: list[str], mixed_precision: str | None = None,
          launcher: argparse.Namespace | None = None) -> None:
    """Everything a rank of this launch would refuse before its weights load, here, in this process (module
    docstring); ``launcher``: toolkit train's options (``LAUNCHER_OPTIONS``). Raises ConfigError."""
    from toolkit.config import parse_args

    cfg = parse_args(argv, task=task)  # the fields, as the recipe parses them
    env = {**os.environ, **launch_env(config_file, processes), "WORLD_SIZE": str(processes),
           **_elastic_env(launcher)}
    if mixed_precision:
        env["ACCELERATE_MIXED_PRECISION"] = mixed_precision
    with environment(env), _quiet_datasets():  # a rank's environment, for the checks that read it
        from toolkit.checkpointing import check_resume_before_launch
        from toolkit.env.elastic import check_restarts_supported
        from toolkit.env.launcher import launched_data_parallel_size, launched_parallel_sizes, launched_strategy_name
        from toolkit.parallel.accelerator import check_launch
        from toolkit.training.build import build_data

        check_restarts_supported()  # what a rank checks as its config parses (elastic.continue_restart), in its env
        check_launch(cfg.train)
        module, name = TASK_CLASSES[task].split(":")
        task_object = getattr(importlib.import_module(module), name)()
        ranks = launched_data_parallel_size(cfg.train.pipeline_parallel_size * cfg.train.split_size)
        # what every rank runs before its weights load, tokenization included (build.build_data): its datasets cache
        # is then the ranks' (a stream: its first window and validation rows, read again by each rank)
        lm = build_data(cfg, task_object, lambda *a, **k: None, strategy=launched_strategy_name(),
                        tp_size=launched_parallel_sizes().get("tp", 1), data_parallel=ranks)[2]
        # and the resume's refusals that read only the checkpoint's files (the ranks' plan_resume, without its
        # Accelerator): another LoRA rank, alpha or global batch is one line here, not a refusal in every rank
        check_resume_before_launch(cfg, lm["train"], task_object.sample_repeats(cfg), processes, ranks)


def _elastic_env(launcher: argparse.Namespace | None) -> dict[str, str]:
    """What torch elastic's agent tells each rank of a launch with ``--max_restarts`` (``toolkit.env.elastic`` reads it):
    the restarts, the machines, and whether the ranks share the agent's store across attempts (torch's
    ``use_agent_store``: always under the static rendezvous, under c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    if launcher is None or not launcher.max_restarts:
        return {}
    shared = launcher.rdzv_backend in (None, "static") or os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
    return {"TORCHELASTIC_MAX_RESTARTS": str(launcher.max_restarts), "GROUP_WORLD_SIZE": str(launcher.num_machines or 1),
            "TORCHELASTIC_USE_AGENT_STORE": str(shared)}


@contextmanager
def _quiet_datasets():
    """datasets' progress bars off while the data is checked: the ranks draw them again for the same files; and its
    log's errors (a JSON file it cannot parse: our ConfigError names the line, in the one line this prints)."""
    from datasets.utils import logging

    shown, level = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if shown:
            logging.enable_progress_bar()


def help_text(short: str) -> str:
    """``toolkit train TASK --help``: what the task trains, the data formats it reads, this command's options, then
    the task's fields only (``config_help``)."""
    from toolkit.config import ARGUMENT_CLASSES

    task = TASKS[short]
    recipe = packaged("recipes", config_help.TASK_RECIPES[task])
    with open(recipe) as f:
        doc = f.read().split('"""')[1]
    description = f"{config_help.first_paragraph(doc)} Data formats: {TASK_DATA[task]}."
    prog = f"toolkit train {short}"
    return config_help.help_text(ARGUMENT_CLASSES, task, description, prog, options=parser(short),
                                 usage=f"{prog} [--strategy S] [--num_processes N] [--model M] [--dataset D] "
                                       "[--config FILE.yaml] [--FIELD VALUE ...]")


def unknown_task(name: str) -> str:
    """One line for a TASK toolkit train does not know: the tasks, and the closest one (or the one a task's long
    name belongs to: ``chat-sft`` is ``sft``)."""
    from toolkit.config.checks import _closest

    close = {long: short for short, long in TASKS.items()}.get(name) or _closest(name, TASKS)
    hint = f"; did you mean '{close}'?" if close else ""
    return f"config error: TASK: {name!r} is not a task of toolkit train, which takes {', '.join(TASKS)}{hint}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: toolkit train TASK [--strategy S] [--num_processes N] [--model M] [--dataset D] [recipe "
              f"fields ...]\nTASK: {', '.join(TASKS)}; 'toolkit train TASK --help' lists its fields", file=sys.stderr)
        return 0 if argv else 2
    if argv[0] not in TASKS:
        sys.stderr.write(unknown_task(argv[0]) + "\n")
        return 2
    short, rest = argv[0], argv[1:]
    if "-h" in rest or "--help" in rest:
        sys.stdout.write(help_text(short))
        return 0
    try:
        opts, rest = parser(short).parse_known_args(rest)
        check_launcher(opts)
        config_file = strategy_config(opts.strategy)
        processes = opts.num_processes if opts.num_processes is not None else default_processes(config_file)
        fields = recipe_argv(opts, rest)
        check(TASKS[short], config_file, processes, fields, opts.mixed_precision, launcher=opts)
    except ConfigError as e:
        sys.stderr.write(f"config error: {e}\n")
        return 2
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
               "--num_processes", str(processes), *launcher_argv(opts)]
    command += ["--mixed_precision", opts.mixed_precision] if opts.mixed_precision else []
    recipe = packaged("recipes", config_help.TASK_RECIPES[TASKS[short]])
    print(f"checked; launching: accelerate launch {' '.join(command[3:])} {recipe} {' '.join(fields)}", flush=True)
    return subprocess.call([*command, recipe, *fields])

"""A recipe's ``--help``, and which recipe takes a field: what a task's metadata on a config field means.

A field that only some tasks use says so in its metadata, ``metadata={"tasks": ("dpo",), ...}`` (the names are the
tasks' ``Task.name``); a field without it is every recipe's. The rule, for every task: a field the task does not use
(ignores) is not listed for it, so that setting it is refused instead of silently doing nothing (GRPO's held-out
evaluation fields, a classifier's dataset_format). ``"task_checks": True``: the other tasks refuse it themselves
(``Task.check``, saying why), so ``unused_field`` lets it through to them. ``toolkit.config`` keeps every field in
one place and asks this module two things: the help text of one recipe (its description, ``--config``, then its own
fields grouped model / data / training), and whether a field given to a recipe belongs to another one
(``unused_field``: when a recipe parses its config, and again in ``toolkit.training.build.check_inputs`` for a config built
without a recipe, a notebook's).

Standard library only (argparse formats the text): nothing here touches a field's value, and ``--help`` loads
neither transformers nor torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

# Task.name -> the recipe that trains it (recipes/<name>.py)
TASK_RECIPES = {"causal-lm": "gpt2.py", "chat-sft": "sft.py", "dpo": "dpo.py", "sequence-classification": "classify.py",
                "grpo": "grpo.py"}
GROUP_TITLES = {"ModelArguments": "model", "DataArguments": "data", "TrainingArguments": "training"}
METAVARS = {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}


def field_tasks(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The tasks a field belongs to, or None: every task's."""
    return f.metadata.get("tasks")


def takes(f: dataclasses.Field, task: str | None) -> bool:
    """Whether a recipe of ``task`` uses the field (no task: a notebook, a script: every field)."""
    tasks = field_tasks(f)
    return task is None or tasks is None or task in tasks


def refuses(f: dataclasses.Field, task: str | None, value) -> bool:
    """Whether a recipe of ``task`` refuses the field as parsed: another task's field, set to other than its default.
    A field whose metadata says ``task_checks`` is left to the tasks that do not take it: their ``Task.check`` says
    why (DPO on a stream), and accepts the value that turns it off (``packing: false``)."""
    return not takes(f, task) and value != f.default and not f.metadata.get("task_checks")


def unused_field(groups, task: str | None) -> tuple[str, str] | None:
    """(field, message) of the first field the recipe of ``task`` does not use set to other than its default, which
    the caller refuses (``ConfigError``): the recipe would ignore it. A default value passes, so that a run's own
    config.yaml (every field) parses again. No task, or one of no recipe here (a notebook's own Task): None."""
    if task not in TASK_RECIPES:
        return None
    for group in groups:
        for f in dataclasses.fields(group):
            if f.init and refuses(f, task, getattr(group, f.name)):
                return f.name, f"is a field of {recipes_of(f)}; recipes/{TASK_RECIPES[task]} does not use it: delete it"
    return None


def recipes_of(f: dataclasses.Field) -> str:
    """The recipes that take a field, for a message: 'recipes/dpo.py' or 'recipes/sft.py, recipes/dpo.py'."""
    return ", ".join(f"recipes/{TASK_RECIPES[t]}" for t in field_tasks(f) or TASK_RECIPES)


def recipe_task(path: str) -> str | None:
    """The task of a recipe script by its file name (recipes/dpo.py -> 'dpo'); None for a script of one's own."""
    return {script: task for task, script in TASK_RECIPES.items()}.get(os.path.basename(path))


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line (argparse wraps it)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _metavar(hint) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return f"{METAVARS.get(args[0], 'VALUE')} [...]"
    if args:  # Optional[X]
        return _metavar(args[0])
    return METAVARS.get(hint, "VALUE")


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else None
    if value is None:
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)


def help_text(classes, task: str | None, description: str | None, prog: str, usage: str | None = None,
              options: argparse.ArgumentParser | None = None) -> str:
    """The help of a recipe of ``task``: its description, ``--config`` first, then the fields it takes, one group per
    dataclass. A field of other tasks is left out (``field_tasks``); each field once (no ``--no_X`` twin).
    ``options``: a command's own options (``toolkit train``'s), listed first as a group named after ``prog``."""
    epilog = ("A field set in the YAML file and on the command line takes the command line's value; '--FIELD null' "
              "unsets an optional field. Every field, with examples: docs/configuration.md.")
    if task is not None:
        epilog += f" Fields of the other recipes are not listed (this is recipes/{TASK_RECIPES[task]})."
    parser = argparse.ArgumentParser(prog=prog, description=first_paragraph(description), epilog=epilog,
                                     usage=usage or f"{prog} [--config FILE.yaml] [--FIELD VALUE ...]",
                                     add_help=False)
    if options is not None:
        own = parser.add_argument_group(prog)
        for action in options._actions:
            own._add_action(action)
    config = parser.add_argument_group("config")
    config.add_argument("--config", metavar="FILE.yaml", help="A YAML file of field: value (recipes/configs/ holds "
                                                              "one per recipe); any field below overrides it.")
    config.add_argument("-h", "--help", action="store_true", help="Show this help and exit.")
    for cls in classes:
        group = parser.add_argument_group(GROUP_TITLES.get(cls.__name__, cls.__name__))
        hints = typing.get_type_hints(cls)  # not f.type: HfArgumentParser rewrites it in place
        for f in dataclasses.fields(cls):
            if f.init and takes(f, task):
                text = f.metadata.get("help", "")
                if "default" not in text.lower():  # a help that explains its default keeps its own words
                    text += f" (default: {_default(f)})"
                group.add_argument(f"--{f.name}", metavar=_metavar(hints[f.name]), help=text.replace("%", "%%"))
    return parser.format_help()

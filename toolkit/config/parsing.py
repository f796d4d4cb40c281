"""Parsing argument dataclasses from a YAML file plus command-line overrides, through transformers'
``HfArgumentParser``: YAML values become command-line tokens (so argparse type-checks both alike), ``--field null``
unsets an optional field, every unknown field is named at once with its closest known name, a field of another
recipe's task is refused, and argparse's errors become one ``ConfigError`` naming the field.

The classes and what builds the run from them are arguments (``toolkit.config`` passes its ``ARGUMENT_CLASSES``
and ``RunConfig``), so this module sits below the fields it parses. Standard library and yaml only; transformers is
imported when a parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

import yaml

from toolkit.config import help as config_help
from toolkit.config.checks import _closest, _suggest
from toolkit.errors import ConfigError

MAPPING_FIELDS = ("sharegpt_roles", "dataset_mixture")  # fields that take a YAML mapping (their YAML text)


def field_names(classes) -> list[str]:
    return [f.name for cls in classes for f in dataclasses.fields(cls)]


# ------------------------------------------------------------------------------------------------------ parsing
def _parser(classes):
    from toolkit.env.upstream import import_transformers

    import_transformers()  # the first import of transformers in a run: its model files are then read once, not twice
    from transformers import HfArgumentParser
    from transformers.hf_argparser import string_to_bool

    class _Parser(HfArgumentParser):
        # argparse's default error() prints the whole usage (50 fields) and exits; we want one line naming the field.
        def error(self, message):
            raise ConfigError(None, message)

        # HfArgumentParser passes a field's metadata to add_argument; "tasks" is ours (toolkit.config.help), not
        # argparse's.
        def add_argument(self, *names, tasks=None, task_checks=None, **kwargs):
            return super().add_argument(*names, **kwargs)

    parser = _Parser(classes, allow_abbrev=False)
    for action in parser._actions:  # HfArgumentParser's booleans take yes/no, t/f, y/n and 1/0 too: ours, two words
        if action.type is string_to_bool:
            action.type = strict_bool
    return parser


BOOL_WORDS = {"true": True, "false": False}  # a boolean field's values on the command line, in any case


def strict_bool(value):
    """A boolean field's value: true or false, in any case (a YAML file's booleans reach here as these words), and
    nothing else: transformers' ``string_to_bool`` also takes yes/no, t/f, y/n and 1/0, so ``--use_peft yes`` was
    taken as true, and any misspelling of the kind as one or the other."""
    if isinstance(value, bool):
        return value
    word = BOOL_WORDS.get(value.strip().lower())
    if word is None:
        raise argparse.ArgumentTypeError(f"takes true or false, got {value!r}")
    return word


def _optional_fields(classes) -> set[str]:
    """Fields whose value may be None (unset): the Optional[...] ones."""
    # From the class annotations: HfArgumentParser rewrites each field's .type in place (Optional[str] -> str).
    return {name for cls in classes for name, hint in typing.get_type_hints(cls).items()
            if type(None) in typing.get_args(hint)}


FILE_LISTS = ("train_file", "validation_file")  # a YAML list is one comma-separated value (DataArguments.data_files)
NULL_WORDS = ("null", "none", "None", "~", "")  # on the command line: unset an optional field (YAML's null)


def _yaml_to_argv(values: dict, source: str, classes) -> tuple[list[str], dict, list[str]]:
    """Turn YAML values into CLI tokens so that argparse type-checks them exactly like command-line values; also
    the YAML nulls of optional fields, and the unknown keys (reported with the command line's, all at once)."""
    argv, nulls, unknown = [], {}, []
    known, optional = field_names(classes), _optional_fields(classes)
    for key, value in values.items():
        if key not in known:
            unknown.append(key)
        elif value is None:
            # `seed:` or `shuffle: null` in YAML: unset is not a value for these (once: a crash in set_seed after
            # the process group was up, or shuffling silently off).
            if key not in optional:
                raise ConfigError(key, f"is empty (null) in {source}; give it a value or delete the line to use the "
                                       "default")
            nulls[key] = None
        elif isinstance(value, bool):
            argv += [f"--{key}", "true" if value else "false"]
        elif isinstance(value, (list, tuple)) and key in FILE_LISTS:
            argv += [f"--{key}", ",".join(str(v) for v in value)]
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", *[str(v) for v in value]]
        elif isinstance(value, dict) and key in MAPPING_FIELDS:  # its YAML text, parsed back by the field's check
            argv += [f"--{key}", yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()]
        elif isinstance(value, dict):
            raise ConfigError(key, f"expected a single value in {source}, got a mapping")
        else:
            argv += [f"--{key}", str(value)]
    return argv, nulls, unknown


def _join_file_lists(argv: list[str]) -> list[str]:
    """``--train_file data/part-*.jsonl`` typed unquoted reaches us as the shell's expansion, several paths: the
    values after ``--train_file`` or ``--validation_file`` up to the next ``--flag`` become one comma-separated value
    (the YAML list's form), instead of an unknown argument for every path after the first."""
    out, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        if name not in FILE_LISTS:
            out.append(argv[i])
            i += 1
            continue
        values, i = ([value] if eq else []), i + 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        out += [f"--{name}", ",".join(values)] if values else [argv[i - 1]]  # no value: argparse says so
    return out


def _cli_nulls(argv: list[str], classes) -> tuple[list[str], set[str]]:
    """``--field null`` (or none, None, ~, "") on the command line unsets an optional field, the way a YAML null
    does: the tokens are taken out and the field's name returned. A field that cannot be unset keeps its tokens
    (argparse then names it and the bad value)."""
    optional, out, unset, i = _optional_fields(classes), [], set(), 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        if name in optional and (eq or i + 1 < len(argv)) and value in NULL_WORDS:
            unset.add(name)
            out = _drop_field(out, name)  # an earlier value of the field on the command line: the last one wins
            i += 1 if eq else 2
            continue
        unset.discard(name)  # a later value wins over an earlier null
        out.append(token)
        i += 1
    return out, unset


def _drop_field(argv: list[str], name: str) -> list[str]:
    """argv without ``--name`` (or ``--name=...``) and the values after it."""
    out, dropping = [], False
    for token in argv:
        if token.startswith("--"):
            dropping = token[2:].partition("=")[0] == name
        if not dropping:
            out.append(token)
    return out


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError("config", f"file not found: {path}")
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError("config", f"{path} must be a mapping of field: value")
    return values


def parse_args(classes, make, argv: list[str] | None = None, task: str | None = None,
               description: str | None = None):
    """Parse ``--config file.yaml`` plus overrides. Raises ConfigError; ``toolkit.cli.recipe`` turns it into one line and exit 2.
    ``--field null`` on the command line unsets an optional field that the YAML file sets.

    A recipe passes its ``task`` (``Task.name``) and its docstring: ``--help`` then shows that description and the
    task's fields only, and a field of another task set to other than its default is refused, naming the recipe
    that takes it (``toolkit.config.help``). Without a task (scripts) every field is taken."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    ns, rest = pre.parse_known_args(argv)
    rest, unset = _cli_nulls(_join_file_lists(rest), classes)

    yaml_argv, nulls, unknown = [], {}, []
    if ns.config is not None:
        values = {k: v for k, v in _read_yaml(ns.config).items() if k not in unset}  # the command line wins
        yaml_argv, nulls, unknown = _yaml_to_argv(values, ns.config, classes)

    if "-h" in rest or "--help" in rest:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "recipe"
        sys.stdout.write(config_help.help_text(classes, task, description, prog))
        sys.exit(0)

    return _parse(classes, make, yaml_argv + rest, {**nulls, **dict.fromkeys(unset)}, unknown, ns.config, task)


def config_from_dict(classes, make, values: dict):
    """A RunConfig (``make``) from a plain dict (notebooks, scripts), type-checked and validated exactly like a YAML
    file."""
    argv, nulls, unknown = _yaml_to_argv(values, "the given values", classes)
    return _parse(classes, make, argv, nulls, unknown, "the given values")


def _unknown_error(yaml_unknown: list[str], source: str | None, cli_unknown: list[str], known) -> ConfigError:
    """One error naming every unknown field at once, each with its closest known name."""
    cli_names = [t.lstrip("-").split("=")[0] for t in cli_unknown]
    names = yaml_unknown + cli_names
    if len(names) == 1:
        where = f"unknown field in {source}." if yaml_unknown else f"unknown argument '{cli_unknown[0]}'."
        return ConfigError(names[0], f"{where}{_suggest(names[0], known)}")

    def hint(name):
        close = _closest(name, known)
        return f": did you mean '{close}'?" if close else ""

    described = [f"'{k}' (in {source}{hint(k)})" for k in yaml_unknown]
    described += [f"'{t}' (command line{hint(n)})" for t, n in zip(cli_unknown, cli_names)]
    return ConfigError(", ".join(names), f"{len(names)} unknown fields: {'; '.join(described)}")


def _parse(classes, make, argv: list[str], nulls: dict, yaml_unknown: list[str] = (),
           source: str | None = None, task: str | None = None):
    """argv tokens (YAML values first, command line after: the last value wins) -> checked RunConfig (``make``)."""
    known = field_names(classes)
    parser = _parser(classes)
    if nulls:
        parser.set_defaults(**nulls)
    try:
        # Every unknown field first, all in one message (a run once reported one typo per try).
        _, remaining = parser.parse_known_args(args=argv)
        cli_unknown = [r for r in remaining if r.startswith("--")] or remaining[:1]
        if yaml_unknown or cli_unknown:
            raise _unknown_error(list(yaml_unknown), source, cli_unknown, known)
        # Each dataclass checks its fields as it is built, RunConfig checks the whole.
        groups = parser.parse_args_into_dataclasses(args=argv)
        unused = config_help.unused_field(groups, task)
        if unused:
            raise ConfigError(*unused)
        return make(*groups)
    except ConfigError as e:
        raise _name_field(e) from None


def _name_field(err: ConfigError) -> ConfigError:
    # argparse says "argument --learning_rate: invalid float value: 'abc'"; lift the field name to the front.
    msg = str(err)
    if err.field_name is None and msg.startswith("argument --"):
        name, _, rest = msg[len("argument --") :].partition(":")
        name = name.split("/")[0].strip()
        return ConfigError(name, rest.strip())
    return err


def write_config(cfg, path: str) -> None:
    """``cfg.as_dict()`` (a RunConfig's every field) as YAML: what ``parse_args`` reads back."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(cfg.as_dict(), f, sort_keys=False)

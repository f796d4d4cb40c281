"""Dataset formats: which one a split is in (from its columns, or the ``dataset_format`` field), and the split
converted to the schema its task trains on, so that sets of different formats can be mixed (``toolkit.data.mixture``).

The formats are TRL's (trl/data_utils.py), by the columns that name them:

    text                 ``text`` (or ``text_column_name``): plain text, the causal LM's
    messages             ``messages`` (or ``text_column_name``): a list of {role, content}; every assistant turn is
                         a target
    sharegpt             ``conversations``: a list of {from, value}; ``from`` is system/human/gpt (or user/assistant),
                         other names mapped to roles by ``sharegpt_roles``
    prompt_completion    ``prompt`` and ``completion``: standard (two strings: prompt + completion as plain text, no
                         chat template, EOS appended, as TRL's SFT does) or conversational (two lists of messages,
                         rendered together through the chat template); the loss is on the completion only
    alpaca               ``instruction``, ``output``, optional ``input`` and ``system``: a (system,) user turn holding
                         the instruction, followed by a blank line and the input when the input is not empty, and an
                         assistant turn holding the output
    preference           ``prompt``, ``chosen``, ``rejected`` (strings, or lists of messages)
    implicit_preference  ``chosen``, ``rejected`` only: the prompt is their shared beginning (TRL's
                         ``extract_prompt``: the common leading turns, or for strings the common leading characters,
                         a space just before the first difference given to the completions)

The schemas (what ``convert`` returns, one per task):

    text        the text column alone (only a mixture converts it: a single set is used as loaded)
    chat        ``messages`` (list of {role, content}), ``prompt_turns`` (how many leading messages are prompt, never
                targets: 0 but for conversational prompt-completion), ``prompt`` and ``completion`` (strings, only for
                standard prompt-completion; null otherwise)
    preference  ``prompt``, ``chosen``, ``rejected``, all strings or all lists of {role, content}

A split is detected from its columns, the first format of its task whose columns are all there, and one line says
which (each split on its own: a validation_file may be in another format of the task than train_file); a split whose columns fit none of its task's formats is refused (``dataset_format``), naming the columns it
has and the formats accepted. A row whose value has the wrong type is refused naming the row and the column.
"""

from __future__ import annotations

import os

from datasets import Dataset, DatasetDict, Features, List, Value

from toolkit.config import DataArguments
from toolkit.errors import ConfigError

MESSAGE = {"role": Value("string"), "content": Value("string")}
FEATURES = {
    "chat": Features({"messages": List(MESSAGE), "prompt_turns": Value("int32"), "prompt": Value("string"),
                      "completion": Value("string")}),
    "preference": {False: Features({c: Value("string") for c in ("prompt", "chosen", "rejected")}),
                   True: Features({c: List(MESSAGE) for c in ("prompt", "chosen", "rejected")})},
}
CHAT_COLUMNS = ("messages", "prompt_turns", "prompt", "completion")  # the chat schema's, in FEATURES' order
# each task's formats, in the order detection tries them
TASK_FORMATS = {"text": ("text",), "chat": ("messages", "sharegpt", "prompt_completion", "alpaca"),
                "preference": ("preference", "implicit_preference")}
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}


def required_columns(fmt: str, args: DataArguments) -> tuple[str, ...]:
    """The columns that name ``fmt`` (``text_column_name`` renames text's and messages')."""
    return {"text": (args.text_column_name or "text",), "messages": (args.text_column_name or "messages",),
            "sharegpt": ("conversations",), "prompt_completion": ("prompt", "completion"),
            "alpaca": ("instruction", "output"), "preference": ("prompt", "chosen", "rejected"),
            "implicit_preference": ("chosen", "rejected")}[fmt]


def detect(columns: list[str], schema: str, args: DataArguments, where: str) -> str:
    """The format of a split with ``columns`` for a task of ``schema``: ``dataset_format`` when set (its columns
    checked), else the first of the task's formats whose columns are all there."""
    accepted = TASK_FORMATS[schema]
    described = "; ".join(f"{f} ({', '.join(required_columns(f, args))})" for f in accepted)
    if args.dataset_format is not None:
        if args.dataset_format not in accepted:
            raise ConfigError("dataset_format", f"{args.dataset_format!r} is not a format this recipe trains on; it "
                                                f"takes {described}")
        missing = [c for c in required_columns(args.dataset_format, args) if c not in columns]
        if missing:
            raise ConfigError("dataset_format", f"{args.dataset_format} needs the column(s) {missing}, which {where} "
                                                f"has not (it has {columns})")
        return args.dataset_format
    for fmt in accepted:
        if all(c in columns for c in required_columns(fmt, args)):
            return fmt
    if args.text_column_name and args.text_column_name not in columns and schema != "preference":
        raise ConfigError("text_column_name", f"column {args.text_column_name!r} not in {where}; it has {columns}")
    raise ConfigError("dataset_format", f"{where} has the columns {columns}, which fit none of the formats this "
                                        f"recipe takes: {described}; rename the columns, or set dataset_format")


def detect_split(name: str, columns: list[str], schema: str, args: DataArguments, source: str = "") -> str:
    """``detect`` for one split. The splits of local files are read apart (``data.load_splits``), so each is detected
    on its own: a validation_file in another format that fits the task is converted as its own; one that fits none
    is refused naming validation_file (its columns, and the formats' columns expected)."""
    try:
        return detect(columns, schema, args, f"the {name} split{source}")
    except ConfigError as e:
        if name != "validation" or not args.validation_file:
            raise
        raise ConfigError("validation_file", f"{args.validation_file}: {e.message}") from None


def announce(message: str) -> None:
    """One line, from the first process only (every rank loads the data)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, flush=True)


def convert_splits(raw: DatasetDict, schema: str, args: DataArguments, source: str = "") -> DatasetDict:
    """Every split of ``raw`` detected and converted to ``schema``; one line names each format found."""
    out, found = {}, {}
    for name, split in raw.items():
        fmt = detect_split(name, split.column_names, schema, args, source)
        found[name] = fmt
        out[name] = convert(split, fmt, schema, args, f"the {name} split{source}")
    described = ", ".join(f"{name}: {fmt}" for name, fmt in found.items())
    announce(f"dataset format{source}: {described} (columns {next(iter(raw.values())).column_names})")
    return DatasetDict(out)


def convert(split: Dataset, fmt: str, schema: str, args: DataArguments, where: str, select: bool = False) -> Dataset:
    """``split`` (in format ``fmt``) as rows of ``schema``. Text is kept as loaded unless ``select`` (a mixture:
    the text column alone, so sets with other columns concatenate)."""
    if schema == "text":
        column = required_columns("text", args)[0]
        return split.select_columns([column]) if select else split
    if schema == "preference":
        conversational = _preference_kind(split, fmt, where)
        features = FEATURES["preference"][conversational]
    else:
        features = FEATURES["chat"]
    from datasets.fingerprint import Hasher

    roles = {**SHAREGPT_ROLES, **(args.sharegpt_roles or {})}
    settings = (fmt, schema, args.text_column_name, sorted(roles.items()), _convert_rows.__code__)

    def rows(batch, indices):
        return _convert_rows(batch, indices, fmt, args, roles, where)

    return split.map(rows, batched=True, with_indices=True, remove_columns=split.column_names, features=features,
                     new_fingerprint=Hasher.hash((split._fingerprint, settings)), desc=f"{fmt} -> {schema} rows",
                     load_from_cache_file=not args.overwrite_cache)


def convert_row(row: dict, schema: str, args: DataArguments, where: str, fmt: str | None = None) -> dict:
    """One row (of a stream) in ``schema``: in format ``fmt`` (the stream's, detected from its first rows as a loaded
    split's is from its columns), or without one in the format its own columns say."""
    fmt = fmt or detect(sorted(row), schema, args, where)
    return CONVERTERS[fmt](row, args, {**SHAREGPT_ROLES, **(args.sharegpt_roles or {})}, where)


def row_format(row: dict, schema: str, args: DataArguments) -> str | None:
    """The first of ``schema``'s formats whose columns ``row`` holds with a value, or None: what one row of a stream
    is, whatever columns its reader gave it (the JSON lines read in one chunk all get the chunk's columns, null where
    a line has none)."""
    present = {column for column, value in row.items() if value is not None}
    return next((fmt for fmt in TASK_FORMATS[schema] if set(required_columns(fmt, args)) <= present), None)


def _preference_kind(split: Dataset, fmt: str, where: str) -> bool:
    """Whether a preference split is conversational (every column a list) or standard (every column text)."""
    columns = ("prompt", "chosen", "rejected") if fmt == "preference" else ("chosen", "rejected")
    kinds = {c: not isinstance(split.features[c], Value) for c in columns}
    if len(set(kinds.values())) != 1:
        raise ConfigError("train_file", f"{where} mixes text and conversational columns ({kinds}); give prompt, "
                                        "chosen and rejected all as text or all as lists of messages")
    return next(iter(kinds.values()))


def _convert_rows(batch: dict, indices: list[int], fmt: str, args, roles: dict, where: str) -> dict:
    """A batch of ``fmt`` rows in their schema's columns (``convert``); a value of the wrong type names its row."""
    out: dict = {}
    for k, index in enumerate(indices):
        row = {c: batch[c][k] for c in batch}
        converted = CONVERTERS[fmt](row, args, roles, f"{where}, row {index}")
        for key, value in converted.items():
            out.setdefault(key, []).append(value)
    return out


def _text(row: dict, column: str, where: str, optional: bool = False) -> str:
    value = row.get(column)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise ConfigError("dataset_format", f"{where}: column {column!r} holds {type(value).__name__} "
                                            f"{value!r:.80}, not text")
    return value


def _messages(value, column: str, where: str) -> list[dict]:
    """A list of {role, content} with text contents (extra keys dropped: the schema's messages are role and
    content)."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value):
        raise ConfigError("dataset_format", f"{where}: column {column!r} holds {value!r:.120}, not a list of "
                                            "{role, content}")
    for m in value:
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise ConfigError("dataset_format", f"{where}: column {column!r} has a message whose role or content is "
                                                f"not text: {m!r:.120}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _chat(messages: list[dict], prompt_turns: int = 0, prompt: str | None = None, completion: str | None = None):
    return {"messages": messages, "prompt_turns": prompt_turns, "prompt": prompt, "completion": completion}


def _from_messages(row, args, roles, where):
    column = required_columns("messages", args)[0]
    return _chat(_messages(row[column], column, where))


def _from_sharegpt(row, args, roles, where):
    turns = row["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) and {"from", "value"} <= set(t) for t in turns):
        raise ConfigError("dataset_format", f"{where}: column 'conversations' holds {turns!r:.120}, not a list of "
                                            "{from, value}")
    messages = []
    for t in turns:
        if t["from"] not in roles:
            raise ConfigError("sharegpt_roles", f"{where}: the speaker {t['from']!r} has no role; map it, e.g. "
                                                f"sharegpt_roles: {{{t['from']}: assistant}}")
        if not isinstance(t["value"], str):
            raise ConfigError("dataset_format", f"{where}: a turn of {t['from']!r} holds no text")
        messages.append({"role": roles[t["from"]], "content": t["value"]})
    return _chat(messages)


def _from_prompt_completion(row, args, roles, where):
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt, completion = _messages(prompt, "prompt", where), _messages(completion, "completion", where)
        return _chat(prompt + completion, prompt_turns=len(prompt))
    return _chat([], prompt=_text(row, "prompt", where), completion=_text(row, "completion", where))


def _from_alpaca(row, args, roles, where):
    instruction, extra = _text(row, "instruction", where), _text(row, "input", where, optional=True)
    system = _text(row, "system", where, optional=True)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = [{"role": "system", "content": system}] if system.strip() else []
    return _chat(messages + [{"role": "user", "content": user},
                             {"role": "assistant", "content": _text(row, "output", where)}])


def _from_preference(row, args, roles, where):
    if isinstance(row["chosen"], list):
        return {c: _messages(row[c], c, where) for c in ("prompt", "chosen", "rejected")}
    return {c: _text(row, c, where) for c in ("prompt", "chosen", "rejected")}


def _from_implicit_preference(row, args, roles, where):
    """TRL's ``extract_prompt``: the longest shared beginning of chosen and rejected is the prompt."""
    if isinstance(row["chosen"], list):
        chosen, rejected = _messages(row["chosen"], "chosen", where), _messages(row["rejected"], "rejected", where)
    else:
        chosen, rejected = _text(row, "chosen", where), _text(row, "rejected", where)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == len(chosen) or shared == len(rejected):
        raise ConfigError("dataset_format", f"{where}: chosen and rejected do not differ after their shared "
                                            "beginning, so the pair has no completion to compare; remove the row")
    if shared and isinstance(chosen, str) and chosen[shared - 1] == " ":
        shared -= 1  # TRL's: the space before the first difference starts the completions
    return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


CONVERTERS = {"messages": _from_messages, "sharegpt": _from_sharegpt, "prompt_completion": _from_prompt_completion,
              "alpaca": _from_alpaca, "preference": _from_preference,
              "implicit_preference": _from_implicit_preference}

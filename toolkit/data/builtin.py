"""Labelled datasets built from what every Python ships: no download, the same rows on every machine.

* :func:`pydoc_chats`: question/answer chats for supervised fine-tuning, from CPython's reference documentation
  (``pydoc_data.topics``): "What does the `with` statement do?" -> the first paragraph of that section.
* :func:`pydoc_preferences`: preference pairs for DPO from the same questions: the section's answer chosen, another
  topic's answer rejected.
* :func:`stdlib_docstrings`: text classification, the docstrings of a few standard-library modules labelled by
  the module they come from, with a stratified split; :func:`majority_baseline` is the accuracy to beat.

Both depend only on the Python version (the docs and docstrings change between versions) and on ``seed``.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import json
import random
import re
import subprocess
import sys
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # datasets is imported inside the functions: this file must import under `python -S` (see below)
    from datasets import DatasetDict

__all__ = ["pydoc_chats", "pydoc_preferences", "stdlib_docstrings", "majority_baseline", "DOCSTRING_MODULES"]

# ---------------------------------------------------------------------------------------------------------------
# pydoc chats
# ---------------------------------------------------------------------------------------------------------------

MAX_ANSWER_CHARS = 600
_HEADING_RULE = re.compile(r"^([*=\-~^])\1{2,}$")
_STATEMENT = re.compile(r'^The "([^"]+)" statement$')
_SKIP_PREFIXES = ("New in version", "Added in version", "Changed in version", "Deprecated", "See also",
                  "**Source code:**", "Note:", "Warning:", "+-")
_SIGNATURE = re.compile(r"^[\w.*]+\(.*\)$")  # "object.__lt__(self, other)"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“*(])")
_STATEMENT_TEMPLATES = ("What does the {kw} statement do?", "How does the {kw} statement work in Python?",
                        "Explain the {kw} statement.")
_TEMPLATES = ("Explain {h}{py}.", "What does the Python language reference say about {h}?", "Describe {h}{py}.",
              "Give me an overview of {h}{py}.")
_GENERIC_HEADINGS = {"overview"}  # a sub-heading that means nothing without its parent's


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """``(heading, paragraphs)`` for every heading of one topic's text, at any level (``***``, ``===``, ``---``...).

    A heading is a line followed by an underline of one repeated character of the same length.
    """
    lines = text.split("\n")
    starts = [i for i in range(len(lines) - 1)
              if lines[i].strip() and _HEADING_RULE.match(lines[i + 1]) and len(lines[i + 1]) == len(lines[i])]
    out = []
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        body = "\n".join(lines[i + 2:end])
        out.append((lines[i].strip(), [p for p in body.split("\n\n") if p.strip()]))
    return out


def _is_prose(paragraph: str) -> bool:
    """A paragraph of running text: not indented (grammar, code, tables, definitions), not a version note, a
    table or a rule, not a bare signature line such as ``object.__new__(cls[, ...])``."""
    p = paragraph.strip("\n")
    if not p or p[0].isspace() or p.startswith(_SKIP_PREFIXES) or _HEADING_RULE.match(p.strip()):
        return False
    if all(_SIGNATURE.match(line) for line in p.split("\n")):
        return False
    return len(p.split()) >= 8


def _trim(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """At most ``limit`` characters, cut after a whole sentence (or, for one very long sentence, at a word)."""
    if len(text) <= limit:
        return text
    out = ""
    for sentence in _SENTENCE_END.split(text):
        candidate = f"{out} {sentence}" if out else sentence
        if len(candidate) > limit:
            break
        out = candidate
    return out or text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def _answer(paragraphs: list[str]) -> str | None:
    """The section's first prose paragraph, unwrapped and trimmed. A paragraph that ends by introducing a code
    block ("... into a program:") loses that last sentence, or ends with a full stop if it is its only one."""
    for p in paragraphs:
        if not _is_prose(p):
            continue
        text = " ".join(re.sub(r"(?<=\w)-\n\s*(?=\w)", "-", p).split())  # "built-\nin" -> "built-in"
        if not text.endswith((".", "!", "?", ")", '"', "”")):  # "... is equivalent to" + code, "... a program:"
            sentences = _SENTENCE_END.split(text)
            if len(sentences) > 1:
                text = " ".join(sentences[:-1])
            elif text.endswith(":"):
                text = text[:-1] + "."
            else:
                continue
        return _trim(text)
    return None


def _readable(heading: str) -> str:
    """A heading as it reads mid-sentence: code in backticks, title-case words lower-cased (not builtin names)."""
    h = re.sub(r'"([^"]+)"', r"`\1`", heading)
    h = re.sub(r"\*([^*\s][^*]*)\*", r"`\1`", h)
    words = []
    for w in re.split(r"([ -])", h):  # "Mini-Language" -> "mini-language"
        core = w.strip("()`,")
        if core[:1].isupper() and core[1:].islower() and core != "Python" and not hasattr(builtins, core):
            w = w.replace(core, core.lower(), 1)
        words.append(w)
    h = "".join(words)
    return "the " + h if h.endswith("clause") and not h.startswith("the ") else h


def _question(heading: str, rng: random.Random) -> str:
    m = _STATEMENT.match(heading)
    if m:
        return rng.choice(_STATEMENT_TEMPLATES).format(kw=f"`{m.group(1)}`")
    h = _readable(heading)
    return rng.choice(_TEMPLATES).format(h=h, py="" if "Python" in h else " in Python")


def _pydoc_pairs() -> list[tuple[int, str, str]]:
    """``(topic index, heading, answer)`` for every section of every topic, in sorted topic order. A heading or an
    answer seen before (several topics repeat sections: 'compound' holds 'The "if" statement'...) is kept once,
    under the first topic that has it."""
    from pydoc_data.topics import topics

    pairs, seen_headings, seen_answers = [], set(), set()
    for i, name in enumerate(sorted(topics)):
        for heading, paragraphs in _sections(topics[name]):
            key = heading.lower().replace('"', "")
            if key in seen_headings or key in _GENERIC_HEADINGS:
                continue
            seen_headings.add(key)
            answer = _answer(paragraphs)
            if answer is None or len(answer) < 40 or answer in seen_answers:
                continue
            seen_answers.add(answer)
            pairs.append((i, heading, answer))
    return pairs


def pydoc_chats(seed: int = 0, multi_turn_fraction: float = 0.2, validation_every: int = 10) -> DatasetDict:
    """Question/answer chats from CPython's reference documentation (``pydoc_data.topics``): no download.

    One question per documented section (every heading of every topic, at any level): "What does the `with`
    statement do?" for a statement's section, otherwise one of a few phrasings naming the section's heading ("Explain
    augmented assignment statements in Python."). The answer is the section's first prose paragraph (headings,
    grammar, code, tables and version notes skipped), unwrapped, at most 600 characters cut at a sentence end. A
    section repeated under several topics, or a repeated answer, is kept once (under the first topic in sorted order).

    Column ``messages``: a list of ``{"role", "content"}`` dicts, user then assistant. About ``multi_turn_fraction``
    of the rows are two-turn chats (user, assistant, user, assistant) that join two consecutive questions of the same
    split; every question/answer pair appears in exactly one row.

    Split by topic, like :func:`toolkit.data.loading.pydoc_dataset`: every ``validation_every``-th topic in sorted order is
    validation, so no validation question comes from a topic seen in training. On CPython 3.11: 161 question/answer
    pairs from 79 topics, 13 of them in validation with the default 10 (23 with 5). The phrasings and the multi-turn joins are drawn from
    ``random.Random(seed)``: the rows depend only on the Python version and ``seed``.
    """
    from datasets import Dataset, DatasetDict

    rng = random.Random(seed)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "validation": []}
    for topic_index, heading, answer in _pydoc_pairs():
        q = _question(heading, rng)
        splits["validation" if topic_index % validation_every == 0 else "train"].append((q, answer))

    out = {}
    for name, pairs in splits.items():
        rows, i = [], 0
        while i < len(pairs):
            turns = [pairs[i]]
            if i + 1 < len(pairs) and rng.random() < multi_turn_fraction:
                turns.append(pairs[i + 1])
            i += len(turns)
            rows.append([m for q, a in turns for m in ({"role": "user", "content": q},
                                                       {"role": "assistant", "content": a})])
        out[name] = Dataset.from_dict({"messages": rows})
    return DatasetDict(out)


def pydoc_preferences(seed: int = 0, validation_every: int = 10) -> DatasetDict:
    """Preference pairs (TRL's conversational format: ``prompt``, ``chosen``, ``rejected``, each a list of messages)
    from the questions of :func:`pydoc_chats`: the prompt is the question, ``chosen`` the answer from its own
    section, ``rejected`` the answer of a section of another topic in the same split, drawn with
    ``random.Random(seed)``. Both answers are fluent Python documentation, so what a model learns from the pairs is
    relevance: to answer the question asked rather than some other part of Python. Split by topic as
    :func:`pydoc_chats` (no validation question comes from a topic seen in training)."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(seed)
    splits: dict[str, list[tuple[int, str, str]]] = {"train": [], "validation": []}
    for topic_index, heading, answer in _pydoc_pairs():
        split = "validation" if topic_index % validation_every == 0 else "train"
        splits[split].append((topic_index, _question(heading, rng), answer))
    out = {}
    for name, rows in splits.items():
        columns = {"prompt": [], "chosen": [], "rejected": []}
        for topic, question, answer in rows:
            others = [a for t, _, a in rows if t != topic]
            columns["prompt"].append([{"role": "user", "content": question}])
            columns["chosen"].append([{"role": "assistant", "content": answer}])
            columns["rejected"].append([{"role": "assistant", "content": rng.choice(others)}])
        out[name] = Dataset.from_dict(columns)
    return DatasetDict(out)


# ---------------------------------------------------------------------------------------------------------------
# standard-library docstrings
# ---------------------------------------------------------------------------------------------------------------

# Candidate modules, in label order: pure Python or C modules whose public names and docstrings do not depend on
# the platform (no os, asyncio, ssl, tkinter...), that import without side effects.
DOCSTRING_MODULES = ("decimal", "inspect", "logging", "mailbox", "pathlib", "unittest",
                     "tarfile", "imaplib", "math", "datetime", "collections", "threading")
MAX_DOCSTRING_CHARS = 400
MIN_DOCSTRING_CHARS = 20


def _first_paragraph(doc: str) -> str:
    text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    if len(text) > MAX_DOCSTRING_CHARS:
        text = text[:MAX_DOCSTRING_CHARS].rsplit(" ", 1)[0]
    return text


def _documented(module) -> list[str]:
    """First paragraphs of the docstrings of a module's public classes and functions (those it defines, not
    re-exports) and of those classes' public methods, class/static methods and properties (the class's own, not
    inherited ones, nor ones another module added). Names come from ``__all__`` (else ``dir``), sorted, so the
    order is fixed."""
    prefix = module.__name__
    names = getattr(module, "__all__", None)
    names = sorted(names if names is not None else dir(module))
    objects = []
    for name in names:
        if name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        owner = getattr(obj, "__module__", None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not isinstance(owner, str):
            continue
        if owner != prefix and not owner.startswith(prefix + "."):
            continue
        objects.append(obj)
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                value = vars(obj)[attr]
                if isinstance(value, (classmethod, staticmethod)):
                    value = value.__func__
                if attr.startswith("_") or not (inspect.isroutine(value) or isinstance(value, property)):
                    continue
                # Only the module's own methods: other libraries patch stdlib classes on import (transformers
                # adds `Logger.warning_advice`), which would make the rows depend on what was imported before.
                owner = getattr(value.fget if isinstance(value, property) else value, "__module__", None)
                if owner is None or owner == prefix or owner.startswith(prefix + "."):  # None: a C method
                    objects.append(value)
    docs = [obj.__doc__ for obj in objects]
    return [_first_paragraph(d) for d in docs if isinstance(d, str) and d.strip()]


def _collect_docstrings() -> dict[str, list[str]]:
    """``{module: its texts}`` for every module of :data:`DOCSTRING_MODULES`, each text once, in a fixed order."""
    return {name: list(dict.fromkeys(t for t in _documented(importlib.import_module(name))
                                     if len(t) >= MIN_DOCSTRING_CHARS))
            for name in DOCSTRING_MODULES}


def _docstrings_in_clean_interpreter() -> dict[str, list[str]]:
    """:func:`_collect_docstrings` run in a fresh ``python -S -E`` (no site-packages, no ``.pth`` hooks, no
    ``PYTHON*`` variables) that loads this file by path, without the ``toolkit`` package.

    Libraries patch the standard library on import (torch replaces ``inspect.getfile``, transformers adds
    methods to ``logging.Logger``), so the live modules of this process would give rows, and through the
    stratified shuffle a whole split, that depend on what was imported before. (~0.5 s.)
    """
    code = ("import importlib.util, json, sys\n"
            f"spec = importlib.util.spec_from_file_location('_toolkit_builtin_data', {__file__!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "print(json.dumps(module._collect_docstrings()))")
    done = subprocess.run([sys.executable, "-S", "-E", "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"collecting the standard library's docstrings failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def stdlib_docstrings(min_rows_per_class: int = 60, seed: int = 0, validation_fraction: float = 0.2) -> DatasetDict:
    """Standard-library docstrings labelled by their module: text classification with no download.

    For each module of :data:`DOCSTRING_MODULES`: the first paragraph (at most 400 characters, cut at a word) of
    the docstring of every public class and function it defines, and of those classes' own public methods and
    properties. Texts under 20 characters are dropped; a text found twice in one module is kept once, and a text
    found in two modules is dropped from both (its label would be ambiguous). Modules left with fewer than
    ``min_rows_per_class`` texts are left out; the class names (``label``, a ``ClassLabel``) are the remaining
    module names, in :data:`DOCSTRING_MODULES` order. With the default 60 on CPython 3.11: decimal, inspect,
    logging, mailbox, pathlib, unittest.

    Many texts mention their module or its vocabulary ("Decimal", "logger", "TestCase"): that is what makes the
    task learnable and is fine here, but the task measures recognising a module's vocabulary, not understanding.

    Stratified split: within each class, the rows are shuffled with ``random.Random(seed)`` and
    ``round(validation_fraction * n)`` go to validation, so both splits have the class proportions of the whole
    (to within one row per class). Rows are ordered by class, then by module order. The docstrings are read in a
    fresh interpreter without site-packages (other libraries patch the standard library when imported), the
    modules import without side effects and every name is visited in sorted order: the rows depend only on the
    Python version and ``seed``, not on what this process imported.
    """
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    texts = _docstrings_in_clean_interpreter()
    modules_of = Counter(t for ts in texts.values() for t in ts)
    texts = {name: [t for t in ts if modules_of[t] == 1] for name, ts in texts.items()}
    kept = [name for name in DOCSTRING_MODULES if len(texts[name]) >= min_rows_per_class]
    if len(kept) < 2:
        counts = {name: len(ts) for name, ts in texts.items()}
        raise ValueError(f"fewer than 2 modules have {min_rows_per_class} docstrings ({counts}); lower min_rows_per_class")

    rng = random.Random(seed)
    split_rows: dict[str, tuple[list[str], list[int]]] = {"train": ([], []), "validation": ([], [])}
    for label, name in enumerate(kept):
        order = list(range(len(texts[name])))
        rng.shuffle(order)
        held_out = set(order[:round(validation_fraction * len(order))])
        for j, text in enumerate(texts[name]):
            split_texts, labels = split_rows["validation" if j in held_out else "train"]
            split_texts.append(text)
            labels.append(label)
    features = Features({"text": Value("string"), "label": ClassLabel(names=kept)})
    return DatasetDict({split: Dataset.from_dict({"text": t, "label": y}, features=features)
                        for split, (t, y) in split_rows.items()})


def majority_baseline(dataset_dict: DatasetDict, label_column: str = "label") -> float:
    """Validation accuracy of always predicting the training split's most frequent class (ties: the lowest id)."""
    counts = Counter(list(dataset_dict["train"][label_column]))
    majority = min(counts, key=lambda c: (-counts[c], c))
    valid = list(dataset_dict["validation"][label_column])
    return sum(y == majority for y in valid) / len(valid)

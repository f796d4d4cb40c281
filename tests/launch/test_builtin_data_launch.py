"""``toolkit.data.builtin`` read in a fresh interpreter (a subprocess): the rows do not depend on what was imported
before. The in-process tests are in tests/unit/test_builtin_data.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from toolkit.data.builtin import stdlib_docstrings


def col(dataset, name) -> list:
    return list(dataset[name])  # datasets 5 returns a lazy Column


@pytest.fixture(scope="module")
def docstrings():
    return stdlib_docstrings()


def test_stdlib_docstrings_do_not_depend_on_what_was_imported_before(docstrings):
    """transformers adds methods to ``logging.Logger`` on import: they must not become rows."""
    import transformers  # noqa: F401

    code = ("import json; from toolkit.data.builtin import stdlib_docstrings as f; d = f(); "
            "print(json.dumps({s: list(d[s]['text']) for s in d}))")
    clean = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                      cwd=ROOT).stdout)
    again = stdlib_docstrings()
    for split in ("train", "validation"):
        assert col(again[split], "text") == clean[split] == col(docstrings[split], "text")
    assert not any("TRANSFORMERS" in t for t in clean["train"] + clean["validation"])

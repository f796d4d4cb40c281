"""The README's layout table matches the files: every toolkit module is listed, every listed path exists."""

import os
import re

from helpers import ROOT


def _layout_table() -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    return readme.split("## Layout", 1)[1].split("\n## ", 1)[0]


def test_readme_layout_table_matches_the_files():
    table = _layout_table()
    listed = set(re.findall(r"`([\w./-]+)`", table))
    modules = {f"toolkit/{name}" for name in os.listdir(os.path.join(ROOT, "toolkit")) if name.endswith(".py")}
    modules.discard("toolkit/__init__.py")
    assert not modules - listed, f"toolkit modules missing from the README's layout table: {sorted(modules - listed)}"
    for path in sorted(p for p in listed if "/" in p):
        assert os.path.exists(os.path.join(ROOT, path)), f"the README's layout table names {path}, which does not exist"

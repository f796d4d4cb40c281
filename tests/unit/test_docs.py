"""The README and docs/ match the files: every toolkit folder and top-level module is in the README's layout table, every listed path, every
file a shown command names and every relative link exists, every config field is documented, the README stays short."""

import ast
import dataclasses
import glob
import os
import re

from helpers import ROOT

README = os.path.join(ROOT, "README.md")
README_MAX_LINES = 250

# A token of a shown command that names a file of this repository.
PATH_PREFIXES = ("recipes/", "accelerate_configs/", "scripts/", "bench/", "tests/", "toolkit/", "docs/", "notebooks/",
                 ".ci/")
PATH_SUFFIXES = (".py", ".yaml", ".sh", ".sbatch", ".ipynb")
# Paths a command writes or that stand for the user's own (run folders, data, machines elsewhere), never the repo's.
NOT_REPOSITORY = ("outputs/", "data/", "/", "~", "$", "-")
COMMAND_LANGUAGES = ("", "bash", "sh", "shell", "console")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[str]:
    return [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _name(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _split_fences(text: str) -> tuple[list[tuple[str, list[str]]], str]:
    """The fenced code blocks ((language, lines) each) and the text outside them."""
    blocks, prose, current, fence = [], [], None, None
    for line in text.splitlines():
        match = FENCE.match(line)
        if current is None:
            if match:
                fence, current = match.group(1), (match.group(2).lower(), [])
            else:
                prose.append(line)
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) and not match.group(2):
            blocks.append(current)
            current = None
        else:
            current[1].append(line)
    assert current is None, "a code block is never closed"
    return blocks, "\n".join(prose)


def _repository_paths(line: str) -> list[str]:
    paths = []
    for token in line.split():
        token = token.split("=", 1)[1] if re.match(r"^-*[\w.-]+=", token) else token
        token = token.strip("\"'`(),;").split("::", 1)[0]
        if not token or token.startswith(NOT_REPOSITORY) or "<" in token or "..." in token or "path/to" in token:
            continue
        if token.startswith(PATH_PREFIXES) or ("/" in token and token.endswith(PATH_SUFFIXES)):
            paths.append(token)
    return paths


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    _, prose = _split_fences(open(path).read())
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    anchors.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", prose))
    return anchors


def _layout_table() -> str:
    readme = open(README).read()
    return readme.split("## Layout", 1)[1].split("\n## ", 1)[0]


def test_readme_layout_table_matches_the_files():
    table = _layout_table()
    listed = set(re.findall(r"`([\w./-]+)`", table))
    # one row per folder (a subpackage's own docstring lists its modules) and per top-level module
    modules = {f"toolkit/{name}" + ("/" if os.path.isdir(os.path.join(ROOT, "toolkit", name)) else "")
               for name in os.listdir(os.path.join(ROOT, "toolkit")) if name.endswith(".py") or
               os.path.isfile(os.path.join(ROOT, "toolkit", name, "__init__.py"))}
    modules -= {"toolkit/__init__.py", "toolkit/__main__.py"}
    assert "toolkit/tasks/" in modules  # the walk walks
    assert not modules - listed, f"toolkit modules missing from the README's layout table: {sorted(modules - listed)}"
    for path in sorted(p for p in listed if "/" in p):
        assert os.path.exists(os.path.join(ROOT, path)), f"the README's layout table names {path}, which does not exist"


def test_readme_is_short():
    lines = len(open(README).read().splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail "
                                       "to a page in docs/ and link to it")


def _command_lines():
    """(markdown file, line) for every line of a shell code block in the README and docs/."""
    for md in _markdown_files():
        blocks, _ = _split_fences(open(md).read())
        for language, lines in blocks:
            if language in COMMAND_LANGUAGES:
                yield from ((md, line) for line in lines)


def test_every_command_shown_names_files_that_exist():
    missing = []
    for md, line in _command_lines():
        missing += [f"{_name(md)}: {path}   (in: {line.strip()})" for path in _repository_paths(line)
                    if not os.path.exists(os.path.join(ROOT, path))]
    assert not missing, "commands in the docs name files that do not exist:\n" + "\n".join(missing)


def test_every_relative_link_resolves():
    broken = []
    for md in _markdown_files():
        _, prose = _split_fences(open(md).read())
        for target in LINK.findall(prose):
            if re.match(r"^[a-z][\w+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
            if not os.path.exists(full):
                broken.append(f"{_name(md)}: {target} (no file {_name(full)})")
            elif anchor and full.endswith(".md") and anchor not in _anchors(full):
                broken.append(f"{_name(md)}: {target} (no heading or anchor #{anchor} in {_name(full)})")
    assert not broken, "links in the docs that lead nowhere:\n" + "\n".join(broken)


def test_configuration_page_names_every_field():
    from toolkit import config

    page = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    fields = {f.name for obj in vars(config).values() if dataclasses.is_dataclass(obj) and isinstance(obj, type)
              for f in dataclasses.fields(obj) if "help" in f.metadata}
    assert len(fields) > 40, f"found only {len(fields)} config fields in toolkit/config/arguments.py"
    missing = sorted(name for name in fields if f"`{name}`" not in page)
    assert not missing, f"config fields missing from docs/configuration.md: {missing}"


def _recipe_runs(line: str) -> dict | None:
    """What a shown recipe command writes: {"output_dir", "use_peft"}, from its --config file and its overrides;
    None when the line runs no recipe."""
    import yaml

    tokens = line.split()
    script = next((i for i, t in enumerate(tokens) if re.fullmatch(r"recipes/\w+\.py", t)), None)
    if script is None:
        return None
    args, key = {}, None
    for token in tokens[script + 1:]:  # --field value [value ...] (lists take several)
        if token.startswith("--"):
            key = token
            args[key] = None
        elif key and args[key] is None:
            args[key] = token
    config = yaml.safe_load(open(os.path.join(ROOT, args["--config"]))) if "--config" in args else {}
    return {"output_dir": args.get("--output_dir", config.get("output_dir")),
            "use_peft": args.get("--use_peft", str(config.get("use_peft", False))).lower() == "true"}


def test_full_and_lora_commands_write_their_own_folders():
    """A LoRA command shown beside a full fine-tuning one of the same config gets its own output_dir: the second
    would move the first aside (overwrite_output_dir) and `toolkit report` would label it replaced-<time>."""
    writers: dict[str, dict[bool, str]] = {}
    for md, line in _command_lines():
        run = _recipe_runs(line.split("#", 1)[0])
        if run and run["output_dir"]:
            writers.setdefault(run["output_dir"], {})[run["use_peft"]] = f"{_name(md)}: {line.strip()}"
    shared = {out: kinds for out, kinds in writers.items() if len(kinds) == 2}
    assert len(writers) >= 5, f"found only {len(writers)} recipe commands' output folders"
    assert not shared, "full fine-tuning and LoRA commands write the same output_dir:\n" + "\n".join(
        f"{out}:\n  {kinds[False]}\n  {kinds[True]}" for out, kinds in shared.items())


def _defined_names(source: str) -> set[str]:
    """What a module defines or imports at any depth (a function, a class, an assignment, an imported name)."""
    names = set()
    for node in ast.walk(ast.parse(open(source).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _resolves(dotted: str) -> bool:
    """``toolkit.a.b.name``: the longest prefix that is a module or package of the checkout, then (if anything is
    left) a name that module defines."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = os.path.join(ROOT, *parts[:i])
        source = path + ".py" if os.path.isfile(path + ".py") else os.path.join(path, "__init__.py")
        if os.path.isfile(source):
            return i == len(parts) or parts[i] in _defined_names(source)
    return False


def test_every_dotted_toolkit_name_in_the_docs_and_the_code_exists():
    """After the house moved into folders (issue 45) nothing may point at a module that moved: every ``toolkit.x.y``
    written in the README, docs/, the recipes, the benchmarks, the notebook and the package's own docstrings names a
    module of the checkout, or a name one defines (the shipped ``toolkit.recipes`` and ``toolkit.accelerate_configs``
    exist in a wheel only)."""
    files = [README, *glob.glob(os.path.join(ROOT, "docs", "*.md")), *glob.glob(os.path.join(ROOT, "recipes", "*.py")),
             *glob.glob(os.path.join(ROOT, "recipes", "configs", "*.yaml")), *glob.glob(os.path.join(ROOT, "bench", "*")),
             *glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")),
             *glob.glob(os.path.join(ROOT, "toolkit", "**", "*.py"), recursive=True)]
    wheel_only = ("toolkit.recipes", "toolkit.accelerate_configs")
    dangling = set()
    for name in files:
        if not os.path.isfile(name):
            continue
        for dotted in re.findall(r"\btoolkit(?:\.[A-Za-z_]\w*)+", open(name, errors="replace").read()):
            if not dotted.startswith(wheel_only) and not dotted.endswith(".__file__") and not _resolves(dotted):
                dangling.add(f"{os.path.relpath(name, ROOT)}: {dotted}")
    assert len(files) > 60  # the walk walks
    assert _resolves("toolkit.tasks.grpo.task.GRPO") and not _resolves("toolkit.grpo")
    assert not dangling, f"names of modules or functions that do not exist: {sorted(dangling)}"

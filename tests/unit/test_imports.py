"""The import structure of ``toolkit/`` keeps its promises, read from the source with ``ast`` (nothing is imported):

- the graph of imports between toolkit modules has no cycle, and every import points up the list of subpackages in
  ``toolkit/__init__.py``'s docstring (each subpackage's docstring lists its own modules); no task borrows from
  another task's module;
- ``toolkit.config`` depends only on its parts (``toolkit.config.*``: the fields of a feature, the shared checks,
  parsing; standard library and yaml, transformers' parser built when called), on the dependency-free
  ``toolkit.errors``, ``toolkit.layout`` and ``toolkit.config.help`` (its --help), which use the standard library only,
  and on ``toolkit.env.elastic`` (the restart policy: those two and yaml), so a config is checked before torch,
  accelerate or a model is touched;
- ``toolkit.training.loop`` (a writer of runs) does not reach ``toolkit.reporting.report`` (a reader of runs);
- no function in ``toolkit/`` is over 80 lines;
- parsing a config in a fresh interpreter imports neither torch nor accelerate (measured in a subprocess:
  tests/launch/test_imports_launch.py).

Top-level and function-local imports both count (a function-local import still runs when the function does), and so
do ``if TYPE_CHECKING:`` ones (stricter than needed). Imports by string (``importlib.import_module`` in
``toolkit/__main__.py``) are not seen.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import sys
from pathlib import Path

from helpers import ROOT

PACKAGE = "toolkit"
SOURCE = os.path.join(ROOT, PACKAGE)


def _module_name(path: str) -> str:
    """toolkit/x.py -> toolkit.x; toolkit/pkg/__init__.py -> toolkit.pkg; toolkit/pkg/y.py -> toolkit.pkg.y."""
    parts = list(Path(path).relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=1)
def _modules() -> dict[str, ast.Module]:
    """Every module of the package, subpackages included (``toolkit/checkpointing/``)."""
    paths = sorted(Path(SOURCE).rglob("*.py"))
    return {_module_name(str(p)): ast.parse(p.read_text(), filename=str(p)) for p in paths if "__pycache__" not in p.parts}


def _is_package(name: str) -> bool:
    return Path(ROOT, *name.split("."), "__init__.py").is_file()


def _imports(name: str, tree: ast.Module) -> list[tuple[str, list[str]]]:
    """Every import statement of the module, anywhere in it: (absolute module, names taken from it); ``import a.b``
    gives ("a.b", [])."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: ``from . import x`` / ``from .x import y`` inside the package
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((target, [alias.name for alias in node.names]))
    return out


def _toolkit_edges(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The toolkit modules ``name`` imports. ``from toolkit import layout`` names the submodule toolkit.layout;
    ``from toolkit.config import X`` names toolkit.config; ``import toolkit.models.loading`` names toolkit.models.loading."""
    edges = set()
    for module, names in _imports(name, tree):
        if module.split(".")[0] != PACKAGE:
            continue
        parts = module.split(".")
        holder = next(".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known)
        for taken in names or [None]:
            edges.add(f"{module}.{taken}" if f"{module}.{taken}" in known else holder)
    edges.discard(name)
    return edges


def _graph() -> dict[str, set[str]]:
    trees = _modules()
    return {name: _toolkit_edges(name, tree, set(trees)) for name, tree in trees.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS with white/grey/black colours)."""
    colour = dict.fromkeys(graph, 0)
    for root in sorted(graph):
        if colour[root]:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        colour[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = 2
                stack.pop()
            elif colour.get(nxt, 0) == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt, 0) == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module reachable from ``start``, with one import path to it."""
    paths, todo = {start: [start]}, [start]
    while todo:
        node = todo.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                todo.append(nxt)
    return paths


def test_graph_sees_the_known_imports():
    """Guards the parser: if it silently found nothing, the tests below would pass vacuously."""
    graph = _graph()
    assert {"toolkit.training.loop", "toolkit.config", "toolkit.layout", "toolkit.errors", "toolkit.reporting.report"} <= set(graph)
    assert "toolkit.checkpointing" in graph["toolkit.training.loop"]  # ``from toolkit.checkpointing import Checkpointer``
    assert "toolkit.checkpointing.convert" in graph["toolkit.checkpointing.resume"]  # a subpackage's modules count
    assert "toolkit.config" in graph["toolkit.training.loop"]  # ``from toolkit.config import RunConfig, ...``
    assert "toolkit.layout" in graph["toolkit.config.arguments"]  # ``from toolkit import layout``
    assert "toolkit.config.parsing" in graph["toolkit.config.arguments"]  # ``from toolkit.config import parsing``
    assert "toolkit.reporting.metrics" in graph["toolkit.cli.verify"]  # a function-local import
    # ... and the cycle finder finds cycles.
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_relative_imports_resolve():
    tree = ast.parse("from . import layout\nfrom .errors import ConfigError\nimport toolkit.models.loading\n")
    known = {"toolkit", "toolkit.layout", "toolkit.errors", "toolkit.models.loading", "toolkit.x"}
    assert _toolkit_edges("toolkit.x", tree, known) == {"toolkit.layout", "toolkit.errors", "toolkit.models.loading"}


def _listed(package: str) -> list[str]:
    """The names a package's docstring lists, in order: its lines "  name  what it does" ("a, b": two, in order)."""
    doc = ast.get_docstring(_modules()[package], clean=False)
    names = []
    for line in doc.splitlines():
        listed = re.match(r"  ([a-z_.]+(?:, [a-z_.]+)*)  +\S", line)
        if listed:
            names += [f"{package}.{name}" for name in listed.group(1).split(", ")]
        elif names:
            break
    return names


def _layers(package: str = PACKAGE) -> list[str]:
    """Every module in import order, bottom first: ``toolkit/__init__.py``'s list, each subpackage replaced by its own
    docstring's list followed by the package itself (its ``__init__`` may import its modules, never the reverse)."""
    order = []
    for name in _listed(package):
        order += (_layers(name) + [name]) if _is_package(name) else [name]
    return order


def test_every_import_points_up_the_list_of_modules_in_the_package_docstrings():
    """The package docstring lists the subpackages in layers, each subpackage's docstring its modules; each module
    imports only modules listed above it, and every module is listed (``__main__`` imports its commands by string)."""
    graph, layers = _graph(), _layers()
    assert layers[:3] == ["toolkit.errors", "toolkit.layout", "toolkit.loss"]  # the parser reads
    assert layers.index("toolkit.checkpointing.manager") < layers.index("toolkit.checkpointing")  # package after its own
    assert "toolkit.tasks.grpo.task" in layers  # nested subpackages too
    unlisted = set(graph) - set(layers) - {PACKAGE, f"{PACKAGE}.__main__"}
    assert not unlisted, f"modules missing from their package's docstring list: {sorted(unlisted)}"
    assert not set(layers) - set(graph), f"listed, but no such module: {sorted(set(layers) - set(graph))}"
    rank = {name: i for i, name in enumerate(layers)}
    upward = [f"{name} -> {imported}" for name in layers for imported in sorted(graph[name])
              if rank.get(imported, len(layers)) >= rank[name]]
    assert not upward, f"imports of a module listed below (or beside) the importer: {upward}"


def test_no_task_module_borrows_from_another_task():
    """Shared helpers live below the tasks (data, models, parallel): a task's module imports only the Task interface
    (``tasks.base``), the causal LM the generative tasks extend (``tasks.lm``), DPO's reference model and its own
    package (GRPO's modules)."""
    graph = _graph()
    shared = {"toolkit.tasks", "toolkit.tasks.base", "toolkit.tasks.lm", "toolkit.tasks.reference"}
    borrowed = [f"{name} -> {imported}" for name in graph if name.startswith("toolkit.tasks.")
                for imported in graph[name] if imported.startswith("toolkit.tasks") and imported not in shared
                and not imported.startswith(name.rpartition(".")[0] + ".") and name not in shared]
    assert not borrowed, f"a task borrows from another task's module: {borrowed}"


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, f"import cycle between toolkit modules: {' -> '.join(cycle)}"


def test_config_depends_only_on_standard_library_modules_of_the_toolkit():
    graph, trees = _graph(), _modules()
    parts = {name for name in graph if name.startswith("toolkit.config.") and name != "toolkit.config.help"}
    assert {"toolkit.config.parsing", "toolkit.config.checks", "toolkit.config.grpo"} <= parts  # the walk sees them
    # upstream: imported inside the function that builds the parser, like transformers, which it imports
    base = {"toolkit.errors", "toolkit.layout", "toolkit.env.elastic", "toolkit.config.help", "toolkit.env.upstream"}
    reached = set(_reachable(graph, "toolkit.config")) - {"toolkit.config"}
    assert reached == base | parts, f"toolkit.config reaches {sorted(reached - base - parts)}"
    for name in sorted(parts):
        outside = {module.split(".")[0] for module, _ in _imports(name, trees[name])} - set(sys.stdlib_module_names)
        # transformers: HfArgumentParser, imported inside the function that builds the parser
        # transformers: HfArgumentParser, and AutoConfig for a model's config, each imported inside the function
        allowed = {PACKAGE, "yaml"} | ({"transformers"} if name in ("toolkit.config.parsing", "toolkit.config.arguments")
                                       else set())
        assert outside <= allowed, f"{name} imports {sorted(outside - allowed)}"
    for name in ("toolkit.errors", "toolkit.layout", "toolkit.config.help"):
        assert graph[name] == set(), f"{name} imports toolkit modules {sorted(graph[name])}"
        outside = {module.split(".")[0] for module, _ in _imports(name, trees[name])} - set(sys.stdlib_module_names)
        assert not outside, f"{name} imports non-stdlib {sorted(outside)}"
    # the elastic restart policy that config applies: the environment and the run folder, read like config reads them
    assert graph["toolkit.env.elastic"] == {"toolkit.errors", "toolkit.layout"}
    outside = {module.split(".")[0] for module, _ in _imports("toolkit.env.elastic", trees["toolkit.env.elastic"])}
    assert outside - set(sys.stdlib_module_names) <= {PACKAGE, "yaml"}


def test_loop_does_not_reach_report():
    """report reads finished runs; the loop writes them. The loop reaching report (even through another module)
    would make every training process load the reader's dependencies and invite the two to share state."""
    paths = _reachable(_graph(), "toolkit.training.loop")
    assert "toolkit.checkpointing.checkpoint" in paths  # the walk does walk
    via = " -> ".join(paths.get("toolkit.reporting.report", []))
    assert "toolkit.reporting.report" not in paths, f"toolkit.training.loop imports toolkit.reporting.report via {via}"


def test_no_function_in_the_package_is_over_80_lines():
    """Issue 24's bound (train() included): a longer function is split, not grown (decorators and docstring count)."""
    long = []
    for path in sorted(Path(SOURCE).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
                if lines > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_a_deferred_module_imports_the_real_one_on_first_use(tmp_path, monkeypatch):
    """toolkit.env.upstream's stand-in (what peft holds for bitsandbytes after ``upstream.import_peft``): a module that
    imported it while it stood in reaches the real module's attributes on first use, and then the real one is in
    ``sys.modules``; a probe of a module's machinery (``__path__``) imports nothing."""
    from toolkit.env import upstream

    (tmp_path / "deferred_probe_module.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stand_in = upstream._DeferredModule("deferred_probe_module")
    monkeypatch.setitem(sys.modules, "deferred_probe_module", stand_in)
    import deferred_probe_module as held  # what `import bitsandbytes as bnb` in peft.helpers gets

    del sys.modules["deferred_probe_module"]  # as import_peft takes it out
    assert held is stand_in and not hasattr(held, "__path__") and "deferred_probe_module" not in sys.modules
    assert held.VALUE == 42
    assert sys.modules["deferred_probe_module"].__file__ == str(tmp_path / "deferred_probe_module.py")


def test_every_folder_of_the_package_is_a_package_the_wheel_finds():
    """setup.py finds the packages (``find_packages``), which sees a folder only with an ``__init__.py``: a folder of
    modules without one would be left out of every wheel (tests/launch/test_install.py builds and installs one)."""
    folders = {p.parent for p in Path(SOURCE).rglob("*.py") if "__pycache__" not in p.parts}
    assert Path(SOURCE, "tasks", "grpo") in folders  # the walk walks
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert not missing, f"folders without __init__.py (missing from the wheel): {missing}"
    setup = Path(ROOT, "setup.py").read_text()
    assert 'find_packages(include=["toolkit", "toolkit.*"])' in setup

"""The callback stays glue: new behaviour goes into the parts (probe, state, agreement, loader switcher)."""

import ast
from pathlib import Path

import pytest

import lightning_dltune.callback as callback


def test_the_callback_is_small_and_its_methods_short():
    source = Path(callback.__file__).read_text()
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DataLoaderTuner"]
    docstring = cls.body[0]
    lines = len(source.splitlines()) - (docstring.end_lineno - docstring.lineno + 1)
    # a smell to look at, not a target (issue 50 moves the decisions into one controller per loader): 300 until the
    # callback composed its state for copies and checkpoints (`_plain_state`, `_tuning_state`), 2026-12-07
    assert lines < 330, f"callback.py has {lines} lines besides the class docstring: move behaviour into a part"
    long = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    assert max(long.values()) <= 40, {k: v for k, v in long.items() if v > 40}


TUNING_MODULES = ("model", "compare", "windows", "rules", "diagnose", "state")


@pytest.mark.parametrize("name", TUNING_MODULES)
def test_the_tuning_modules_have_short_functions_and_no_condition_on_message_text(name):
    """The decision reads as a table of small rules: no function over 40 lines (docstring included), and no rule that
    branches on the words of a message (``.startswith``/``.endswith`` on text, ``"..." in`` a reason, a failure or a
    decision): conditions are typed values (a rule's name, ``model.Bound``)."""
    import importlib

    module = importlib.import_module(f"lightning_dltune.tuning.{name}")
    tree = ast.parse(Path(module.__file__).read_text())
    long = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    assert max(long.values()) <= 40, {k: v for k, v in long.items() if v > 40}
    text_tests = [node.lineno for node in ast.walk(tree) if _tests_text(node) and node.lineno not in _migrations(tree)]
    assert all(
        _tests_text(ast.parse(code).body[0].value) for code in ('"memory budget" in t.failed', "b.startswith('m')")
    )
    assert not text_tests, f"lightning_dltune/tuning/{name}.py tests message text on lines {text_tests}"


def _migrations(tree: ast.Module) -> set[int]:
    """The lines of ``Trial.from_dict``: a trial saved before rules had names has only its words to say which it was."""
    found = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "from_dict"]
    return {line for f in found for line in range(f.lineno, (f.end_lineno or f.lineno) + 1)}


def _tests_text(node: ast.AST) -> bool:
    """``x.startswith(...)``/``x.endswith(...)``, or ``"words" in x``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("startswith", "endswith")
    if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
        return False
    return isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)


def test_the_tuning_core_is_pure_and_the_package_shows_its_parts():
    """The tuning core reads no clock and imports no torch, Lightning or psutil, nor the parts that act on a run
    (``output``, ``switching``); the package's folders are its parts."""
    import lightning_dltune

    root = Path(lightning_dltune.__file__).parent
    parts = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert parts == {"tuning", "measurement", "switching", "output", "tools"}
    for path in (root / "tuning").glob("*.py"):
        imported = {name.split(".")[0] for name, _ in _imports(path)}
        assert not imported & {"torch", "lightning", "psutil", "time", "os"}, (path.name, imported)
        ours = {name for name, _ in _imports(path) if name.startswith("lightning_dltune.")}
        assert not {n for n in ours if n.split(".")[1] in ("output", "switching")}, (path.name, ours)


def _modules() -> dict[str, Path]:
    import lightning_dltune

    root = Path(lightning_dltune.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        parts = ("lightning_dltune", *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path) -> list[tuple[str, bool]]:
    """Every module ``path`` imports (absolute name, the imported name where it is a module of ours too), and
    whether at import time (the module's body, not a function's or ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    modules = _modules()
    package = ".".join(k for k, v in modules.items() if v == path for _ in [0])
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*above, *([node.module] if node.module else [])])
            for a in node.names:
                name = f"{base}.{a.name}"
                found.append((name if name in modules else base, id(node) in top))
    return found


def _graph(at_import: bool = False) -> dict[str, set[str]]:
    """Our modules, each with ours it imports (all of them, or only those imported at import time)."""
    modules = _modules()
    return {
        name: {n for n, top in _imports(path) if n in modules and n != name and (top or not at_import)}
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of ``graph`` (empty: none), by depth-first search."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_the_package_s_imports_form_a_tree():
    """No module imports one that imports it back, not even inside a function; nor does a part (a folder, or a
    module of the package's root) import a part that imports it back. A module's ``__init__`` imports its package's
    modules, so a part's members are seen through the part (``lightning_dltune`` itself is the public API:
    ``tools`` alone imports it)."""
    graph = _graph()
    assert _cycle(graph) == [], "modules import each other in a circle"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check finds one
    parts: dict[str, set[str]] = {}
    for module, imported in graph.items():
        if module == "lightning_dltune":
            continue
        part = ".".join(module.split(".")[:2])
        parts.setdefault(part, set()).update(".".join(n.split(".")[:2]) for n in imported if n != "lightning_dltune")
        parts[part].discard(part)
    assert _cycle(parts) == [], "the package's parts import each other in a circle"
    assert {m for m, imported in graph.items() if "lightning_dltune" in imported} <= {"lightning_dltune.tools.cli"}


def test_importing_the_tuning_core_loads_neither_torch_nor_lightning():
    """What the tuning core imports when it is imported (its own imports and theirs, inside the package) is pure
    Python: the decision can be read and tested without torch or Lightning."""
    graph, modules = _graph(at_import=True), _modules()
    seen, todo = set(), [m for m in modules if m.startswith("lightning_dltune.tuning.")]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    external = {n.split(".")[0] for m in seen for n, top in _imports(modules[m]) if top}
    assert not external & {"torch", "lightning", "pytorch_lightning", "psutil", "numpy"}, sorted(seen)


def test_the_package_exports_what_a_user_meets_and_nothing_behind_it():
    """``lightning_dltune`` exports the callback, the mixin, the warning category and the types of the tuner's results:
    each is named in the README or the callback's docstring, where a user meets it."""
    import lightning_dltune

    public = set(lightning_dltune.__all__) - {"__version__"}
    assert public == {
        "DataLoaderTuner",
        "TunableDataModuleMixin",
        "DLTuneWarning",
        "Trial",
        "LoaderSettings",
        "WindowStats",
        "Phase",
    }
    said = (Path(lightning_dltune.__file__).parent.parent / "README.md").read_text() + (callback.__doc__ or "")
    said += callback.DataLoaderTuner.__doc__ or ""
    assert all(name in said for name in public), [name for name in public if name not in said]

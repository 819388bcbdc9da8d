"""The callback stays glue: new behaviour goes into the parts (probe, state, agreement, loader switcher)."""

import ast
from pathlib import Path

import lightning_dltune.callback as callback


def test_the_callback_is_small_and_its_methods_short():
    source = Path(callback.__file__).read_text()
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DataLoaderTuner"]
    docstring = cls.body[0]
    lines = len(source.splitlines()) - (docstring.end_lineno - docstring.lineno + 1)
    assert lines < 300, f"callback.py has {lines} lines besides the class docstring: move behaviour into a part"
    long = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    assert max(long.values()) <= 40, {k: v for k, v in long.items() if v > 40}

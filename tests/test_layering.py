"""The packages' layering (docs/ARCHITECTURE.md, "Who imports whom"): kernels, layers, models and the
cache views they share sit below the engine, the state store and the server, and never import them,
at module level or lazily inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engram

SRC = Path(engram.__file__).parent
UPPER = ("engine", "state", "server")  # what the lower packages must not import
LOWER = ("ops", "cache", "layers", "models")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a source file, relative ones resolved."""
    package = ["engram", *path.relative_to(SRC).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module == "engram" or node.module is None:  # `from engram import engine`: the alias names the module
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


def upward_imports(package: str) -> list[str]:
    return [
        f"{path.relative_to(SRC)}:{line} imports {module}"
        for path in sorted((SRC / package).rglob("*.py"))
        for line, module in imported_modules(path)
        if any(module == f"engram.{up}" or module.startswith(f"engram.{up}.") for up in UPPER)
    ]


@pytest.mark.parametrize("package", LOWER)
def test_lower_packages_import_no_engine_state_or_server(package):
    assert upward_imports(package) == []


def test_the_check_sees_every_form_of_import(tmp_path, monkeypatch):
    """Absolute, from-package, relative and lazy imports are all caught."""
    fake = tmp_path / "engram"
    (fake / "layers").mkdir(parents=True)
    (fake / "layers" / "x.py").write_text(
        "import engram.engine.runner\n"
        "from engram import state\n"
        "from ..server import app\n"
        "from engram.ops import conv\n"
        "def f():\n"
        "    from engram.engine.pools import StatePool\n"
    )
    monkeypatch.setitem(globals(), "SRC", fake)
    assert upward_imports("layers") == [
        "layers/x.py:1 imports engram.engine.runner",
        "layers/x.py:2 imports engram.state",
        "layers/x.py:3 imports engram.server",
        "layers/x.py:6 imports engram.engine.pools",
    ]

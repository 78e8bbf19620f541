"""The shape of the code: no import cycles in corelib, and modules of a readable size.

An import inside a function counts (a lazy import that dodges a cycle is still a cycle); one
under ``if TYPE_CHECKING:`` does not. ``from package import name`` depends on the package's
``__init__`` (its face), ``import package.module`` and ``from package.module import name`` on
that module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from corelib.testing.imports import import_cycles, import_graph

ROOT = Path(__file__).resolve().parents[2]
LONGEST = 400  # lines; a longer module says why in its docstring ("Long: ...")


def test_corelib_has_no_import_cycles() -> None:
    cycles = import_cycles(import_graph(ROOT / "corelib", "corelib"))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_the_checker_sees_a_lazy_cycle_and_ignores_a_type_only_one(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("from pkg.a import f\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import x\n")
    (package / "d.py").write_text("from pkg.c import y\n")
    cycles = import_cycles(import_graph(package, "pkg"))
    assert cycles == [["pkg.a", "pkg.b"]], cycles


def test_no_module_is_over_the_length_limit_without_a_reason() -> None:
    long = []
    for path in sorted((ROOT / "corelib").rglob("*.py")):
        lines = path.read_text().count("\n")
        if lines <= LONGEST:
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "Long:" not in docstring:
            long.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not long, f"over {LONGEST} lines with no 'Long:' reason in the docstring: {', '.join(long)}"

"""The import graph of a package, read from its source, its cycles, and its layers (a test facility).

An import inside a function counts (a lazy import that dodges a cycle is still a cycle); one
under ``if TYPE_CHECKING:`` does not. ``from pkg.mod import name`` depends on ``pkg.mod``;
``from pkg import name`` depends on ``pkg`` itself (its ``__init__``), and on ``pkg.name`` too
when that is a module.

The same graph, folded by :func:`unit_graph` into the package's units (each subpackage of the
top package, each module at its root, and the root ``__init__``), is what :func:`layer_violations`
holds against an ordered list of layers: a unit may import its own layer and those below it.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

Graph = dict[str, set[str]]


def _modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: dict[str, Path], package: str) -> None:
        self.module, self.is_package, self.modules, self.package = module, is_package, modules, package
        self.found: set[str] = set()

    def _resolve(self, name: str) -> str | None:
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for statement in node.orelse:
                self.visit(statement)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == self.package or alias.name.startswith(self.package + "."):
                target = self._resolve(alias.name)
                if target:
                    self.found.add(target)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module if self.is_package else self.module.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            name = f"{base}.{node.module}" if node.module else base
        else:
            name = node.module or ""
        if name != self.package and not name.startswith(self.package + "."):
            return
        target = self._resolve(name)
        if target:
            self.found.add(target)
        for alias in node.names:
            if f"{name}.{alias.name}" in self.modules:
                self.found.add(f"{name}.{alias.name}")


def import_graph(root: Path, package: str) -> Graph:
    """Module -> the modules of ``package`` it imports (``root`` is the package's directory)."""
    modules = _modules(root, package)
    graph: Graph = {}
    for module, path in modules.items():
        visitor = _Imports(module, path.name == "__init__.py", modules, package)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        visitor.found.discard(module)
        graph[module] = visitor.found
    return graph


def import_cycles(graph: Graph) -> list[list[str]]:
    """Every group of modules that import each other, directly or around a loop (sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for neighbour in sorted(graph.get(node, ())):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in on_stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def unit_of(module: str) -> str:
    """The unit a module belongs to: ``pkg.sub`` for anything in subpackage ``sub``, ``pkg.mod`` for a root module,
    ``pkg`` for the root ``__init__``."""
    return ".".join(module.split(".")[:2])


def unit_graph(graph: Graph) -> dict[tuple[str, str], set[str]]:
    """Each import between two units -> the module imports that make it (``"a.b -> c.d"``)."""
    edges: dict[tuple[str, str], set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            pair = (unit_of(module), unit_of(target))
            if pair[0] != pair[1]:
                edges.setdefault(pair, set()).add(f"{module} -> {target}")
    return edges


def layer_violations(graph: Graph, layers: Sequence[Sequence[str]]) -> list[str]:
    """Every import that goes up the ``layers`` (listed top first), and every unit with no layer (sorted)."""
    rank = {unit: depth for depth, layer in enumerate(layers) for unit in layer}
    found = [f"{unit} has no layer" for unit in sorted({unit_of(module) for module in graph} - rank.keys())]
    for (importer, imported), imports in sorted(unit_graph(graph).items()):
        if importer in rank and imported in rank and rank[imported] < rank[importer]:
            found.append(f"{importer} imports {imported}, a layer above it: {'; '.join(sorted(imports))}")
    return found

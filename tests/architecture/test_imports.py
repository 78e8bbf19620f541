"""The shape of the code: no import cycles in corelib, its packages in layers, and modules of a readable size.

An import inside a function counts (a lazy import that dodges a cycle is still a cycle); one
under ``if TYPE_CHECKING:`` does not. ``from package import name`` depends on the package's
``__init__`` (its face), ``import package.module`` and ``from package.module import name`` on
that module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from corelib.testing.imports import import_cycles, import_graph, layer_violations

ROOT = Path(__file__).resolve().parents[2]
LONGEST = 400  # lines; a longer module says why in its docstring ("Long: ...")

#: corelib's layers, top first: a unit (a subpackage, a module at the root, or the root ``__init__``) imports
#: units of its own layer and of the layers below it, never one above. One step: the engine hands it to a
#: transport, which runs it through the device step, which calls the models and ops on a device.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("corelib", "corelib.__main__"),  # the face: corelib.LLM, corelib.SamplingParams, python -m corelib
    ("corelib.testing",),  # the test facilities (pytest plugin, conformance, engine doubles) over all of it
    ("corelib.llm",),  # the Python API; it takes the vLLM habits of the commands
    ("corelib.cli",),  # the commands
    ("corelib.loadtest",),  # workloads, and the load generator of bench-serve
    ("corelib.server",),  # the OpenAI-compatible server and its engine process
    ("corelib.engine",),  # the request loop: scheduler, packing, the public Engine
    ("corelib.transport",),  # where steps run: in process, SHM workers, other nodes
    ("corelib.startup",),  # config composed, backend probed, plan evaluated, pool sized
    ("corelib.observe",),  # what the engine reports: metrics, the step timeline, the run directory; it may
    # read a step (corelib.step), never the engine
    ("corelib.step",),  # the device step: the step layout, arenas, buckets, staging, runner, handoff
    ("corelib.plugins",),  # the plugin hooks: backends, architectures, gates
    ("corelib.models",),
    ("corelib.ops",),
    ("corelib.sampling_params",),  # what a request asks for: the ops derive the sampler columns from it
    # the device layer, and the names plugins import it by
    ("corelib.platform", "corelib.device", "corelib.graph", "corelib.backend", "corelib.native"),
    ("corelib.config",),  # the schema, the gates and the plan: data every layer reads (the device's too)
    ("corelib.support",),  # progress, fault points, text, output structure
    ("corelib.trust",),  # files, the hub, Hydra's config checked, a worker's environment
    ("corelib.errors", "corelib.version", "corelib.conf"),  # what every layer raises; the version; the YAML tree
)


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


def test_corelib_packages_import_only_down_the_layers() -> None:
    graph = import_graph(ROOT / "corelib", "corelib")
    wrong = layer_violations(graph, LAYERS)
    assert not wrong, "against the layers (tests/architecture/test_imports.py LAYERS):\n" + "\n".join(wrong)


def test_the_layer_checker_sees_a_lazy_upward_import_and_ignores_a_type_only_one(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for sub in ("top", "low"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "face.py").write_text("from pkg.top import a\n")
    (package / "top" / "a.py").write_text("from pkg.low.b import g\n")
    (package / "low" / "b.py").write_text("def g():\n    from pkg.top import a\n")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.top.a import g\n"
    (package / "low" / "c.py").write_text(type_only)
    graph = import_graph(package, "pkg")
    layers = (("pkg", "pkg.face"), ("pkg.top",), ("pkg.low",))
    assert layer_violations(graph, layers) == [
        "pkg.low imports pkg.top, a layer above it: pkg.low.b -> pkg.top; pkg.low.b -> pkg.top.a"]
    assert layer_violations(graph, (("pkg", "pkg.face"), ("pkg.top",))) == ["pkg.low has no layer"]
    (package / "low" / "b.py").write_text("def g():\n    return 1\n")
    assert layer_violations(import_graph(package, "pkg"), layers) == []


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

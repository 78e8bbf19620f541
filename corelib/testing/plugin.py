"""pytest plugin of the backend conformance suite: command-line options, targets, fixtures.

Load it with ``-p corelib.testing.plugin`` (corelib's own pyproject does so in ``addopts``).
Every test that asks for ``conformance_device`` runs once per target: each requested
backend on each runtime it has here (see :func:`corelib.testing.targets.discover_targets`).

Tests that need hardware this machine lacks are deselected at collection, not skipped one by
one: those marked with a backend's hardware mark (``gpu``, ``npu``, ``mlu``), and the op
conformance tests of a backend's kernels on its emulated runtime (they load only natively).
The run ends with one line saying how many need which hardware.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from corelib.config.schema import RuntimeMode
from corelib.errors import BackendUnavailable, CorelibError
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Device, Runtime
from corelib.plugins import PluginRegistry
from corelib.testing.helpers import Busy, default_busy
from corelib.testing.targets import Target, discover_targets, resolve_spec

if TYPE_CHECKING:
    from corelib.testing.op_conformance import OpTarget

# Plain asserts in the suite get pytest's explanations although its module is not test_*.py.
pytest.register_assert_rewrite("corelib.testing.conformance", "corelib.testing.op_conformance")

_registry_key = pytest.StashKey[PluginRegistry]()
_targets_key = pytest.StashKey[list[Target]]()
_specs_key = pytest.StashKey[dict[Target, DeviceSpec | str]]()
_hardware_key = pytest.StashKey[Counter[str]]()  # deselected tests by the hardware mark they need
HARDWARE_NAMES = {"gpu": "a GPU", "npu": "an NPU", "mlu": "an MLU"}
NO_KERNELS = "-no-kernels"  # an op test of a backend without an op provider
REPEATED_CLOSE_TEST = "test_close_finishes_queued_work_and_joins_every_thread"  # --corelib-repeat-close


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("corelib", "corelib backend conformance suite")
    group.addoption(
        "--corelib-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the conformance suite against this backend (repeatable; default: every installed one)",
    )
    group.addoption(
        "--corelib-runtime",
        choices=[RuntimeMode.native.value, RuntimeMode.emulated.value],
        default=None,
        help="only this runtime (default: emulated where possible, native where the hardware is present)",
    )
    group.addoption(
        "--corelib-chaos",
        type=float,
        default=0.5,
        help="chaos of the extra emulated run of each backend (0 skips that run; default 0.5)",
    )
    group.addoption("--corelib-seed", type=int, default=0, help="seed of the emulator's chaos delays")
    group.addoption(
        "--corelib-timeout", type=float, default=10.0, help="longest wait of any device operation, in s"
    )
    group.addoption(
        "--corelib-repeat-close",
        type=int,
        default=0,
        metavar="N",
        help="run the conformance test of close() N more times per target, inside the same session (a race "
        "between close and a helper thread shows as one failure in many)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (the op conformance sweep)")
    config.addinivalue_line("markers", "sweep: a case of the op conformance sweep (every geometry); also marked slow")
    registry = _registry(config)
    for name in registry.backend_names:
        mark = registry.get(name).hardware_mark
        if mark is not None:
            config.addinivalue_line("markers", f"{mark}: needs real {name} hardware; skipped elsewhere")


def _absent_hardware(registry: PluginRegistry) -> tuple[dict[str, str], set[str]]:
    """(hardware mark -> backend) for the hardware missing here, and the marks of hardware present."""
    absent: dict[str, str] = {}
    present: set[str] = set()
    for name in registry.backend_names:
        try:
            backend = registry.get(name)
        except CorelibError:
            continue  # a plugin that did not load: its tests report that themselves
        mark = backend.hardware_mark
        if mark is None:
            continue
        if backend.probe().native:
            present.add(mark)
        else:
            absent.setdefault(mark, name)
    return absent, present


def _hardware_needed(item: pytest.Item, registry: PluginRegistry, absent: dict[str, str],
                     present: set[str]) -> str | None:
    """The mark of the absent hardware ``item`` needs; "" when it runs natively elsewhere in this run."""
    for marker in item.iter_markers():
        if marker.name in absent:
            return marker.name
    callspec = getattr(item, "callspec", None)
    target = callspec.params.get("conformance_target") if callspec is not None else None
    if not isinstance(target, Target):
        return None
    if target.hardware_mark in absent:
        return target.hardware_mark
    if "op_target" in getattr(item, "fixturenames", ()):
        backend = registry.get(target.backend)
        mark = backend.hardware_mark
        if backend.op_provider() is None:
            return NO_KERNELS  # it runs the reference ops: nothing of its own to check
        if target.runtime is RuntimeMode.emulated and mark is not None:
            return "" if mark in present else mark  # its kernels load only on the hardware
    return None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    registry = _registry(config)
    absent, present = _absent_hardware(registry)
    counts: Counter[str] = Counter()
    kept, dropped = [], []
    for item in items:
        need = _hardware_needed(item, registry, absent, present)
        if need is None:
            kept.append(item)
            continue
        dropped.append(item)
        if need:
            counts[need] += 1
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    config.stash[_hardware_key] = counts


def hardware_summary(counts: Counter[str]) -> str | None:
    """``deselected 412 tests that need hardware absent here: 230 need a GPU, ...``, or None when none were."""
    hardware = {mark: n for mark, n in sorted(counts.items()) if mark != NO_KERNELS}
    lines = []
    if hardware:
        parts = [f"{n} need {HARDWARE_NAMES.get(mark, f'{mark} hardware')}" for mark, n in hardware.items()]
        lines.append(f"deselected {sum(hardware.values())} tests that need hardware absent here: {', '.join(parts)}")
    if counts[NO_KERNELS]:
        lines.append(f"{'and ' if lines else 'deselected '}{counts[NO_KERNELS]} op tests of backends that run the "
                     "reference ops (no kernels of their own)")
    return "; ".join(lines) or None


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # an xdist worker: tell the controller
    if workeroutput is not None:
        counts: Counter[str] = session.config.stash.get(_hardware_key, Counter())
        workeroutput["corelib_hardware"] = dict(counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    counts = getattr(node, "workeroutput", {}).get("corelib_hardware")
    config = getattr(node, "config", None)
    if counts is not None and config is not None:
        config.stash[_hardware_key] = Counter(counts)  # every worker collects the same tests


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    counts: Counter[str] = config.stash.get(_hardware_key, Counter())
    line = hardware_summary(counts)
    if line is not None:
        terminalreporter.write_line(f"corelib: {line}")


def _registry(config: pytest.Config) -> PluginRegistry:
    if _registry_key not in config.stash:
        config.stash[_registry_key] = PluginRegistry()
    return config.stash[_registry_key]


def _targets(config: pytest.Config) -> list[Target]:
    if _targets_key not in config.stash:
        runtime = config.getoption("--corelib-runtime")
        config.stash[_targets_key] = discover_targets(
            _registry(config),
            backends=config.getoption("--corelib-backend"),
            runtime=RuntimeMode(runtime) if runtime else None,
            chaos=config.getoption("--corelib-chaos"),
            seed=config.getoption("--corelib-seed"),
        )
    return config.stash[_targets_key]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_target" not in metafunc.fixturenames:
        return
    params = []
    for target in _targets(metafunc.config):
        marks = [getattr(pytest.mark, target.hardware_mark)] if target.hardware_mark else []
        params.append(pytest.param(target, id=target.id, marks=marks))
    metafunc.parametrize("conformance_target", params)
    repeats = metafunc.config.getoption("--corelib-repeat-close")
    if repeats > 0 and metafunc.function.__name__ == REPEATED_CLOSE_TEST:
        metafunc.fixturenames.append("close_repeat")  # a parameter the test does not take: its runs' ids
        metafunc.parametrize("close_repeat", range(repeats + 1), ids=[f"run{i}" for i in range(repeats + 1)])


@pytest.fixture
def conformance_spec(conformance_target: Target, request: pytest.FixtureRequest) -> DeviceSpec:
    """The device spec of the target; the test skips when the runtime cannot be had here."""
    config = request.config
    if _specs_key not in config.stash:
        config.stash[_specs_key] = {}
    specs = config.stash[_specs_key]
    if conformance_target not in specs:
        try:
            specs[conformance_target] = resolve_spec(
                conformance_target, _registry(config), config.getoption("--corelib-timeout")
            )
        except BackendUnavailable as error:
            specs[conformance_target] = str(error)
    spec = specs[conformance_target]
    if isinstance(spec, str):
        pytest.skip(spec)
    return spec


@pytest.fixture
def conformance_device(conformance_spec: DeviceSpec, request: pytest.FixtureRequest) -> Iterator[Device]:
    """An open device of the target, closed after the test; the test fails if a thread leaks."""
    before = set(threading.enumerate())
    device = _registry(request.config).get(conformance_spec.backend).open(conformance_spec)
    try:
        yield device
    finally:
        device.close()
    leaked = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("corelib-")]
    assert not leaked, f"{device.name}: threads still alive after close(): {leaked}"


@pytest.fixture
def conformance_busy(conformance_device: Device) -> Busy | None:
    """How to keep a stream busy on this device; override it for a backend the default cannot drive."""
    return default_busy(conformance_device)


@pytest.fixture
def op_target(conformance_spec: DeviceSpec, request: pytest.FixtureRequest) -> OpTarget:
    """The target's op provider loaded on its device; skips, naming why, where there is none to test."""
    from corelib.testing.op_conformance import OpTarget

    backend = _registry(request.config).get(conformance_spec.backend)
    provider = backend.op_provider()
    if provider is None:
        pytest.skip(f"{backend.name} offers no op provider: it runs the reference ops")
    if conformance_spec.runtime is not Runtime.native:
        pytest.skip(f"{backend.name}: op provider {provider.name!r} loads only on the native runtime")
    reason = provider.available()
    if reason is not None:
        pytest.skip(f"{backend.name}: op provider {provider.name!r} is unavailable: {reason}")
    device: Device = request.getfixturevalue("conformance_device")
    return OpTarget(
        provider=provider.name,
        declared=provider.op_names(),
        loaded=provider.load(device),
        torch_device=device.torch_device,
        folded_norms=provider.folded_norms,
        device=device,
        no_graph_reason=f"{device.name} cannot capture graphs",
    )

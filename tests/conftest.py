"""Fixtures shared by the tests; the plain functions live in support.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from hydra.core.config_store import ConfigStore
from support import HERMETIC_VARIABLES, PLUGIN_FIXTURES, Cli, CliResult, EngineFactory, run_python

from corelib.engine import Engine
from corelib.transport import segment

# A test run started in the background of a script (`pytest &`) inherits SIGINT ignored, and so
# would every process the tests start: the Ctrl-C tests need it delivered. (A handler, unlike
# SIG_IGN, is not inherited across exec.)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# pytest-xdist runs a test process per core: each one's torch gets its share of the cores, not all
# of them. With every test process's thread pool as wide as the machine, the pools of two processes
# on two cores wait for each other at every op's barrier, and the in-process engine runs and the
# reference's forwards take several times the CPU. Processes the tests start (CLI runs, SHM
# workers, servers) keep torch's own choice, as a user's would.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    """``cli("plan", "backend=npu", env=..., pythonpath=...)`` runs ``python -m corelib`` in tmp_path.

    The working directory is a temporary one, so Hydra's default output directory never
    lands in the repository.
    """

    def run(*args: str, env: Mapping[str, str] | None = None, pythonpath: Sequence[Path] = ()) -> CliResult:
        return run_python(["-m", "corelib", *args], cwd=tmp_path, env=env, pythonpath=pythonpath)

    return run


@pytest.fixture(autouse=True)
def _hermetic_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # TORCH_DEVICE_BACKEND_AUTOLOAD stays: corelib set it when this process imported it.
    for name in HERMETIC_VARIABLES:
        if name != "TORCH_DEVICE_BACKEND_AUTOLOAD":
            monkeypatch.delenv(name, raising=False)


@pytest.fixture
def private_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of this test's own in place of /dev/shm, for a test that plants segments by name.

    Every engine start sweeps /dev/shm, and so do the other test processes and any other run of
    the suite on the host: a stale segment planted there under a fixed name may be swept (or
    planted again) by one of them while the test looks at it.
    """
    where = tmp_path / "shm"
    where.mkdir()
    monkeypatch.setattr(segment, "SHM_DIR", where)
    return where


@pytest.fixture
def fixture_plugins_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGIN_FIXTURES))


@pytest.fixture
def clean_config_store() -> Iterator[None]:
    """Remove the backend and gate options a test stores in Hydra's process-wide ConfigStore.

    Nothing else is touched: Hydra stores its own configs there once per process, the first
    time anything is composed, and would not store them again.
    """
    repo = ConfigStore.instance().repo
    groups = ("backend", "features")
    before = {group: set(repo.get(group, {})) for group in groups}
    yield
    for group in groups:
        for name in set(repo.get(group, {})) - before[group]:
            del repo[group][name]


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    """Build engines from overrides; every one is closed after the test."""
    engines: list[Engine] = []

    def factory(overrides: Sequence[str]) -> Engine:
        engine = Engine.from_overrides(list(overrides))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A GPU test waits for its own device work at its teardown: an asynchronous device fault (a device-side
    assert, an illegal address) then fails the test that queued it, not the next test of the same worker
    process that happens to synchronize (a faulted CUDA context fails every later call in that process)."""
    yield
    on_gpu = item.get_closest_marker("gpu") is not None and torch.cuda.is_available()
    if on_gpu and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks that follow from what a test does.

    - The op conformance sweep in Triton's CPU interpreter runs on request only
      (``-m interpreter_sweep``): the interpreter runs each kernel element by element in Python,
      so the sweep over every geometry takes about 20 minutes on two cores, while a GPU runs it
      natively in seconds (the backend conformance suite, ``-m gpu``). The default cases of
      every op still run by default.
    - A test that runs the CLI (the ``cli`` fixture: ``python -m corelib`` in a process of its
      own) is slow, so the quick check (``-m "not slow and not soak"``) leaves it to the default run.
    """
    for item in items:
        if item.path.name == "test_triton_ops.py" and item.get_closest_marker("sweep") is not None:
            item.add_marker(pytest.mark.interpreter_sweep)
        if "cli" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)

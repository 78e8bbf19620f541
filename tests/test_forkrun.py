"""The forked ``python -m`` of the tests gives what a fresh interpreter gives, case by case."""

from __future__ import annotations

from pathlib import Path

import forkrun
import pytest
from support import run_python

pytestmark = pytest.mark.slow

PROBE = '''
import atexit, os, sys, threading, time
what = sys.argv[1]
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "env", os.environ.get("PROBE_VALUE"))
print("path", [os.path.basename(p) for p in sys.path[:3]], "main", __name__, "corelib" in sys.modules)
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
if what == "thread":
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
elif what == "exit-int":
    sys.exit(3)
elif what == "exit-text":
    sys.exit("a reason")
elif what == "raise":
    raise ValueError("boom")
elif what == "interrupt":
    raise KeyboardInterrupt
elif what == "startup-variable":
    import torch
    print("threads", torch.get_num_threads())
'''
CASES = ["plain", "thread", "exit-int", "exit-text", "raise", "interrupt", "startup-variable"]


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "forkprobe").mkdir(parents=True)
    (site / "forkprobe" / "__init__.py").write_text("")
    (site / "forkprobe" / "__main__.py").write_text(PROBE)
    (tmp_path / "work").mkdir()
    return site


@pytest.mark.parametrize("what", CASES)
def test_a_forked_run_gives_what_a_fresh_interpreter_gives(what: str, probe: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["-m", "forkprobe", what]
    env = {"PROBE_VALUE": what, **({"OMP_NUM_THREADS": "1"} if what == "startup-variable" else {})}
    assert forkrun.eligible(args, env)
    forked = run_python(args, cwd=tmp_path / "work", env=env, pythonpath=[probe])
    monkeypatch.setenv(forkrun.FRESH_VARIABLE, "1")
    assert not forkrun.eligible(args, env)
    fresh = run_python(args, cwd=tmp_path / "work", env=env, pythonpath=[probe])
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    assert forked.stderr.replace(str(probe), "SITE") == fresh.stderr.replace(str(probe), "SITE")
    assert "to stderr" in forked.stderr and "argv" in forked.stdout and "atexit ran" in forked.stdout


def test_only_python_m_is_forked_and_startup_variables_pick_their_own_server(probe: Path, tmp_path: Path) -> None:
    assert not forkrun.eligible(["-c", "import torch"], {})
    assert not forkrun.eligible(["script.py"], {})
    assert not forkrun.eligible(["-m", "corelib"], {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert forkrun.eligible(["-m", "corelib"], {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    base = {"PROBE_VALUE": "x"}
    first = forkrun.server_for(base)
    assert forkrun.server_for({**base, "PYTHONPATH": "/elsewhere", "CORELIB_X": "1"}) is first
    other = forkrun.server_for({**base, "OMP_NUM_THREADS": "3"})
    assert other is not first

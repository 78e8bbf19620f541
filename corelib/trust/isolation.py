"""How corelib starts a worker process: an isolated interpreter and a controlled environment.

A worker must run the code this process runs, whatever the environment became after start.
Hydra's ``hydra.job.env_set`` (refused since, see :mod:`corelib.trust.hydra_config`) or any other code that
rewrites ``os.environ`` could otherwise hand a worker a ``PYTHONPATH`` with an attacker's
``sitecustomize.py``, or an ``LD_PRELOAD``. So:

- the interpreter starts with ``-I``: it ignores every ``PYTHON*`` variable, the user's
  site-packages and the current directory; its ``sys.path`` is this process's, passed on the
  command line (relative entries anchored where this process started);
- its environment is the one this process had when corelib was imported, minus ``PYTHON*``;
  only variables that choose devices, ranks, threads or corelib's own switches follow the
  current environment (a test arming ``CORELIB_FAULTS``, torchrun's ``MASTER_PORT``): none of
  them can make a process load code;
- multicast collectives are switched off (:data:`NO_MULTICAST`), whatever the environment says.
"""

from __future__ import annotations

import os
import sys

# Taken when corelib is imported, before any Hydra job (and its env_set) starts.
_STARTUP_ENVIRONMENT = dict(os.environ)
_STARTUP_DIRECTORY = os.getcwd()

# Read from the current environment when a worker starts (set, changed or removed since).
RUNTIME_VARIABLES = frozenset({
    "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES",
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS",
})
RUNTIME_PREFIXES = ("CORELIB_",)
# Never passed on: with -I the interpreter ignores them anyway, and a log of the worker's
# environment should not suggest otherwise.
DROPPED_PREFIXES = ("PYTHON",)

# Multicast (NVLink SHARP) collectives can take down GPUs that other jobs share, and no corelib
# path needs them: NCCL, torch's symmetric memory and NVSHMEM each get their switch turned off.
# Variables of libraries a device does not load are inert.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Runs in the worker: take the path and the module from argv, then run the module as __main__.
_BOOT = (
    "import runpy, sys; "
    "module, sys.path[:] = sys.argv[1], sys.argv[2:]; "
    "del sys.argv[1:]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def _is_runtime(name: str) -> bool:
    return name in RUNTIME_VARIABLES or name.startswith(RUNTIME_PREFIXES)


def worker_environment() -> dict[str, str]:
    """The environment of a worker: this process's at start, plus the runtime variables as they are now.

    Multicast stays off (:data:`NO_MULTICAST`) even where the environment switches it on.
    """
    env: dict[str, str] = {}
    for name in sorted({*_STARTUP_ENVIRONMENT, *os.environ}):
        if name.startswith(DROPPED_PREFIXES):
            continue
        value = os.environ.get(name) if _is_runtime(name) else _STARTUP_ENVIRONMENT.get(name)
        if value is not None:
            env[name] = value
    env.update(NO_MULTICAST)
    return env


def worker_path() -> list[str]:
    """This process's ``sys.path`` with every entry absolute ('' is the directory corelib started in)."""
    return [os.path.join(_STARTUP_DIRECTORY, entry) if not os.path.isabs(entry) else entry for entry in sys.path]


def worker_command(module: str) -> list[str]:
    """``python -I`` running ``module`` as ``__main__`` with this process's ``sys.path``."""
    return [sys.executable, "-I", "-c", _BOOT, module, *worker_path()]

"""Devices driven through a torch device module (``TorchDevice``, ``TorchModuleBackend``), by the name plugins import.

The code lives in :mod:`corelib.platform.native`; this module re-exports its public names.
"""

from corelib.platform.native import *  # noqa: F403

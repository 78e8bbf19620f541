"""The device API a backend implements (``Device``, ``Stream``, ``Event``, capabilities), by the name plugins import.

The code lives in :mod:`corelib.platform.device`; this module re-exports its public names.
"""

from corelib.platform.device import *  # noqa: F403

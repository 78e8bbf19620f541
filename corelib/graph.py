"""Captured device graphs (``Graph``, ``GraphParams``), by the name plugins import.

The code lives in :mod:`corelib.platform.graph`; this module re-exports its public names.
"""

from corelib.platform.graph import *  # noqa: F403

"""The ``Backend`` a plugin subclasses and the ``DeviceSpec`` it builds, by the name plugins import.

The code lives in :mod:`corelib.platform.backend`; this module re-exports its public names.
"""

from corelib.platform.backend import *  # noqa: F403

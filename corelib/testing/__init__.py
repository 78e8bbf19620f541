"""The backend conformance suite, reusable by any backend plugin.

Run it against an installed backend::

    pytest -p corelib.testing.plugin --pyargs corelib.testing.conformance --corelib-backend=NAME

Options: ``--corelib-runtime=native|emulated`` (default: every runtime the backend has here),
``--corelib-chaos`` (the extra emulated run's chaos, 0 to skip it), ``--corelib-seed`` and
``--corelib-timeout``. Override the ``conformance_busy`` fixture in a conftest.py when the
default cannot keep one of your streams busy.
"""

from corelib.testing.helpers import Busy, default_busy, require
from corelib.testing.targets import Target, discover_targets, resolve_spec

__all__ = ["Busy", "Target", "default_busy", "discover_targets", "require", "resolve_spec"]

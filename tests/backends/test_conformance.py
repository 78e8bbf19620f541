"""The backend conformance suite, run against every backend and runtime installed here."""

from corelib.testing.conformance import *  # noqa: F403

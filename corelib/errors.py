"""Error types. Each maps to an exit code and prints as one line for the user."""

from __future__ import annotations


def one_line(error: BaseException) -> str:
    """The error as one line: its type and its message with whitespace folded."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class CorelibError(Exception):
    """Base class for errors that corelib reports to the user as one line."""

    exit_code = 1


class ConfigError(CorelibError):
    """The configuration or the command line is wrong; the user must change it."""

    exit_code = 2


class UnknownOption(ConfigError):
    """``group=option`` names no option of the group (a plugin may still provide it)."""

    def __init__(self, message: str, group: str, option: str) -> None:
        super().__init__(message)
        self.group = group
        self.option = option


class PlanRefused(ConfigError):
    """A feature was forced on but its requirements are not met; lists every unmet one."""

    def __init__(self, unmet: list[tuple[str, str]]) -> None:
        self.unmet = list(unmet)
        super().__init__("\n".join(f"{setting} refused: {reason}" for setting, reason in self.unmet))

    def __reduce__(self) -> tuple[type[PlanRefused], tuple[list[tuple[str, str]]]]:
        return PlanRefused, (self.unmet,)  # it crosses from the engine process whole, exit code included


class PluginError(ConfigError):
    """A backend plugin is missing, broken, or conflicts with another."""


class BackendUnavailable(ConfigError):
    """The selected backend cannot run here with the requested runtime."""


class UnsupportedOperation(CorelibError):
    """A device was asked for something its capabilities do not include."""


class DeviceTimeout(CorelibError):
    """A wait on the device did not finish in time. The message names what was waited for."""


class DeviceError(CorelibError):
    """Device work failed; the message carries the original cause."""


class RequestError(CorelibError):
    """One request is invalid; other requests are unaffected."""

    exit_code = 2


class ConcurrentUse(CorelibError):
    """A second thread called into an engine while another thread was inside it."""


class TransportError(CorelibError):
    """The SHM transport found a corrupt frame, a full ring or a dead peer."""


class WorkerDied(CorelibError):
    """A worker process exited while the engine needed it."""

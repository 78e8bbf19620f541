"""Captured device graphs: device work recorded once and replayed with static buffers.

A backend with the ``graphs`` capability subclasses :class:`Graph` (its public methods do the
checking; the backend overrides the ``_`` methods), and :meth:`corelib.platform.device.Device.graph`
makes one. Captured parameters (:class:`GraphParams`) change between replays where the backend
has ``graph_param_update``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING

from corelib.errors import UnsupportedOperation

if TYPE_CHECKING:
    from corelib.platform.device import Device, DeviceFn, Stream


class GraphParams:
    """Captured parameters that :meth:`Graph.update` may change between replays.

    Device code in a captured closure reads ``params[name]`` when it runs. A backend
    without ``graph_param_update`` keeps the values fixed at capture.
    """

    def __init__(self, values: Mapping[str, int] | None = None) -> None:
        self._values: dict[str, int] = dict(values or {})

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def _set(self, values: Mapping[str, int]) -> None:
        unknown = sorted(set(values) - set(self._values))
        if unknown:
            raise KeyError(f"graph has no captured parameters {unknown}")
        self._values.update(values)

    def as_dict(self) -> dict[str, int]:
        return dict(self._values)


class Graph(ABC):
    """A captured sequence of device work that can be replayed with static buffers."""

    def __init__(self, device: Device, name: str) -> None:
        self.device = device
        self.name = name
        self.params = GraphParams()
        self.is_captured = False

    def capture(self, fn: DeviceFn, stream: Stream, params: Mapping[str, int] | None = None) -> None:
        """Record the device work ``fn`` launches on ``stream``; nothing runs for real."""
        if self.is_captured:
            raise RuntimeError(f"graph {self.name!r} is already captured")
        self.params = GraphParams(params)
        self._capture(fn, stream)
        self.is_captured = True

    def replay(self, stream: Stream) -> None:
        """Queue the captured work on ``stream``."""
        if not self.is_captured:
            raise RuntimeError(f"graph {self.name!r} was never captured")
        self._replay(stream)

    def update(self, stream: Stream, **params: int) -> None:
        """Change captured parameters, ordered on ``stream`` before the next replay."""
        if not self.device.capabilities.graph_param_update:
            raise UnsupportedOperation(f"{self.device.name}: graphs cannot update captured parameters")
        self._update(stream, params)

    def reset(self) -> None:
        """Release the captured work and its memory."""
        self._reset()
        self.is_captured = False

    @abstractmethod
    def _capture(self, fn: DeviceFn, stream: Stream) -> None: ...

    @abstractmethod
    def _replay(self, stream: Stream) -> None: ...

    def _update(self, stream: Stream, params: Mapping[str, int]) -> None:
        raise UnsupportedOperation(f"{self.device.name}: graph parameter update is not implemented")

    def _reset(self) -> None:
        return None

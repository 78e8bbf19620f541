"""The backend plugin base class and the choice of runtime (native or emulated).

A backend subclass sets ``name``, implements ``_probe_native`` (import the vendor SDK, look
for a device) and ``_open_native``. Everything else (error wrapping, the emulated runtime,
narrowing the declared capabilities) happens here.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from corelib.config.schema import BackendConfig, EmulatorConfig, RuntimeMode
from corelib.errors import BackendUnavailable, ConfigError, one_line
from corelib.platform.device import Availability, Capabilities, Device, Runtime

if typing.TYPE_CHECKING:
    from corelib.ops import OpProvider


@dataclass(frozen=True)
class DeviceSpec:
    """Everything a backend needs to open a device; built once at start."""

    backend: str
    runtime: Runtime
    capabilities: Capabilities
    device_index: int = 0
    emulator: EmulatorConfig = field(default_factory=EmulatorConfig)
    timeout_s: float = 60.0

    @property
    def on_host(self) -> bool:
        """The host's cores and memory do the device's work: the device is the host, or the stream emulator
        stands in for it."""
        return self.runtime is Runtime.emulated or self.capabilities.device_is_host


class Backend(ABC):
    """A backend plugin: probes its hardware and opens devices."""

    name: ClassVar[str]
    #: whether the stream emulator can stand in when the hardware is missing
    can_emulate: ClassVar[bool] = True
    #: pytest marker the conformance suite puts on native runs (the hardware they need), if any
    hardware_mark: ClassVar[str | None] = None

    def probe(self) -> Availability:
        """Can this backend run natively here? Never raises: a failure becomes the reason."""
        try:
            return self._probe_native()
        except Exception as error:  # noqa: BLE001 - any import or driver failure is a reason
            return Availability(native=False, reason=one_line(error))

    def op_provider(self) -> OpProvider | None:
        """Fused ops this backend offers natively (None: the reference ops everywhere).

        Used only on the native runtime and only when the ``fused_ops`` gate enables it; the
        provider's ``available()`` says why it cannot load (a missing optional package).
        """
        return None

    def open(self, spec: DeviceSpec) -> Device:
        if spec.runtime is Runtime.native:
            return self._open_native(spec)
        return self._open_emulated(spec)

    @abstractmethod
    def _probe_native(self) -> Availability:
        """Import the vendor SDK and look for a device. May narrow the declared capabilities."""

    @abstractmethod
    def _open_native(self, spec: DeviceSpec) -> Device: ...

    def _open_emulated(self, spec: DeviceSpec) -> Device:
        from corelib.platform.emulator import EmulatedDevice

        device: Device = EmulatedDevice(spec)
        return device


def _fused_ops_unavailable(backend: Backend) -> str | None:
    """Why the backend's op provider cannot load here, or None when it can."""
    provider = backend.op_provider()
    if provider is None:
        return "the backend offers no op provider"
    try:
        return provider.available()
    except Exception as error:  # noqa: BLE001 - a provider's failure to answer is its reason
        return f"op provider {provider.name!r} failed to say whether it loads ({one_line(error)})"


@dataclass(frozen=True)
class Resolution:
    """The runtime chosen for a backend, with the capabilities it will run with."""

    spec: DeviceSpec
    message: str


def declared_capabilities(backend: str, values: Mapping[str, object]) -> Capabilities:
    """The capabilities a backend's YAML declares, each key and type checked."""
    types = typing.get_type_hints(Capabilities)
    known = [f.name for f in dataclasses.fields(Capabilities)]
    for key, value in values.items():
        where = f"backend.capabilities.{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the capabilities are: {', '.join(known)}"
            raise ConfigError(
                f"{where}: not a capability; fix backend/{backend}.yaml or the override ({hint})"
            )
        expected = types[key]
        if type(value) is not expected:
            wanted = "true or false" if expected is bool else f"a {expected.__name__}"
            raise ConfigError(
                f"{where}: expected {wanted}, got {value!r}; fix backend/{backend}.yaml or the override"
            )
    return Capabilities.from_mapping(values)


def resolve_runtime(backend: Backend, cfg: BackendConfig, timeout_s: float) -> Resolution:
    """Pick native or emulated per ``backend.runtime`` and narrow the declared capabilities."""
    declared = declared_capabilities(backend.name, cfg.capabilities)
    mode = RuntimeMode(cfg.runtime)
    if mode is RuntimeMode.emulated and not backend.can_emulate:
        raise BackendUnavailable(
            f"backend {backend.name} cannot run on the stream emulator; use backend.runtime=auto or native"
        )
    availability = backend.probe() if mode is not RuntimeMode.emulated else None
    if availability is not None and availability.native:
        try:
            capabilities = declared.narrow(**availability.narrow)
        except ValueError as error:
            raise ConfigError(
                f"backend {backend.name}: its probe is invalid ({error}); report it to the plugin"
            ) from None
        runtime = Runtime.native
        message = f"{backend.name}: native ({availability.reason})"
    elif availability is not None and mode is RuntimeMode.native:
        raise BackendUnavailable(
            f"backend {backend.name}: backend.runtime=native refused: {availability.reason}; "
            "use backend.runtime=auto to fall back to the stream emulator"
        )
    elif availability is not None and not backend.can_emulate:
        raise BackendUnavailable(
            f"backend {backend.name} is unavailable here ({availability.reason}) and cannot be emulated"
        )
    else:
        # The emulator runs the reference ops: a backend's fused kernels need its hardware, its
        # memory is host memory that no peer device maps, and its graphs replay in Python.
        capabilities = declared.narrow(fused_ops=False, symmetric_memory=False, programmatic_launch=False,
                                       programmatic_launch_kernels=False, native_graphs=False)
        runtime = Runtime.emulated
        why = f" because {availability.reason}" if availability is not None else " (backend.runtime=emulated)"
        message = f"{backend.name}: running on the stream emulator with the {backend.name} profile{why}"
    if runtime is Runtime.native and capabilities.fused_ops:
        unavailable = _fused_ops_unavailable(backend)
        if unavailable is not None:
            capabilities = capabilities.narrow(fused_ops=False, programmatic_launch_kernels=False)
            message += f"; fused ops unavailable: {unavailable}"
    spec = DeviceSpec(
        backend=backend.name,
        runtime=runtime,
        capabilities=capabilities,
        device_index=cfg.device_index,
        emulator=cfg.emulator,
        timeout_s=timeout_s,
    )
    return Resolution(spec=spec, message=message)

"""The stream emulator: asynchronous device semantics made real on the CPU.

Each stream is a worker thread with a FIFO queue, events complete when their worker reaches
them, copies read host memory when they run (or when issued, where the backend's profile
stages pageable memory), graphs replay captured operations, and seeded chaos delays widen
race windows so ordering bugs show up in tests.
"""

from corelib.platform.emulator.device import EmulatedDevice

__all__ = ["EmulatedDevice"]

"""corelib backend plugin for torch on the CPU."""

from corelib_cpu.device import CpuBackend, CpuDevice

__all__ = ["CpuBackend", "CpuDevice"]

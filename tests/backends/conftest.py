"""The recording vendor stand-ins as fixtures (``npu``, ``mlu``) for the vendor op tests here."""

from vendorkit import mlu, npu

__all__ = ["mlu", "npu"]

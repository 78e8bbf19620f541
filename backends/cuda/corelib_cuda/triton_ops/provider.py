"""The Triton op provider of the cuda backend: every op of corelib.ops, as Triton kernels.

Nothing here imports Triton until ``available()`` or ``load()`` is asked: the backend must
still probe, plan and emulate on machines without it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import torch

from corelib.device import Device
from corelib.errors import one_line
from corelib.ops import OP_NAMES
from corelib_cuda.triton_ops.common import interpreting

INSTALL_HINT = "pip install 'corelib-cuda[triton]'"


class TritonOps:
    """Fused CUDA ops written in Triton: launch-light, graph-capturable, block sizes chosen by rule."""

    name = "triton"
    live_blocks_only = True  # the decode kernel splits each sequence's own length (seq_lens) over its programs
    folded_norms = True  # beside cuBLAS, the RoPE and SiLU kernels scale by 1/rms: no norm kernel (layer_ops)

    def available(self) -> str | None:
        try:
            import triton  # noqa: F401 - only whether it imports
        except ImportError:
            return f"Triton is not installed ({INSTALL_HINT})"
        except Exception as error:  # noqa: BLE001 - a broken install is a reason, not a crash
            return f"Triton does not import: {one_line(error)}"
        if not interpreting() and not torch.cuda.is_available():
            return "Triton needs a CUDA device and torch sees none (TRITON_INTERPRET=1 runs the kernels on the CPU)"
        return None

    def pdl_missing(self) -> str | None:
        """Why the kernels cannot be launched with programmatic dependent launch here (None: they can)."""
        reason = self.available()
        if reason is not None:
            return reason
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions

        missing = [name for name in ("gdc_wait", "gdc_launch_dependents") if not hasattr(tl.extra.cuda, name)]
        if "launch_pdl" not in {f.name for f in dataclasses.fields(CUDAOptions)}:
            missing.append("launch_pdl")
        if missing:
            import triton

            return f"Triton {triton.__version__} lacks {', '.join(missing)} (Triton 3.3 or newer has them)"
        return None

    def op_names(self) -> tuple[str, ...]:
        return OP_NAMES

    def load(self, device: Device, pdl: bool = False) -> Mapping[str, object]:
        """The ops for ``device``; with ``pdl`` the projection kernels are launched with PDL."""
        from corelib_cuda.triton_ops import layer_ops, linear
        from corelib_cuda.triton_ops.activation import silu_mul
        from corelib_cuda.triton_ops.norm import rms_norm
        from corelib_cuda.triton_ops.paged_attention import paged_attention
        from corelib_cuda.triton_ops.relay import relay_inputs
        from corelib_cuda.triton_ops.rope import rope_kv_write
        from corelib_cuda.triton_ops.sampling import sample, sample_publish

        expected = "cpu" if interpreting() else "cuda"
        if device.torch_device.type != expected:
            raise ValueError(
                f"the triton ops run on {expected} tensors (TRITON_INTERPRET={int(interpreting())}); "
                f"device {device.name!r} holds {device.torch_device.type} tensors"
            )
        ops: dict[str, object] = {
            "rms_norm": rms_norm,
            "rope_kv_write": rope_kv_write,
            "paged_attention": functools.partial(paged_attention, pdl=pdl),
            "silu_mul": silu_mul,
            "sample": functools.partial(sample, pdl=pdl),
            "sample_publish": functools.partial(sample_publish, pdl=pdl),
            "relay_inputs": relay_inputs,
        }
        for module, names in ((linear, ("linear", "linear_residual")),
                              (layer_ops, ("norm_qkv_rope_kv_write", "norm_gate_up_silu_mul", "norm_logits",
                                          "norm_qkv_attention"))):
            for name in names:
                ops[name] = functools.partial(getattr(module, name), pdl=pdl)
        return ops

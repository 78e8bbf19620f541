"""Triton kernels for every op of corelib.ops, offered by the cuda backend as the ``triton`` provider.

Triton is an optional extra (``pip install 'corelib-cuda[triton]'``); importing this package
does not import it. ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors in Triton's
interpreter (slowly), which is how they are tested without a GPU.
"""

from corelib_cuda.triton_ops.provider import TritonOps

__all__ = ["TritonOps"]

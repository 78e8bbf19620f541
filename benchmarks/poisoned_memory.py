"""GPU tests over device memory that holds a byte pattern: a read of memory that nothing wrote sees it.

    python3 benchmarks/poisoned_memory.py --byte 0xff tests/engine/test_engine_reference.py [more pytest args]

Before the tests run in this process, most of the GPU's free memory is taken through torch's caching
allocator, filled with ``--byte`` and given back to the allocator's cache, in large and small blocks alike:
later allocations of the tests reuse those bytes. 0xff reads as NaN in every float type and as -1 in the
integer ones; 0x7f as huge finite floats and huge positive integers (an index past any bound). A kernel
that reads a cache slot, a padding row or a buffer its step never wrote then changes the tokens, fails a
request as non-finite or stops on a device-side assert, where fresh memory (zeros) would pass unnoticed.
Runs the ``gpu``-marked tests of the given paths in this one process (no workers).
"""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

SMALL_BLOCKS = (512, 4096, 65536, 500_000)  # bytes: the allocator's small pool and split large blocks
BLOCKS_EACH = 200


def poison(byte: int, share: float) -> None:
    """Fill ``share`` of the free device memory (one block) and many small blocks with ``byte``, then free
    them into the caching allocator."""
    free, _ = torch.cuda.mem_get_info()
    large = torch.full((int(free * share),), byte, dtype=torch.uint8, device="cuda")
    small = [torch.full((n,), byte, dtype=torch.uint8, device="cuda") for n in SMALL_BLOCKS for _ in range(BLOCKS_EACH)]
    torch.cuda.synchronize()
    del large, small


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--byte", type=lambda text: int(text, 0), default=0xFF, help="the pattern (default 0xff)")
    parser.add_argument("--share", type=float, default=0.6, help="of the free device memory (default 0.6)")
    parser.add_argument("pytest_args", nargs="+", help="test paths, then any pytest options")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("poisoned_memory.py: no CUDA device")
    poison(args.byte, args.share)
    return int(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=-p corelib.testing.plugin -ra",
                            "-m", "gpu", *args.pytest_args]))


if __name__ == "__main__":
    sys.exit(main())

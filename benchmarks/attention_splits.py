"""``python -m corelib bench`` with the decode attention's splits at short spans changed: an engine A/B.

    python3 benchmarks/attention_splits.py VARIANT bench [overrides...]

VARIANT:
  base      the kernels as they are (a 256-token graph width at bs 1 on an H200: four splits of 64 keys and a
            merge kernel; two splits at bs 32)
  split256  at least 256 keys a split (a 256-token width: one split, 64-key tiles in a loop, no merge kernel;
            the full 2,048-token width at bs 1: 8 splits instead of 32)
  tile256   split256, and a span of at most 256 keys read as one tile by 8 warps
  early     base, with a one-tile split reading the keys of earlier steps before the PDL wait (EARLY_KV)
  early256  tile256 with EARLY_KV

benchmarks/attention_splits.sh runs the variants alternating, in process, async.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import corelib_cuda.triton_ops.decode_attention as attention

VARIANTS = ("base", "split256", "tile256", "early", "early256")
ConfigFn = Callable[[int, int, int, int, int, int], attention.DecodeConfig]


def _one_wide_tile(plain: ConfigFn) -> ConfigFn:
    def wide(batch: int, kv_heads: int, group: int, head_dim: int, span: int, sms: int) -> attention.DecodeConfig:
        config = plain(batch, kv_heads, group, head_dim, span, sms)
        if config.splits == 1 and span <= 256:
            return config._replace(block_n=256, warps=8, one_tile=True)
        return config

    return wide


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
        sys.exit(f"usage: attention_splits.py {{{','.join(VARIANTS)}}} bench [overrides...]")
    variant = sys.argv.pop(1)
    if variant in ("split256", "tile256", "early256"):
        attention.MIN_SPLIT_KEYS = 256
    if variant.startswith("early"):
        attention.EARLY_KV = True
    if variant in ("tile256", "early256"):
        attention.decode_config = _one_wide_tile(attention.decode_config)  # type: ignore[assignment]
    from corelib.__main__ import entry

    return entry()


if __name__ == "__main__":
    sys.exit(main())

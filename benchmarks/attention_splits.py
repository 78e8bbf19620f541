"""``python -m corelib bench`` with the decode attention at short spans changed: an engine A/B.

    python3 benchmarks/attention_splits.py VARIANT bench [overrides...]

VARIANT:
  base        the kernels as they are (a 256-token graph width at bs 1 on an H200: four splits of 64 keys and a
              merge kernel; four splits at bs 32; one at bs 64, whose grid fills the multiprocessors)
  early       base, with a one-tile split reading the keys of earlier steps before the PDL wait (EARLY_KV)
  wide        a span of at most 256 keys as one split and one tile (8 warps at 256 keys), no merge kernel;
              wider spans as in base
  early-wide  wide with EARLY_KV
  one-split   a span of at most 256 keys as one split, its 64-key tiles in a loop (only the live ones), no merge

benchmarks/attention_splits.sh runs the variants alternating, in process, async.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import corelib_cuda.triton_ops.decode_attention as attention
from corelib_cuda.triton_ops.common import next_power_of_2

VARIANTS = ("base", "early", "wide", "early-wide", "one-split")
ConfigFn = Callable[[int, int, int, int, int, int], attention.DecodeConfig]
SHORT_SPAN = attention.SHORT_SPAN  # keys: the default decode graph's width


def _one_split_at_short_spans(plain: ConfigFn, one_tile: bool) -> ConfigFn:
    def short(batch: int, kv_heads: int, group: int, head_dim: int, span: int, sms: int) -> attention.DecodeConfig:
        config = plain(batch, kv_heads, group, head_dim, span, sms)
        if span > SHORT_SPAN:
            return config
        if not one_tile:
            return config._replace(splits=1, one_tile=span <= config.block_n)
        block_n = max(64, next_power_of_2(span))
        return config._replace(splits=1, block_n=block_n, warps=8 if block_n >= SHORT_SPAN else 4, one_tile=True)

    return short


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
        sys.exit(f"usage: attention_splits.py {{{','.join(VARIANTS)}}} bench [overrides...]")
    variant = sys.argv.pop(1)
    if variant.startswith("early"):
        attention.EARLY_KV = True
    if variant.endswith("wide") or variant == "one-split":
        attention.decode_config = _one_split_at_short_spans(  # type: ignore[assignment]
            attention.decode_config, one_tile=variant != "one-split")
    from corelib.__main__ import entry

    return entry()


if __name__ == "__main__":
    sys.exit(main())

"""``python -m corelib bench`` with the projections' ``Tuning`` changed: an engine A/B of a kernel choice.

    python3 benchmarks/tuning_bench.py JSON bench [overrides...]

JSON holds the ``Tuning`` fields changed (lists become tuples, as in benchmarks/projection_tuning.py); ``{}`` runs
the tuning as it is. The step harness (projection_tuning.py) times the device alone; this times what a user sees,
the engine's TPOT, in process (``bench.transport=[inproc]``: the worker of an SHM run would not see the change).
Alternate the variants, e.g. for small-0.6b's decoder-layer products on the tensor-core kernel up to 32 rows against
cuBLAS (``gemm_shape_tiles`` empty):

    for v in '{"gemm_shape_tiles": []}' '{}' '{"gemm_shape_tiles": []}' '{}'; do
      python3 benchmarks/tuning_bench.py "$v" bench backend=cuda backend.runtime=native bench=h200 \\
        bench.warmup_steps=8 "bench.transport=[inproc]" "bench.handoff=[on]" "bench.prompt_lens=[]" \\
        model=small-0.6b model.init=device "bench.batch_sizes=[16,32,64]"
    done

or let benchmarks/engine_ab.sh alternate them and print the table, a label's tree followed by ``@JSON``:

    MODELS=small-0.6b BATCH="16 32 64" benchmarks/engine_ab.sh OUT base=. 'cublas=.@{"gemm_shape_tiles": []}'
"""

from __future__ import annotations

import dataclasses
import sys

from corelib_cuda.triton_ops import linear
from projection_tuning import tuning_changes


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "bench":
        sys.exit("usage: tuning_bench.py JSON bench [overrides...]")
    changes = tuning_changes(sys.argv.pop(1))
    linear.TUNING = dataclasses.replace(linear.TUNING, **changes)
    print(f"tuning: {changes or 'as it is'}", flush=True)
    from corelib.__main__ import entry

    return entry()


if __name__ == "__main__":
    sys.exit(main())

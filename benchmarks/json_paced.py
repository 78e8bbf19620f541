"""JSON mode's TPOT against plain decoding where the device takes a fixed time a step: the host's share, on any machine.

    python benchmarks/json_paced.py --step-ms 1.25 --rounds 3

The engine's whole loop (scheduling, packing, each grammar taking its token, the masks written
while the next step is packed) runs as it does on a GPU, but the executor is a stand-in device:
a step's tokens are ready ``--step-ms`` after its forward could start (its submission, or the
previous step's end), and no earlier than its grammar masks were handed over; a structured row
takes a random allowed token of its mask (the closing quote a quarter of the times it is allowed,
as a trained model closes its strings; EOS as soon as the grammar allows it), a plain row any
token. The default of 1.25 ms is small-0.6b's decode step at 32 rows on an H200. So the ratio
printed is what the host alone leaves of the target (JSON TPOT at most 1.15x plain), on this
machine's cores, without the device's own share of a JSON step (the mask's copy and application).
The schemas and checkpoint are those of ``json_mode.py`` (``--tiny``: no weights are read here).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from json_mode import SCHEMA, VOCAB, check, mean_tpot, typical, write_checkpoint

from corelib.config.options import EngineOptions
from corelib.config.schema import Transport
from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.startup.start import Startup
from corelib.step.build import ModelFactory
from corelib.step.forward_input import ForwardInput
from corelib.step.handoff import StepResult
from corelib.step.layout import EngineLayout
from corelib.testing.executor import InstantExecutor
from corelib.transport import factory
from corelib.transport.executor import Executor, StepFuture

QUOTE_SHARE = 0.25
CANDIDATES = 64  # random tokens tried against a structured row's mask before its whole row is read
SAMPLE_S = 50e-6  # a step's sampling, the last part of its time (the processed argmax at 32 rows)


class PacedExecutor(InstantExecutor):
    """A device whose every step takes ``step_s`` and samples from the grammar masks handed to it (corelib's
    instant executor, its arenas and all, given a pace)."""

    defers_masks = True

    def __init__(self, layout: EngineLayout, depth: int, step_s: float, quote: int, eos: int, timeout_s: float,
                 masked_s: float = 0.0) -> None:
        super().__init__(layout, depth, timeout_s=timeout_s)
        self.step_s, self.quote, self.eos, self.masked_s = step_s, quote, eos, masked_s
        self._free_at = 0.0  # when the stand-in device finishes its last step

    def submit(self, fi: ForwardInput, release: Callable[[], None]) -> StepFuture:
        # The loop never submits a step while an earlier one owes its masks: this one starts after that one's end.
        forward_done = max(self._free_at, time.perf_counter()) + self.step_s - SAMPLE_S
        future = _PacedFuture(self, fi, release, forward_done)
        self._free_at = future.done
        return future

    def tokens(self, fi: ForwardInput, masks: np.ndarray | None) -> list[int]:
        """Each row's token: a plain row's any, a structured row's EOS where allowed, else the quote a quarter of
        the times it is allowed, else the first allowed of some random tokens, else the first allowed token
        (a few such positions: a key, a number's digits, ...). Vectorised: some 0.1 ms at 32 rows."""
        rng = np.random.default_rng(fi.step_id)
        rows = fi.num_seqs
        out = rng.integers(300, VOCAB, rows)
        if masks is None:
            return [int(token) for token in out]
        words = masks[:rows].view(np.uint32)
        candidates = np.concatenate([[self.eos, self.quote], rng.integers(0, VOCAB, CANDIDATES)])
        allowed = (words[:, candidates // 32] >> (candidates % 32).astype(np.uint32)) & 1 == 1
        allowed[:, 1] &= rng.random(rows) < QUOTE_SHARE
        allowed[(words[:, :2] == np.uint32(0xFFFFFFFF)).all(1)] = False  # plain rows: any token
        hit = allowed.any(1)
        out[hit] = candidates[allowed[hit].argmax(1)]
        few = np.flatnonzero(~hit & (words[:, :2] != np.uint32(0xFFFFFFFF)).any(1))
        if len(few):  # few tokens allowed here (a key, a number's digit, ...): the first of them
            word = (words[few] != 0).argmax(1)
            bits = words[few, word].astype(np.int64)
            out[few] = word * 32 + np.log2(bits & -bits).astype(np.int64)
        return [int(token) for token in out]


class _PacedFuture(StepFuture):
    def __init__(self, executor: PacedExecutor, fi: ForwardInput, release: Callable[[], None],
                 forward_done: float) -> None:
        self._executor, self._fi, self._release = executor, fi, release
        self._forward_done = forward_done
        self.done = forward_done + SAMPLE_S  # when its tokens are ready (later if its masks come late)
        self._masks: np.ndarray | None = None
        self._supplied = not fi.mask_deferred

    def supply_mask(self, masks: torch.Tensor | None) -> None:
        self._masks = None if masks is None else masks.numpy().copy()
        self._supplied = True
        # Sampled once the forward is done and the masks are here: late masks hold the device back.
        self.done = max(self._forward_done, time.perf_counter()) + SAMPLE_S + self._executor.masked_s
        self._executor._free_at = max(self._executor._free_at, self.done)

    def result(self, timeout: float) -> StepResult:
        if not self._supplied:
            raise RuntimeError(f"step {self._fi.step_id} read before its grammar masks were handed over")
        tokens = self._executor.tokens(self._fi, self._masks)  # the device's work: done while it is busy
        left = self.done - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self._release()
        return StepResult(self._fi.step_id, self._fi.kind, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=1.25, help="the stand-in device's time per step")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/json_mode_tiny"))
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2, help="JSON and plain runs of each schema, alternating")
    parser.add_argument("--masked-ms", type=float, default=0.0,
                        help="the device's own extra time in a step that owes masks (their copy and application, "
                             "sampling as a graph of its own): 0.09 on the H200 at 32 rows; 0 leaves the host alone")
    parser.add_argument("--mask-thread", choices=("default", "on", "off"), default="default",
                        help="a step's grammar masks computed on the mask thread while the next step is packed, or "
                             "on the loop's thread (default: the engine's choice for this machine)")
    parser.add_argument("overrides", nargs="*", help="more engine keys (key=value)")
    args = parser.parse_args()
    model = write_checkpoint(args.workdir, True)
    from tokenizers import Tokenizer

    [quote] = Tokenizer.from_file(str(model / "tokenizer.json")).encode('"').ids

    def paced(startup: Startup, options: EngineOptions, layout: EngineLayout, model_factory: ModelFactory) -> Executor:
        return PacedExecutor(layout, options.pipeline_depth, args.step_ms / 1e3, quote, 1, options.timeout_s,
                             args.masked_ms / 1e3)

    factory.EXECUTORS[Transport.inproc] = paced
    prompts = [[0, *random.Random(i).sample(range(300, VOCAB), 24)] for i in range(args.requests)]
    with Engine.from_overrides(["backend=npu", f"model.path={model}", "engine.async_token_handoff=on",
                                f"engine.max_num_seqs={args.concurrency}", *args.overrides]) as engine:
        if args.mask_thread != "default":
            engine.core.masks_beside_packing = args.mask_thread == "on"
        print(f"requests {args.requests}, concurrency {args.concurrency}, a step {args.step_ms} ms; "
              f"structured_overlap {engine.plan.is_enabled('structured_overlap')}, "
              f"masks beside packing {engine.core.masks_beside_packing}")
        for name, schema in (("unbounded strings", typical(SCHEMA)), ("strings of maxLength 24 and 8", SCHEMA)):
            structured = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, seed=i,
                                         structured_outputs={"json": schema}) for i in range(args.requests)]
            engine.generate(prompts[: args.concurrency], structured[: args.concurrency])  # compiled and warmed
            ratios = []
            for round_ in range(1, args.rounds + 1):
                outputs = engine.generate(prompts, structured)
                for output in outputs:
                    check(output.outputs[0].text)
                tokens = round(statistics.fmean(len(o.outputs[0].token_ids) for o in outputs))
                plain = engine.generate(prompts, [SamplingParams(max_tokens=max(tokens, 2), temperature=0.0,
                                                                 ignore_eos=True)] * args.requests)
                json_tpot, plain_tpot = mean_tpot(outputs), mean_tpot(plain)
                ratios.append(json_tpot / plain_tpot)
                print(f"{name}, round {round_}: {tokens} tokens a request, all valid; TPOT JSON {json_tpot:.3f} ms, "
                      f"plain {plain_tpot:.3f} ms, ratio {ratios[-1]:.3f}")
            print(f"{name}: ratio median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

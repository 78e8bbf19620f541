"""The model runner: the only engine code that touches the device.

Per step: one H2D of the packed inputs, the forward (a replayed graph for decode batches
that fit a bucket, eager otherwise), sampling into ``next_tokens``, a scatter of the
samples into the per-sequence token relay (the next step's inputs come from there, never
through the host), then a copy into a double-buffered device relay and a non-blocking D2H
into double-buffered pinned host memory followed by that step's own output event.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from corelib import faults, progress
from corelib.device import Device, Event, Graph, Stream
from corelib.engine.buckets import BucketPolicy
from corelib.engine.forward_input import (
    DECODE_FLOAT_ROWS,
    DECODE_INT_ROWS,
    PREFILL_ROWS,
    ForwardInput,
    InputBuilder,
    row_views,
)
from corelib.engine.metrics import StepResult
from corelib.engine.scheduler import StepKind
from corelib.models.llama import (
    ConvState,
    DecodeLayer,
    KVCache,
    ModelWeights,
    compiled_decode_layer,
    decode_forward,
    decode_layer,
    prefill_forward,
)
from corelib.ops import SamplingInputs
from corelib.ops.reference import sample as sample_tokens


@dataclass
class StepTiming:
    """Device-side span of one step, read from its events once they completed."""

    start: Event | None
    end: Event | None


class StepHandle:
    """A submitted step. Its tokens are valid in pinned host memory once ``event`` completes."""

    def __init__(
        self,
        fi: ForwardInput,
        event: Event,
        host_tokens: torch.Tensor,
        timing: StepTiming,
        keepalive: tuple[object, ...],
        release: Callable[[], None],
    ) -> None:
        self.step_id = fi.step_id
        self.kind = fi.kind
        self.num_seqs = fi.num_seqs
        self.event = event
        self.timing = timing
        self._host_tokens = host_tokens
        # Inputs stay referenced until the output event completes: the device may still read them.
        self._keepalive: tuple[object, ...] | None = (fi, *keepalive)
        self._release_inputs = fi.release
        self._release = release
        self.tokens: list[int] | None = None
        self.graph = False  # set by the runner when the step replayed a captured graph

    def done(self) -> bool:
        return self.tokens is not None or self.event.query()

    def wait(self, timeout: float | None = None) -> list[int]:
        """Block (without the GIL) until the tokens are on the host; raise on timeout."""
        if self.tokens is None:
            self.event.synchronize(timeout)
            self.tokens = self._host_tokens[: self.num_seqs].tolist()
            self._keepalive = None
            self._release()
            self._release_inputs()
        return self.tokens


class ModelRunner:
    """Owns the weights, the KV cache, the relay and token buffers, and the captured graphs."""

    def __init__(
        self,
        device: Device,
        weights: ModelWeights,
        builder: InputBuilder,
        buckets: BucketPolicy,
        num_blocks: int,
        num_slots: int,
        timing: bool = True,
        compile_decode: bool = False,
        ordered_prepare: bool = False,
    ) -> None:
        self.device = device
        self.weights = weights
        self.builder = builder
        self.buckets = buckets
        shape = weights.shape
        caps = device.capabilities
        self.compute = device.stream("compute")
        self.d2h = device.stream("d2h") if caps.streams else self.compute
        # Ordered materialization: the H2D of every step's inputs runs on this stream and a
        # ready event gates the compute stream (graph update and replay) on it.
        self.prepare = device.stream("prepare") if caps.streams and ordered_prepare else None
        self._consumed: Event | None = None  # compute has finished reading the decode arena
        self._prev_end: Event | None = None
        self.timing = timing and caps.event_timing
        self.time_tokens = False  # a trace times each step's D2H too: its tokens event then carries timing
        rows = builder.max_rows
        kv_shape = (shape.num_layers, 2, num_blocks, builder.block_size, shape.num_kv_heads, shape.head_dim)
        kv_size = progress.size_of(kv_shape, shape.dtype.itemsize)
        with progress.current().task(f"allocating the KV cache ({kv_size})", total=1) as task:
            self.cache = KVCache(device.zeros(kv_shape, shape.dtype), builder.block_size)
            task.advance()
        self.conv_state = (
            ConvState(device.zeros((shape.num_layers, num_slots + 1, shape.conv_kernel - 1, shape.hidden_size),
                                   shape.dtype))
            if shape.conv_kernel
            else None
        )
        # Per-sequence relay of the latest sampled token; the last slot absorbs padded rows.
        self.seq_tokens = device.zeros((num_slots + 1,), torch.int64)
        self.next_tokens = device.zeros((rows,), torch.int64)
        self.relay = device.zeros((2, rows), torch.int64)
        self.host_tokens = device.host_empty((2, rows), torch.int64, pinned=True)
        self._busy = [False, False]
        self._parity = 0
        self._lock = threading.Lock()
        layout = builder.decode
        if caps.device_is_host:
            self.decode_arena: torch.Tensor | None = None
        else:
            self.decode_arena = device.empty((layout.nbytes,), torch.uint8)
        self.decode_layer: DecodeLayer = compiled_decode_layer() if compile_decode else decode_layer
        self.graphs: dict[tuple[int, int, bool], Graph] = {}
        self._graph_shapes = set(buckets.shapes())
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    # ------------------------------------------------------------------ graphs
    def capture(self, sample_variants: bool = False) -> None:
        """Capture every decode bucket, largest first (greedy; sampling variants on demand)."""
        shapes = self.buckets.shapes()
        with progress.current().task("capturing decode graphs", total=len(shapes), unit="graphs") as task:
            for rows, kv in shapes:
                self._capture(rows, kv, False)
                task.advance()
        if sample_variants:
            for rows, kv in self.buckets.shapes():
                self._capture(rows, kv, True)

    def _capture(self, rows: int, kv: int, sampled: bool) -> Graph:
        faults.maybe_fail("capture")
        if self.decode_arena is None:
            raise RuntimeError("graphs need device memory separate from the host")
        pad = self.device.host_empty((self.builder.decode.nbytes,), torch.uint8, pinned=True)
        self.builder.fill_padding(pad, rows, kv)
        graph = self.device.graph(f"decode_rows{rows}_kv{kv}{'_sampled' if sampled else ''}")
        views = self.builder.decode.views(self.decode_arena)
        param_update = self.buckets.param_update

        def kv_blocks() -> int:
            return graph.params["kv_blocks"] if param_update else kv

        def step() -> None:
            self._decode(views, rows, kv_blocks(), sampled)

        self.compute.copy(self.decode_arena, pad)
        self.compute.launch(step)  # warm-up outside capture: allocator pools, library handles
        graph.capture(lambda: self.compute.launch(step), self.compute, params={"kv_blocks": kv})
        self.compute.synchronize()  # the padding arena may be freed after this
        self.graphs[(rows, kv, sampled)] = graph
        return graph

    # ------------------------------------------------------------------ device work
    def _decode(self, views: dict[str, torch.Tensor], rows: int, kv: int, sampled: bool) -> None:
        faults.maybe_fail("forward")
        ints = row_views(views, DECODE_INT_ROWS, "ints")
        floats = row_views(views, DECODE_FLOAT_ROWS, "floats")
        slots = ints["state_indices"][:rows]
        ids = ints["input_ids"][:rows]
        ids = torch.where(ids >= 0, ids, self.seq_tokens[slots])  # relay: step N's samples, on the device
        positions = ints["positions"][:rows]
        logits = decode_forward(
            self.weights,
            self.cache,
            self.conv_state,
            ids,
            positions,
            ints["slot_mapping"][:rows],
            views["block_tables"][:rows, :kv],
            ints["seq_lens"][:rows],
            slots,
            self.decode_layer,
        )
        self._emit(logits, rows, slots, floats, ints["top_k"][:rows], ints["seeds"][:rows], positions + 1, sampled)

    def _prefill(self, views: dict[str, torch.Tensor], num_seqs: int, sampled: bool) -> None:
        faults.maybe_fail("forward")
        rows = row_views(views, PREFILL_ROWS, "rows")
        floats = row_views(views, DECODE_FLOAT_ROWS, "floats")
        slots = rows["state_indices"]
        logits = prefill_forward(
            self.weights,
            self.cache,
            self.conv_state,
            views["token_ids"],
            views["positions"],
            views["slot_mapping"],
            views["pad_index"],
            views["valid"],
            rows["last_index"],
            slots,
        )
        self._emit(logits, num_seqs, slots, floats, rows["top_k"], rows["seeds"], rows["last_index"] + 1, sampled)

    def _emit(
        self,
        logits: torch.Tensor,
        rows: int,
        slots: torch.Tensor,
        floats: dict[str, torch.Tensor],
        top_k: torch.Tensor,
        seeds: torch.Tensor,
        sample_positions: torch.Tensor,
        sampled: bool,
    ) -> None:
        sampling = SamplingInputs(floats["temperature"][:rows], top_k, floats["top_p"][:rows], seeds,
                                  sample_positions) if sampled else None
        tokens = sample_tokens(logits, sampling)
        self.next_tokens[:rows].copy_(tokens)
        self.seq_tokens.index_copy_(0, slots, tokens)

    # ------------------------------------------------------------------ submission
    def submit(self, fi: ForwardInput) -> StepHandle:
        """Queue one step on the device; returns at once with a handle on its tokens."""
        with self._lock:
            parity = self._parity
            if self._busy[parity]:
                raise RuntimeError(
                    f"step {fi.step_id}: token buffer {parity} is reused before the tokens of the step "
                    "two back were read; the engine must read each step's tokens before submitting two more"
                )
            self._busy[parity] = True
            self._parity ^= 1
        compute, n = self.compute, fi.num_seqs
        start = compute.record(self.device.event(timing=True, name=f"step{fi.step_id}.start")) if self.timing else None
        keep, graph = self._launch(fi)
        # relay[parity] was last read by the D2H of the step two back; its tokens were read on the
        # host (the busy check above), so that copy has finished and the buffer is free.
        compute.copy(self.relay[parity, :n], self.next_tokens[:n])
        end = compute.record(self.device.event(timing=self.timing, name=f"step{fi.step_id}.end"))
        if self.d2h is not compute:
            self.d2h.wait(end)
        self.d2h.copy(self.host_tokens[parity, :n], self.relay[parity, :n])
        out = self.d2h.record(self.device.event(blocking=True, timing=self.time_tokens,
                                                name=f"step{fi.step_id}.tokens"))

        def release() -> None:
            self._busy[parity] = False

        timing = StepTiming(start, end if self.timing else None)
        handle = StepHandle(fi, out, self.host_tokens[parity], timing, keep, release)
        handle.graph = graph
        return handle

    def result(self, handle: StepHandle, timeout: float | None = None) -> StepResult:
        """Wait for a step's tokens and read its device span. Call in submission order."""
        tokens = handle.wait(timeout)
        busy = gap = None
        start, end = handle.timing.start, handle.timing.end
        if start is not None and end is not None:
            busy = start.elapsed_ms(end)
            if self._prev_end is not None:
                gap = max(0.0, self._prev_end.elapsed_ms(start))
        self._prev_end = end
        return StepResult(handle.step_id, handle.kind, tokens, busy, gap, handle.graph, handle=handle)

    def materialize_early(self, fi: ForwardInput, stream: Stream) -> ForwardInput:
        """The early path: ``stream`` (the polling thread's) issues the H2D now, from ``fi.arena``.

        The copy lands in a device arena of this step; the compute stream waits for the copy's
        event before using it. What makes the path unsafe is the source: the caller releases the
        SHM slot as soon as this returns, and a copy that reads its source only when it runs
        (pinned or registered memory, or any memory on a device that does not stage pageable
        sources) then reads whatever the producer wrote there next.
        """
        if self.decode_arena is None:
            return fi
        target = self.device.empty((fi.layout.nbytes,), torch.uint8)
        stream.copy(target, fi.arena[: fi.layout.nbytes])
        ready = stream.record(self.device.event(name=f"step{fi.step_id}.early_h2d"))
        return dataclasses.replace(fi, arena=target, on_device=True, ready=ready)

    def _stage(self, fi: ForwardInput, target: torch.Tensor) -> None:
        """The H2D of a step's inputs: in compute-stream order, or on the prepare stream + a ready event."""
        nbytes = fi.layout.nbytes
        if fi.on_device:  # the polling thread issued the H2D on its own stream
            if fi.ready is not None:
                self.compute.wait(fi.ready)
            if target.data_ptr() != fi.arena.data_ptr():
                self.compute.copy(target[:nbytes], fi.arena[:nbytes])  # into the graph's static inputs
            return
        source = fi.arena[:nbytes]
        if self.prepare is None:
            self.compute.copy(target[:nbytes], source)
            return
        if self._consumed is not None:
            self.prepare.wait(self._consumed)  # the previous step no longer reads the arena
        self.prepare.copy(target[:nbytes], source)
        ready = self.prepare.record(self.device.event(name=f"step{fi.step_id}.ready"))
        self.compute.wait(ready)  # graph update and replay only after the inputs landed

    def _launch(self, fi: ForwardInput) -> tuple[tuple[object, ...], bool]:
        """H2D of the arena and the forward; returns what must outlive the step, and if a graph ran."""
        keep, graph = self._forward(fi)
        if self.prepare is not None:
            self._consumed = self.compute.record(self.device.event(name=f"step{fi.step_id}.consumed"))
        return keep, graph

    def _forward(self, fi: ForwardInput) -> tuple[tuple[object, ...], bool]:
        compute = self.compute
        if fi.kind is StepKind.prefill:
            keep: tuple[object, ...] = ()
            if self.decode_arena is None:
                views = fi.views()
            elif fi.on_device:
                self._stage(fi, fi.arena)
                views = fi.views()
            else:
                prefill_arena = self.device.empty((fi.layout.nbytes,), torch.uint8)
                self._stage(fi, prefill_arena)
                views, keep = fi.layout.views(prefill_arena), (prefill_arena,)
            compute.launch(lambda: self._prefill(views, fi.num_seqs, fi.sample))
            return keep, False
        arena = self.decode_arena
        if arena is None:
            views = fi.views()
        else:
            self._stage(fi, arena)
            views = self.builder.decode.views(arena)
        rows, kv = fi.bucket, fi.kv_blocks
        graph_kv = self.buckets.graph_kv(kv)
        graph = self.graphs.get((rows, graph_kv, fi.sample))
        if graph is None and arena is not None and not fi.on_device and (rows, graph_kv) in self._graph_shapes:
            graph = self._capture(rows, graph_kv, fi.sample)  # first sampled batch of this shape
            self._stage(fi, arena)  # capture overwrote the inputs
        if graph is None:
            compute.launch(lambda: self._decode(views, rows, kv, fi.sample))
            self.num_eager_steps += 1
            return (), False
        if self.buckets.param_update:
            graph.update(compute, kv_blocks=kv)
        graph.replay(compute)
        self.num_graph_steps += 1
        return (), True

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()


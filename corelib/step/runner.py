"""The model runner: the forward pass and the captured graphs, nothing else.

A decode step reads its inputs from one static device arena (the graphs' inputs), resolves
relayed input ids, calls the model, samples, and publishes the tokens to the handoff; a
decode batch that fits a bucket replays a captured graph of exactly that, an oversize batch
and every prefill run eagerly. How the inputs got into the arena is the stager's business;
where the tokens go next is the handoff's.
"""

from __future__ import annotations

import torch

from corelib.device import Device, Stream
from corelib.faults import maybe_fail
from corelib.graph import Graph
from corelib.models.base import DecodeBatch, Model, PrefillBatch
from corelib.ops import Ops, PagedAttention, SamplingInputs, TokenHistory, VarlenAttention
from corelib.ops.sampling import record_tokens, reset_history
from corelib.progress import current as current_progress
from corelib.step.buckets import BucketPolicy
from corelib.step.forward_input import ForwardInput, StepKind, pad_decode_rows
from corelib.step.handoff import TokenHandoff
from corelib.step.layout import EngineLayout

NONFINITE = -1  # a token id the host reads as "this row's logits were not finite"


class ModelRunner:
    """Calls the model on a step's staged inputs, eagerly or by replaying a captured graph."""

    def __init__(
        self,
        device: Device,
        compute: Stream,
        model: Model,
        ops: Ops,
        layout: EngineLayout,
        buckets: BucketPolicy,
        handoff: TokenHandoff,
        vocab_size: int,
    ) -> None:
        self.device = device
        self.compute = compute
        self.model = model
        self.ops = ops
        self.layout = layout
        self.decode_layout = layout.decode_layout
        self.buckets = buckets
        self.handoff = handoff
        with current_progress().task("allocating the KV cache", total=1) as task:
            self.state = model.allocate_state(device, layout.num_blocks, layout.block_size, layout.rows)
            task.advance()
        # What each sequence has seen, by state index (the last row absorbs padded rows): the
        # penalties read it. Sampled steps keep it current; a sequence with a penalty is in only those.
        states = layout.rows + 1
        self.output_counts = device.zeros((states, vocab_size), torch.int32)
        self.prompt_counts = device.zeros((states, vocab_size), torch.int32)
        self.decode_arena = None if device.capabilities.device_is_host else device.empty(
            (self.decode_layout.nbytes,), torch.uint8)
        self.graphs: dict[tuple[int, int, bool], Graph] = {}
        self._graph_shapes = set(buckets.shapes())
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    # ------------------------------------------------------------------ graphs
    def capture(self) -> None:
        """Capture every decode bucket, largest first (greedy; sampling variants when first needed)."""
        shapes = self.buckets.shapes()
        with current_progress().task("capturing decode graphs", total=len(shapes), unit="graphs") as task:
            for rows, kv in shapes:
                self._capture(rows, kv, False)
                task.advance()

    def prepare(self, fi: ForwardInput) -> None:
        """Capture the graph ``fi`` needs if it is missing; call before its inputs are staged."""
        if fi.kind is StepKind.decode and self.decode_arena is not None:
            key = (fi.bucket, self.buckets.graph_kv(fi.kv_blocks))
            if (*key, fi.sample) not in self.graphs and key in self._graph_shapes:
                self._capture(*key, fi.sample)  # the first sampled batch of this shape

    def _capture(self, rows: int, kv: int, sampled: bool) -> Graph:
        maybe_fail("capture")
        arena = self.decode_arena
        if arena is None:
            raise RuntimeError("graphs need device memory separate from the host")
        pad = self.device.host_empty((self.decode_layout.nbytes,), torch.uint8, pinned=True)
        pad_decode_rows(self.decode_layout.views(pad), 0, rows, kv, self.layout.pad_state_index)
        graph = self.device.graph(f"decode_rows{rows}_kv{kv}{'_sampled' if sampled else ''}")
        views = self.decode_layout.views(arena)
        param_update = self.buckets.param_update

        def step() -> None:
            self._decode(views, rows, graph.params["kv_blocks"] if param_update else kv, sampled)

        self.compute.copy(arena, pad)
        self.compute.launch(step)  # warm-up outside capture: allocator pools, library handles
        graph.capture(lambda: self.compute.launch(step), self.compute, params={"kv_blocks": kv})
        self.compute.synchronize()  # the padding arena may be freed after this
        self.graphs[(rows, kv, sampled)] = graph
        return graph

    # ------------------------------------------------------------------ steps
    def input_target(self, fi: ForwardInput, source_on_device: bool) -> torch.Tensor | None:
        """Where a step's inputs must land: the graphs' static arena, a prefill buffer, or nowhere (host)."""
        if self.decode_arena is None:
            return None
        if fi.kind is StepKind.decode:
            return self.decode_arena
        return None if source_on_device else self.device.empty((fi.layout.nbytes,), torch.uint8)

    def run(self, fi: ForwardInput, arena: torch.Tensor) -> bool:
        """Queue the forward of ``fi`` whose inputs are (or will be, stream-ordered) in ``arena``.

        Returns whether a captured graph ran.
        """
        if fi.kind is StepKind.prefill:
            views = fi.layout.views(arena)
            self.compute.launch(lambda: self._prefill(views, fi.num_seqs, fi.sample))
            return False
        rows, kv = fi.bucket, fi.kv_blocks
        graph = self.graphs.get((rows, self.buckets.graph_kv(kv), fi.sample)) if arena is self.decode_arena else None
        if graph is None:
            views = fi.layout.views(arena)  # a replayed graph reads its static views: built only when eager
            self.compute.launch(lambda: self._decode(views, rows, kv, fi.sample))
            self.num_eager_steps += 1
            return False
        if self.buckets.param_update:
            graph.update(self.compute, kv_blocks=kv)
        graph.replay(self.compute)
        self.num_graph_steps += 1
        return True

    # ------------------------------------------------------------------ device work
    def _decode(self, views: dict[str, torch.Tensor], rows: int, kv: int, sampled: bool) -> None:
        maybe_fail("forward")
        states = views["state_indices"][:rows]
        positions = views["positions"][:rows]
        attention = PagedAttention(views["block_tables"][:rows, :kv], views["seq_lens"][:rows],
                                   self.layout.block_size)
        batch = DecodeBatch(self.handoff.decode_inputs(views["input_ids"][:rows], states), positions,
                            views["slot_mapping"][:rows], attention, states)
        logits = self.model.decode(batch, self.state, self.ops)
        self._emit(logits, rows, states, views, positions + 1, sampled)

    def _prefill(self, views: dict[str, torch.Tensor], num_seqs: int, sampled: bool) -> None:
        maybe_fail("forward")
        cu_seqlens = views["cu_seqlens"]
        attention = VarlenAttention(cu_seqlens, int(views["pad_index"].shape[1]), views["pad_index"], views["valid"])
        states = views["state_indices"]
        batch = PrefillBatch(views["token_ids"], views["positions"], views["slot_mapping"], attention,
                             views["last_index"], states)
        logits = self.model.prefill(batch, self.state, self.ops)
        if sampled:
            reset_history(self._history(states), views["token_ids"], views["positions"], cu_seqlens,
                          views["prompt_lens"])
        self._emit(logits, num_seqs, states, views, cu_seqlens[1:] - cu_seqlens[:-1], sampled)

    def _history(self, states: torch.Tensor) -> TokenHistory:
        return TokenHistory(self.output_counts, self.prompt_counts, states)

    def _emit(self, logits: torch.Tensor, rows: int, states: torch.Tensor, views: dict[str, torch.Tensor],
              sample_positions: torch.Tensor, sampled: bool) -> None:
        sampling = None
        if sampled:
            history = self._history(states[:rows])
            sampling = SamplingInputs.from_views(views, rows, sample_positions, history)
        tokens = self.ops.sample(logits, sampling)
        if sampling is not None and sampling.history is not None:
            record_tokens(sampling.history, tokens)
        # A row whose logits hold a NaN or an inf sums to a non-finite value: the host reads NONFINITE
        # for it and fails that request; the relay keeps the sampled id, a valid index either way.
        finite = torch.isfinite(logits.sum(dim=-1))
        self.handoff.publish(tokens, rows, states, torch.where(finite, tokens, NONFINITE))

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

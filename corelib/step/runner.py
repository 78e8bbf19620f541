"""The model runner: the forward pass and the captured graphs, nothing else.

Every step reads its inputs from one static device arena (a decode step's views of it are the
graphs' inputs), resolves relayed input ids, calls the model's one forward, samples each row's
last token, and publishes the tokens to the handoff. A decode step (one token per row) that fits
a bucket replays a captured graph of exactly that. A step that carries prompt tokens, packed
padded to its token bucket (``ForwardInput.padded``), replays two graphs: the bucket's forward,
which leaves every row's logits in one static buffer, then the sampling of the rows (one graph
per sampling variant, shared by every bucket, since every padded step has the layout's rows).
An oversize batch and a step past the largest token bucket run eagerly. How the inputs got into
the arena is the stager's business; where the tokens go next is the handoff's.

Long: every form a step's device work takes (decode graphs in every sampling variant, padded
prompt graphs and their sampling graphs, eager steps, the penalties' counts, a grammar's mask,
prompt logprobs) reads and writes the same static buffers; split, each piece would reach into the
others' state.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from corelib.models.base import Model, StepBatch
from corelib.models.sharding import VocabShard
from corelib.ops import Ops, PagedAttention, SamplingInputs, TokenHistory
from corelib.ops.composed import publish_checked, publish_tokens
from corelib.ops.sampling import PENALTY_NEUTRAL, count_fed_tokens, count_history, penalized
from corelib.ops.token_mask import ALL_ALLOWED, apply_token_bitmask
from corelib.platform.device import Device, Stream
from corelib.platform.graph import Graph
from corelib.sampling_params import MAX_LOGPROBS
from corelib.step.arena import ArenaLayout
from corelib.step.buckets import BucketPolicy
from corelib.step.fields import PROMPT_LOGPROBS, TOKEN_MASK, TOKEN_NAMES, pad_rows
from corelib.step.forward_input import ForwardInput
from corelib.step.handoff import TokenHandoff
from corelib.step.layout import EngineLayout
from corelib.step.vocab_parallel import gather_logits, pick_tokens
from corelib.support.faults import maybe_fail
from corelib.support.progress import current as current_progress


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, LOGPROB_WIDTH] float32 from the logits the sampler used [B, V] and its tokens [B]: each sampled
    token's log-probability, its rank (vLLM's: the tokens at least as likely, itself included), the
    MAX_LOGPROBS largest log-probabilities, and their token ids. On the device, graph-safe."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top, ids = logp.topk(min(MAX_LOGPROBS, logp.shape[-1]), dim=-1)
    chosen = logp.gather(1, tokens[:, None])
    rank = (logp >= chosen).sum(dim=-1, keepdim=True).to(torch.float32)  # exact below 2**24 tokens
    return torch.cat([chosen, rank, top, ids.to(torch.float32)], dim=1)


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
        deferred_masks: bool = False,
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
        # The one device arena every step's inputs land in; a decode step's views of it are the graphs' inputs.
        self.arena = None if device.capabilities.device_is_host else device.empty((layout.arena_bytes,), torch.uint8)
        # The token fed at every KV slot, written by each step: a sequence new to its state index has its
        # penalty counts rebuilt once from its own blocks (so cached prefixes and shared blocks count too).
        self.slot_tokens = device.zeros((layout.num_blocks * layout.block_size,), torch.int64)
        # The penalties' token counts by state index (the padding one included), kept up to date as tokens arrive:
        # a sampled step adds the tokens it feeds, O(tokens), inside its graph; a sequence with a penalty new to its
        # index has them rebuilt first (_recount). Rows without a penalty add nothing and are never rebuilt: neutral
        # penalties ignore what the counts hold. 2 x states x vocab int32, as the per-row counts they replace.
        states = layout.pad_state_index + 1
        self.output_counts = device.zeros((states, vocab_size), torch.int32)
        self.prompt_counts = device.zeros((states, vocab_size), torch.int32)
        # Structured output: the rows' token bitmask the sampling graphs read, rewritten in place by a step that
        # carries one (wire.TOKEN_MASK) and set back to all ones (every token allowed) by the next sampled step.
        self.token_mask = device.empty((layout.rows, layout.mask_words), torch.int32)
        self.token_mask.fill_(ALL_ALLOWED)
        self._mask_set = False
        # Under tensor parallelism the model's logits may be one block of the vocabulary per rank.
        vocab = getattr(model, "vocab_shard", None)
        self.vocab_shard = vocab if isinstance(vocab, VocabShard) and vocab.world > 1 else None
        self.graphs: dict[tuple[int, int, Sampler, bool], Graph] = {}  # rows, KV width, sampler, logprobs
        self._graph_shapes = set(buckets.shapes())
        # Steps with prompt tokens: a forward per token bucket, the rows' sampling per (sampler, logprobs).
        self.prompt_graphs: dict[int, Graph] = {}
        self.sampling_graphs: dict[tuple[Sampler, bool], Graph] = {}
        self._logits: torch.Tensor | None = None  # where a padded step's forward leaves its rows' logits
        # Structured output run ahead (``deferred_masks``): a decode step whose grammar mask is owed replays a
        # forward-only graph of its shape, which leaves its rows' logits in the same buffer; its sampling is queued
        # when the mask arrives (sample_owed). At most one step waits for its mask at a time.
        self.deferred_masks = deferred_masks
        self.forward_graphs: dict[tuple[int, int], Graph] = {}  # rows, KV width
        # ...and the sampling of such a step through the mask, from that buffer: rows, sampler, logprobs.
        self.owed_sampling_graphs: dict[tuple[int, Sampler, bool], Graph] = {}
        self._owed: _OwedSampling | None = None
        self._arena_views: dict[str, torch.Tensor] | None = None
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.capture_s = 0.0  # wall time spent capturing graphs, all of them
        self.graph_bytes = 0  # device memory the graphs captured at start took (their pool, their static logits)

    # ------------------------------------------------------------------ graphs
    def capture(self) -> None:
        """Capture every graph a step can need, largest first (they share one memory pool): the forward of
        every token bucket and every sampling variant of padded steps, then every decode bucket in every
        sampling variant: a server's requests sample (OpenAI's temperature is 1), ask for logprobs or a
        grammar's mask, and the first step of each kind at a new batch size would otherwise capture a graph
        while requests wait."""
        shapes = self.buckets.shapes()
        tokens = list(reversed(self.buckets.token_buckets))
        variants = SAMPLING_VARIANTS if tokens else ()
        before = self.device.memory_stats().reserved_bytes
        forward_only = shapes if self.deferred_masks else []
        owed_rows = sorted({rows for rows, _ in shapes} | ({self.layout.rows} if tokens else set()))
        owed = [(rows, *variant) for rows in owed_rows for variant in SAMPLING_VARIANTS] if self.deferred_masks else []
        total = len(shapes) * len(SAMPLING_VARIANTS) + len(tokens) + len(variants) + len(forward_only) + len(owed)
        with current_progress().task("capturing graphs", total=total, unit="graphs") as task:
            for count in tokens:
                self._capture_prompt(count)
                task.advance()
            for sampler, logprobs in variants:
                self._capture_sampling(sampler, logprobs)
                task.advance()
            for rows, kv in shapes:
                for sampler, logprobs in SAMPLING_VARIANTS:
                    self._capture(rows, kv, sampler, logprobs)
                    task.advance()
            for rows, kv in forward_only:
                self._capture_forward(rows, kv)
                task.advance()
            for rows, sampler, logprobs in owed:
                self._capture_owed_sampling(rows, sampler, logprobs)
                task.advance()
        pool = self.device.graph_pool_bytes()
        logits = 0 if self._logits is None else self._logits.numel() * self._logits.element_size()
        # The pool's own count where the device has one: the allocator's growth also moves with memory
        # that an engine closed earlier in this process left cached.
        self.graph_bytes = pool + logits if pool is not None else self.device.memory_stats().reserved_bytes - before

    def prepare(self, fi: ForwardInput) -> None:
        """Capture the graphs ``fi`` needs if they are missing; call before its inputs are staged."""
        if self.arena is None:
            return
        sampler = sampler_of(fi)
        if fi.padded:
            if fi.num_tokens not in self.prompt_graphs and fi.num_tokens in self.buckets.token_buckets:
                self._capture_prompt(fi.num_tokens)
            if fi.mask_deferred:
                if (fi.bucket, sampler, fi.logprobs) not in self.owed_sampling_graphs:
                    self._capture_owed_sampling(fi.bucket, sampler, fi.logprobs)
            elif (sampler, fi.logprobs) not in self.sampling_graphs:
                self._capture_sampling(sampler, fi.logprobs)
        elif fi.is_decode:
            key = (fi.bucket, self.buckets.graph_kv(fi.kv_blocks))
            if fi.mask_deferred:
                if key in self._graph_shapes and not fi.prompt_logprobs:
                    if key not in self.forward_graphs:
                        self._capture_forward(*key)
                    if (fi.bucket, sampler, fi.logprobs) not in self.owed_sampling_graphs:
                        self._capture_owed_sampling(fi.bucket, sampler, fi.logprobs)
            elif (*key, sampler, fi.logprobs) not in self.graphs and key in self._graph_shapes:
                self._capture(*key, sampler, fi.logprobs)  # the first sampled (or logprobs) batch of this shape

    def _capture(self, rows: int, kv: int, sampler: Sampler, logprobs: bool) -> Graph:
        param_update = self.buckets.param_update
        views = self.decode_layout.views(self._device_arena())
        graph = self.device.graph(f"decode_rows{rows}_kv{kv}{sampler.suffix}{'_logprobs' if logprobs else ''}")

        def step() -> None:
            self._forward(views, rows, rows, graph.params["kv_blocks"] if param_update else kv, 1, sampler, logprobs)

        def padding(pad: dict[str, torch.Tensor]) -> None:
            pad_rows(pad, 0, rows, kv, self.layout.pad_state_index)

        self._record(graph, self.decode_layout, padding, step, {"kv_blocks": kv})
        self.graphs[(rows, kv, sampler, logprobs)] = graph
        return graph

    def _capture_forward(self, rows: int, kv: int) -> Graph:
        """The forward of a decode shape alone, its rows' logits into the static buffer: a step whose grammar mask
        is owed samples them once the mask is there. It counts the tokens fed, as any sampled step does (a greedy
        step's rows have no penalty, so for them it counts nothing)."""
        param_update = self.buckets.param_update
        views = self._decode_views()
        graph = self.device.graph(f"decode_rows{rows}_kv{kv}_forward")

        def step() -> None:
            logits = self._body(views, rows, rows, graph.params["kv_blocks"] if param_update else kv, 1, counted=True)
            self._static_logits(logits)[:rows].copy_(logits)

        def padding(pad: dict[str, torch.Tensor]) -> None:
            pad_rows(pad, 0, rows, kv, self.layout.pad_state_index)

        self._record(graph, self.decode_layout, padding, step, {"kv_blocks": kv})
        self.forward_graphs[(rows, kv)] = graph
        return graph

    def _capture_owed_sampling(self, rows: int, sampler: Sampler, logprobs: bool) -> Graph:
        """The sampling of ``rows`` rows through the grammar mask from the static logits (a step whose forward
        replayed a graph): after the mask's copy, one replay instead of the sampler's launches."""
        if self._logits is None:  # a forward's warm-up makes the buffer
            shapes = self.buckets.shapes()
            if shapes:
                self._capture_forward(*shapes[0])
            else:
                self._capture_prompt(self.buckets.token_buckets[0])
        views = self._decode_views()
        graph = self.device.graph(f"owed_sampling_rows{rows}{sampler.suffix}{'_logprobs' if logprobs else ''}")

        def step() -> None:
            logits = self._logits
            if logits is None:
                raise RuntimeError("a step's sampling runs after its forward made the logits")
            self._emit(logits[:rows], rows, views, self._no_attention(views, rows), views["seq_lens"][:rows],
                       sampler, logprobs, masked=True)

        def padding(pad: dict[str, torch.Tensor]) -> None:
            pad_rows(pad, 0, rows, self.buckets.max_blocks, self.layout.pad_state_index)

        self._record(graph, self.decode_layout, padding, step)
        self.owed_sampling_graphs[(rows, sampler, logprobs)] = graph
        return graph

    def _no_attention(self, views: dict[str, torch.Tensor], rows: int) -> PagedAttention:
        """The rows' attention metadata as the sampling is handed it (it reads none of it)."""
        return PagedAttention(views["block_tables"][:rows], views["seq_lens"][:rows], self.layout.block_size)

    def _static_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The one buffer [layout rows, V] where a graph's forward leaves its rows' logits; made by the first
        warm-up (outside capture)."""
        if self._logits is None:
            self._logits = self.device.empty((self.layout.rows, *logits.shape[1:]), logits.dtype)
        return self._logits

    def _capture_prompt(self, tokens: int) -> Graph:
        """The forward of a step padded to ``tokens``: every row's logits into the one static buffer."""
        layout, rows, kv = self.layout.padded_layout(tokens), self.layout.rows, self.buckets.max_blocks
        views = layout.views(self._device_arena())
        graph = self.device.graph(f"prompt_tokens{tokens}")

        def step() -> None:
            logits = self._body(views, rows, tokens, kv, tokens, captured=True, counted=True)  # any variant may sample
            self._static_logits(logits).copy_(logits)

        def padding(pad: dict[str, torch.Tensor]) -> None:
            pad_rows(pad, 0, rows, kv, self.layout.pad_state_index)
            pad["query_start"][0] = 0
            pad["query_start"][1:] = 1  # row 0 holds token 0; every other row, and token, is padding
            for name in TOKEN_NAMES:
                pad[name][:tokens] = 0

        self._record(graph, layout, padding, step)
        self.prompt_graphs[tokens] = graph
        return graph

    def _capture_sampling(self, sampler: Sampler, logprobs: bool) -> Graph:
        """The sampling of a padded step's rows from the static logits (the row fields: any layout's)."""
        if self._logits is None:
            self._capture_prompt(self.buckets.token_buckets[0])  # its warm-up makes the buffer
        rows, kv = self.layout.rows, self.buckets.max_blocks
        views = self.decode_layout.views(self._device_arena())
        graph = self.device.graph(f"prompt_sampling{sampler.suffix}{'_logprobs' if logprobs else ''}")

        def step() -> None:
            logits = self._logits
            if logits is None:
                raise RuntimeError("a padded step's sampling runs after its forward made the logits")
            attention = PagedAttention(views["block_tables"][:rows, :kv], views["seq_lens"][:rows],
                                       self.layout.block_size)
            self._emit(logits, rows, views, attention, views["seq_lens"][:rows], sampler, logprobs)

        def padding(pad: dict[str, torch.Tensor]) -> None:
            pad_rows(pad, 0, rows, kv, self.layout.pad_state_index)

        self._record(graph, self.decode_layout, padding, step)
        self.sampling_graphs[(sampler, logprobs)] = graph
        return graph

    def _decode_views(self) -> dict[str, torch.Tensor]:
        """The decode layout's views of the device arena, made once (a step that owes its mask reads its row
        fields there, every step)."""
        if self._arena_views is None:
            self._arena_views = self.decode_layout.views(self._device_arena())
        return self._arena_views

    def _device_arena(self) -> torch.Tensor:
        if self.arena is None:
            raise RuntimeError("graphs need device memory separate from the host")
        return self.arena

    def _record(self, graph: Graph, layout: ArenaLayout, padding: Callable[[dict[str, torch.Tensor]], None],
                step: Callable[[], None], params: Mapping[str, int] | None = None) -> None:
        """Run ``step`` once on the inputs ``padding`` writes (kernels compiled, pools and handles made, outside
        capture), then capture it into ``graph``."""
        maybe_fail("capture")
        started = time.perf_counter()
        arena = self._device_arena()
        pad = self.device.host_empty((layout.nbytes,), torch.uint8, pinned=True)
        padding(layout.views(pad))
        self.compute.copy(arena[: layout.nbytes], pad)
        self.compute.launch(step)  # warm-up outside capture: allocator pools, library handles, kernels compiled
        graph.capture(lambda: self.compute.launch(step), self.compute, params=params)
        self.compute.synchronize()  # the padding arena may be freed after this
        self.capture_s += time.perf_counter() - started

    # ------------------------------------------------------------------ steps
    def input_target(self) -> torch.Tensor | None:
        """Where a step's inputs must land: the static device arena, or nowhere (the device reads host memory)."""
        return self.arena

    def run(self, fi: ForwardInput, arena: torch.Tensor, prompt_out: torch.Tensor | None = None) -> bool:
        """Queue the forward of ``fi`` whose inputs are (or will be, stream-ordered) in ``arena``; a step with
        prompt-logprob positions writes their logprobs into ``prompt_out`` [P, LOGPROB_WIDTH] (it runs eagerly).

        Returns whether a captured graph ran.
        """
        rows, kv = fi.bucket, fi.kv_blocks
        if fi.num_copies:  # copy on write, before the forward (and outside any graph)
            copies = fi.layout.views(arena)
            count = fi.num_copies
            self.compute.launch(lambda: self._copy_blocks(copies["copy_from"][:count], copies["copy_to"][:count]))
        if fi.num_recounts:  # after the copies (their blocks are read), before the forward (and outside any graph)
            recount = fi.layout.views(arena)
            self.compute.launch(lambda: self._recount(recount, fi))
        if fi.mask_deferred:
            return self._run_forward(fi, arena, prompt_out)
        self._stage_mask(fi, arena)
        if fi.padded:
            return self._run_padded(fi, arena)
        graph = None
        if fi.is_decode and arena is self.arena and not fi.prompt_logprobs:
            graph = self.graphs.get((rows, self.buckets.graph_kv(kv), sampler_of(fi), fi.logprobs))
        if graph is None:
            views = fi.layout.views(arena)  # a replayed graph reads its static views: built only when eager
            tokens, longest, leading = fi.num_tokens, fi.max_query_len, fi.decode_rows
            masked = _carries_mask(fi)
            self.compute.launch(lambda: self._forward(views, rows, tokens, kv, longest, sampler_of(fi), fi.logprobs,
                                                      leading, prompt=prompt_out, masked=masked))
            self.num_eager_steps += 1
            return False
        if self.buckets.param_update:
            graph.update(self.compute, kv_blocks=kv)
        graph.replay(self.compute)
        self.num_graph_steps += 1
        return True

    def _run_forward(self, fi: ForwardInput, arena: torch.Tensor, prompt_out: torch.Tensor | None) -> bool:
        """The forward of a step whose grammar mask is owed; its sampling waits in ``_owed`` for ``sample_owed``."""
        if self._owed is not None:
            raise RuntimeError(f"step {fi.step_id}: queued while step {self._owed.step_id} still waits for its "
                               f"grammar mask (the engine supplies a mask before it queues the next step)")
        rows, kv, sampler = fi.bucket, fi.kv_blocks, sampler_of(fi)
        graph = None
        if arena is self.arena and not fi.prompt_logprobs:
            if fi.padded:
                graph = self.prompt_graphs.get(fi.num_tokens)
            elif fi.is_decode:
                graph = self.forward_graphs.get((rows, self.buckets.graph_kv(kv)))
        if graph is not None:
            if self.buckets.param_update and not fi.padded:
                graph.update(self.compute, kv_blocks=kv)
            graph.replay(self.compute)
            self.num_graph_steps += 1
            logits = self._logits
            views = self._decode_views()  # the row fields: the same place in every step layout
            self._owed = _OwedSampling(fi.step_id, lambda: logits[:rows] if logits is not None else _no_logits(),
                                       rows, views, kv if not fi.padded else self.buckets.max_blocks, sampler,
                                       fi.logprobs, self.owed_sampling_graphs.get((rows, sampler, fi.logprobs)))
            return True
        views = fi.layout.views(arena)
        made: list[torch.Tensor] = []  # the eager forward's logits, once the stream has run it

        def forward() -> None:
            made.append(self._logits_of(views, rows, fi.num_tokens, kv, fi.num_tokens if fi.padded
                                        else fi.max_query_len, fi.sample, fi.decode_rows, fi.padded, prompt_out))

        self.compute.launch(forward)
        self.num_eager_steps += 1
        self._owed = _OwedSampling(fi.step_id, lambda: made[0] if made else _no_logits(), rows, views, kv, sampler,
                                   fi.logprobs)
        return False

    def sample_owed(self, masks: torch.Tensor | None) -> None:
        """Queue the sampling of the step whose forward waits for its grammar mask: ``masks`` [rows, words] int32
        (host memory that stays valid until the step is done) into the mask buffer, then the rows sampled through
        it; None: every token allowed (a step cancelled before its mask was written)."""
        owed, self._owed = self._owed, None
        if owed is None:
            raise RuntimeError("a grammar mask was supplied with no step waiting for one")
        rows, views = owed.rows, owed.views
        if masks is None:
            self.compute.launch(lambda: self.token_mask.fill_(ALL_ALLOWED))
        else:  # the rows the sampling reads: past them the buffer is never read before it is written again
            self.compute.copy(self.token_mask[:rows], masks[:rows])
        self._mask_set = True
        if owed.graph is not None:
            owed.graph.replay(self.compute)
            return
        attention = PagedAttention(views["block_tables"][:rows, : owed.kv], views["seq_lens"][:rows],
                                   self.layout.block_size)
        self.compute.launch(lambda: self._emit(owed.logits(), rows, views, attention, views["seq_lens"][:rows],
                                               owed.sampler, owed.logprobs, masked=True))

    def _stage_mask(self, fi: ForwardInput, arena: torch.Tensor) -> None:
        """The step's token bitmask into the buffer the sampling reads (stream-ordered before the forward); a
        sampled step without one sets the buffer back to all ones once, after a step that had one."""
        if _carries_mask(fi):
            masks = fi.layout.view(arena, TOKEN_MASK)
            self.compute.launch(lambda: self.token_mask.copy_(masks))
            self._mask_set = True
        elif self._mask_set and fi.sample:
            self.compute.launch(lambda: self.token_mask.fill_(ALL_ALLOWED))
            self._mask_set = False

    def _run_padded(self, fi: ForwardInput, arena: torch.Tensor) -> bool:
        """A step padded to its token bucket: its forward's graph then its sampling's (eagerly where one is missing)."""
        forward = self.prompt_graphs.get(fi.num_tokens) if arena is self.arena else None
        sampling = self.sampling_graphs.get((sampler_of(fi), fi.logprobs)) if arena is self.arena else None
        if forward is None or sampling is None:
            views = fi.layout.views(arena)
            rows, tokens, kv = fi.bucket, fi.num_tokens, fi.kv_blocks
            masked = _carries_mask(fi)
            self.compute.launch(lambda: self._forward(views, rows, tokens, kv, tokens, sampler_of(fi), fi.logprobs,
                                                      captured=True, masked=masked))
            self.num_eager_steps += 1
            return False
        forward.replay(self.compute)
        sampling.replay(self.compute)
        self.num_graph_steps += 1
        return True

    def graph_summary(self) -> GraphSummary:
        """How many graphs are captured, and the wall time their capture took."""
        return GraphSummary(len(self.graphs) + len(self.forward_graphs), len(self.prompt_graphs),
                            len(self.sampling_graphs) + len(self.owed_sampling_graphs), self.capture_s,
                            self.graph_bytes)

    # ------------------------------------------------------------------ device work
    def _copy_blocks(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy on write: each shared block's keys and values, and the tokens its slots hold (the penalties
        count a row's tokens from its blocks: a copy must count the sharer's tokens, not the last user's)."""
        self.model.copy_blocks(self.state, source, target)
        tokens = self.slot_tokens.view(-1, self.layout.block_size)  # [NB, bs]
        tokens.index_copy_(0, target.to(torch.int64), tokens.index_select(0, source.to(torch.int64)))

    def _recount(self, views: dict[str, torch.Tensor], fi: ForwardInput) -> None:
        """Rebuild the penalty counts of the step's rows new to their state index (the first ``fi.num_recounts``
        of recount_rows) from the tokens their blocks hold before those they feed now: a prefix from the cache, the
        prompt blocks a sample of ``n`` shares, a preempted sequence's cached part. O(vocab + context) per such row,
        once per sequence and index; the forward then adds the tokens fed (count_fed_tokens).

        The step's tokens are written to their slots first, as the forward writes them again: another row of the
        step may feed a slot of a block such a row holds (a decode row filling a block the cache hands out now).
        """
        rows, tokens = fi.bucket, fi.num_tokens
        states = views["state_indices"][:rows]
        query_start = views["query_start"][: rows + 1]
        token_rows = None if fi.is_decode else _token_rows(views, rows, tokens, self.layout.block_size)
        token_states = states if token_rows is None else states[token_rows]
        self.ops.relay_inputs(views["input_ids"][:tokens], self.handoff.seq_tokens, token_states, self.slot_tokens,
                              views["slot_mapping"][:tokens])
        recount = views["recount_rows"][: fi.num_recounts]
        held = views["seq_lens"][recount] - (1 if fi.is_decode else query_start[recount + 1] - query_start[recount])
        history = TokenHistory(self.output_counts, self.prompt_counts, states[recount])
        count_history(history, self.slot_tokens, views["block_tables"][recount, : fi.kv_blocks],
                      self.layout.block_size, held, views["prompt_lens"][recount])

    def _forward(self, views: dict[str, torch.Tensor], rows: int, tokens: int, kv: int, longest: int,
                 sampler: Sampler, logprobs: bool = False, decode_rows: int = 0, captured: bool = False,
                 prompt: torch.Tensor | None = None, masked: bool = False) -> None:
        """One step on the device: ``rows`` rows feeding ``tokens`` tokens, at most ``longest`` per row; with
        ``prompt``, the logprobs of the step's prompt positions (``PROMPT_LOGPROBS``) into it; ``masked``: the
        rows are sampled through the grammar mask even when greedy (an eager step that carries one)."""
        logits = self._logits_of(views, rows, tokens, kv, longest, sampler is not Sampler.argmax, decode_rows,
                                 captured, prompt)
        attention = PagedAttention(views["block_tables"][:rows, :kv], views["seq_lens"][:rows], self.layout.block_size)
        self._emit(logits, rows, views, attention, views["seq_lens"][:rows], sampler, logprobs, masked)

    def _logits_of(self, views: dict[str, torch.Tensor], rows: int, tokens: int, kv: int, longest: int,
                   sampled: bool, decode_rows: int = 0, captured: bool = False,
                   prompt: torch.Tensor | None = None) -> torch.Tensor:
        """The forward of ``_forward`` up to its rows' logits [rows, V], the prompt logprobs written."""
        # Only a sampled step counts the tokens it feeds for the penalties: a row with a penalty makes every step
        # that holds it a sampled one (the packer's state_sampler), so a greedy step has none to count.
        logits = self._body(views, rows, tokens, kv, longest, decode_rows, captured, prompt is not None, sampled)
        if prompt is not None:
            self._prompt_logprobs(logits[rows:], views[PROMPT_LOGPROBS][1], prompt)
            logits = logits[:rows]
        return logits

    def _body(self, views: dict[str, torch.Tensor], rows: int, tokens: int, kv: int, longest: int,
              decode_rows: int = 0, captured: bool = False, prompt: bool = False,
              counted: bool = False) -> torch.Tensor:
        """The model's forward over the step in ``views``: each row's logits [rows, V], then with ``prompt`` those
        of the step's prompt-logprob positions [P, V].

        ``captured``: the step is padded to its token bucket (``tokens``) and ``rows`` (the layout's),
        so nothing here may depend on how many of them are the step's (``PagedAttention.captured``).
        ``counted``: the tokens fed are added to the penalty counts of the rows that have one.
        """
        maybe_fail("forward")
        states = views["state_indices"][:rows]
        seq_lens = views["seq_lens"][:rows]
        decode = longest == 1 and not captured
        query_start = None if decode else views["query_start"][: rows + 1]
        attention = PagedAttention(views["block_tables"][:rows, :kv], seq_lens, self.layout.block_size, query_start,
                                   longest, decode_rows, captured)
        token_rows = None if decode else attention.token_rows(tokens)
        token_states = states if token_rows is None else states[token_rows]
        slot_mapping = views["slot_mapping"][:tokens]  # slot_tokens: what a recount reads
        input_ids = self.ops.relay_inputs(views["input_ids"][:tokens], self.handoff.seq_tokens, token_states,
                                          self.slot_tokens, slot_mapping)
        if counted:
            self._count_fed(views, rows, tokens, input_ids, token_states, token_rows)
        last_index = None if query_start is None else query_start[1:] - 1
        logits_index = None
        if prompt:  # an eager step: each row's last token, then the prompt positions
            rows_last = torch.arange(rows, device=input_ids.device) if last_index is None else last_index
            logits_index = torch.cat([rows_last, views[PROMPT_LOGPROBS][0]])
        batch = StepBatch(input_ids, views["positions"][:tokens], slot_mapping, attention, states, last_index,
                          logits_index)
        logits = self.model.forward(batch, self.state, self.ops)
        if logits_index is not None and logits.shape[0] != logits_index.shape[0]:
            raise RuntimeError(f"prompt logprobs: the model returned {logits.shape[0]} rows of logits for "
                               f"{logits_index.shape[0]} asked (its forward must use StepBatch.logit_tokens)")
        return logits

    def _count_fed(self, views: dict[str, torch.Tensor], rows: int, tokens: int, input_ids: torch.Tensor,
                   token_states: torch.Tensor, token_rows: torch.Tensor | None) -> None:
        """Add the step's fed tokens to the penalty counts of the rows that have one: O(tokens), graph-safe.
        ``token_rows`` None: a decode step, token i is row i's (padded rows have no penalty)."""
        counted = penalized({name: views[name][:rows] for name in PENALTY_NEUTRAL})
        prompt_lens = views["prompt_lens"][:rows]
        if token_rows is not None:  # tokens past query_start[rows] are no row's (a step padded to its bucket)
            fed = torch.arange(tokens, device=input_ids.device) < views["query_start"][rows]
            counted, prompt_lens = counted[token_rows] & fed, prompt_lens[token_rows]
        count_fed_tokens(TokenHistory(self.output_counts, self.prompt_counts, token_states), input_ids,
                         views["positions"][:tokens], prompt_lens, counted)

    def _prompt_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor) -> None:
        """Each prompt position's logprobs (the next prompt token's, its rank, the top ones) from the model's own
        logits, into ``out``: the whole vocabulary's on every rank, as the rows' logprobs read it."""
        if self.vocab_shard is not None:
            if self.vocab_shard.size < self.vocab_shard.per_rank:
                logits[:, self.vocab_shard.size:] = float("-inf")
            logits = gather_logits(logits, self.vocab_shard)
        out.copy_(token_logprobs(logits, targets))

    def _emit(self, logits: torch.Tensor, rows: int, views: dict[str, torch.Tensor], attention: PagedAttention,
              sample_positions: torch.Tensor, sampler: Sampler, logprobs: bool, masked: bool = False) -> None:
        sampling = None
        if sampler is not Sampler.argmax:  # the counts are current: the forward added this step's tokens
            history = TokenHistory(self.output_counts, self.prompt_counts, views["state_indices"][:rows])
            sampling = SamplingInputs.from_views(views, rows, sample_positions, history,
                                                 draws=sampler in (Sampler.draw, Sampler.cut),
                                                 cuts=sampler is Sampler.cut)
        # A row whose logits hold a NaN or an inf: the host reads NONFINITE for it and fails that request;
        # the relay keeps the sampled id, a valid index either way. A sampled step masks what structured
        # output disallows (-inf) before anything else of the sampler; the finite check and the logprobs
        # read the logits as the model made them.
        mask = self.token_mask[:rows] if sampling is not None or masked else None
        slots = views["sample_slots"][:rows]
        checked, relay = self.handoff.publish_targets(rows)
        if self.vocab_shard is None and mask is None:  # the sampler reads what the check reads: one op for both
            tokens = self.ops.sample_publish(logits, sampling, checked, relay, slots)
        elif self.vocab_shard is not None and not logprobs:  # the check's verdict from every rank's block
            tokens, finite = pick_tokens(logits, sampling, self.vocab_shard, self.ops, mask)
            publish_checked(tokens, finite, checked, relay, slots)
        else:
            if self.vocab_shard is not None:  # logprobs need the whole vocabulary on every rank
                if self.vocab_shard.size < self.vocab_shard.per_rank:
                    logits[:, self.vocab_shard.size:] = float("-inf")
                logits = gather_logits(logits, self.vocab_shard)
            tokens = publish_tokens(logits, self.ops.sample(_masked(logits, mask), sampling), checked, relay, slots)
        if logprobs:
            self.handoff.publish_logprobs(rows, token_logprobs(logits, tokens))

    def close(self) -> None:
        self._owed = None
        for graph in [*self.graphs.values(), *self.prompt_graphs.values(), *self.sampling_graphs.values(),
                      *self.forward_graphs.values(), *self.owed_sampling_graphs.values()]:
            graph.reset()
        self.graphs.clear()
        self.forward_graphs.clear()
        self.owed_sampling_graphs.clear()
        self.prompt_graphs.clear()
        self.sampling_graphs.clear()


def _token_rows(views: Mapping[str, torch.Tensor], rows: int, tokens: int, block_size: int) -> torch.Tensor:
    """[tokens] int64: the row of each token of a step with prompt tokens, on the device."""
    return PagedAttention(views["block_tables"][:rows], views["seq_lens"][:rows], block_size,
                          views["query_start"][: rows + 1]).token_rows(tokens)


class Sampler(enum.IntEnum):
    """Which sampling a step's graph runs, decided by the packer from its rows (``sampler_of``)."""

    argmax = 0  # every row greedy with nothing to apply: the logits' argmax
    processed = 1  # some row's logits change first (logit_bias, min_tokens, a penalty, a mask); none draws
    draw = 2  # some row draws (temperature > 0), none cuts: noise over the vocabulary and its argmax
    cut = 3  # some row draws and some row has a cut (top-k, top-p, min_p): the vocabulary sorted first

    @property
    def suffix(self) -> str:
        """The variant in a graph's name."""
        return "" if self is Sampler.argmax else f"_{self.name}"


def sampler_of(fi: ForwardInput) -> Sampler:
    """The sampling variant step ``fi`` runs: what its packer said of its rows (``sample``, ``draws``, ``cuts``)."""
    if not fi.sample:
        return Sampler.argmax
    if not fi.draws:
        return Sampler.processed
    return Sampler.cut if fi.cuts else Sampler.draw


@dataclass(frozen=True)
class _OwedSampling:
    """A step whose forward is queued and whose sampling waits for its grammar mask."""

    step_id: int
    logits: Callable[[], torch.Tensor]  # its rows' logits, once the stream has run the forward
    rows: int
    views: dict[str, torch.Tensor]  # the row fields the sampling reads (device memory, or the host arena)
    kv: int
    sampler: Sampler
    logprobs: bool
    graph: Graph | None = None  # the captured sampling of such rows from the static logits, where there is one


def _carries_mask(fi: ForwardInput) -> bool:
    """The step carries a grammar's token bitmask (its layout's last field)."""
    return fi.layout.fields[-1].name == TOKEN_MASK


def _no_logits() -> torch.Tensor:
    raise RuntimeError("a step's sampling ran before its forward made the logits")


def _masked(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return logits if mask is None else apply_token_bitmask(logits, mask)


#: the sampling variants of every captured step, all captured at start: (sampler, logprobs)
SAMPLING_VARIANTS = tuple((sampler, logprobs) for logprobs in (False, True) for sampler in Sampler)


@dataclass(frozen=True)
class GraphSummary:
    """The graphs a runner captured, and the wall time their capture took."""

    decode: int
    prompt: int  # a forward per token bucket of steps with prompt tokens
    sampling: int  # the sampling variants of those steps
    capture_s: float
    memory_bytes: int  # what the device's allocator held more after the capture at start

    def describe(self) -> str:
        """One line for the startup report."""
        counts = [f"{self.prompt} prompt-token buckets + {self.sampling} sampling" if self.prompt else "",
                  f"{self.decode} decode" if self.decode else ""]
        return (f"{self.decode + self.prompt + self.sampling} graphs ({', '.join(c for c in counts if c)}) captured "
                f"in {self.capture_s:.1f} s, {self.memory_bytes / 2**20:.0f} MiB of device memory")

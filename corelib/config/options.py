"""Typed engine options: the one place where the feature plan becomes what the engine does.

Startup decides every gate once (``corelib.config.features``); :meth:`EngineOptions.from_startup`
turns those decisions into plain fields. Nothing below this module looks a gate up by name.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corelib.config.features import Plan, Requirement, failing_step_requirements
from corelib.config.schema import CorelibConfig, GraphCapture, Transport

if TYPE_CHECKING:
    from corelib.engine.sequence import Sequence as Seq
    from corelib.ops.spec import OpProvider
    from corelib.platform.device import Capabilities


class Staging(str, enum.Enum):
    """How a step's inputs reach the device where the model runs (``corelib.step.staging``)."""

    inline = "inline"  # in process: the H2D on the compute stream
    host = "host"  # the device reads host memory: no device copy
    ordered = "ordered"  # SHM: pinned snapshot, H2D on the prepare stream, a ready event
    early = "early"  # SHM: the receiving thread issues the H2D straight from the slot


STRUCTURED_FACT = "request.structured_output"  # the per-step requirement structured_overlap lifts


def request_facts(seq: Seq) -> dict[str, Any]:
    """The ``request.*`` facts of one request, as the per-step requirements of the gates name them."""
    return {"multimodal": seq.multimodal, "host_stop_strings": bool(seq.sampling.stop_strings),
            "structured_output": seq.grammar is not None}


@dataclass(frozen=True)
class StepCheck:
    """The per-step requirements of async token handoff: a batch failing one runs synchronously.

    A request's facts never change while it runs, so the requirements are evaluated once per
    request (:meth:`facts_of`, when it is added), into one bit per failing requirement; a step's
    decision is then the union of its rows' bits, and its reasons are the YAML's sentences.
    """

    requirements: tuple[Requirement, ...] = ()

    def facts_of(self, seq: Seq) -> int:
        """The requirements ``seq`` fails, bit ``i`` for ``requirements[i]`` (0: it never forces a sync)."""
        if not self.requirements:
            return 0
        facts: list[Mapping[str, Any]] = [request_facts(seq)]
        mask = 0
        for bit, requirement in enumerate(self.requirements):
            if failing_step_requirements((requirement,), facts):
                mask |= 1 << bit
        return mask

    def reasons(self, seqs: Sequence[Seq]) -> list[str]:
        """Why this batch must take the synchronous path (empty: it may run ahead)."""
        if not self.requirements:
            return []
        mask = 0
        for seq in seqs:
            bits = seq.sync_mask
            if bits is None:  # a request that reached the scheduler without the core's add
                bits = seq.sync_mask = self.facts_of(seq)
            mask |= bits
        if not mask:
            return []
        return [r.reason for bit, r in enumerate(self.requirements) if mask >> bit & 1]


@dataclass(frozen=True)
class EngineOptions:
    """What the gates decided, as the engine uses it."""

    graphs: bool  # decode steps replay captured graphs
    lazy_capture: bool  # each graph is captured the first time a step needs it, not at start
    async_handoff: bool  # the scheduler runs ahead of the tokens it has read
    run_ahead: int  # steps the scheduler may submit beyond the one it reads next (0: synchronous)
    transport: Transport
    tp: int
    fast_allreduce: bool  # small tensor-parallel all-reduces through symmetric memory (corelib.transport.parallel)
    staging: Staging  # how a step's inputs reach the device where the model runs
    fused_ops: tuple[str, ...]  # the ops the backend's provider runs instead of the reference (empty: none)
    pdl: bool  # the provider's kernels are launched with programmatic dependent launch
    attention_reads_live_blocks_only: bool  # the fused decode attention reads only live blocks: no KV buckets
    compile: bool  # torch.compile the decode layer
    timeout_s: float
    step_check: StepCheck
    chunked_prefill: bool = False  # prompts fed in chunks under the token budget, in steps with decode rows
    mixed_graphs: bool = False  # steps with prompt tokens replay a graph per token bucket
    prefix_caching: bool = False  # full KV blocks shared by prompts that start alike
    share_prompt_blocks: bool = False  # requests of one prompt (n > 1) share its KV blocks: no recurrent state
    # A structured-output step runs ahead: its forward is queued at once, its sampling once the host has written
    # the grammar's mask from the previous step's tokens (EngineCore owes it; the in-process executor takes it).
    structured_overlap: bool = False
    # The norms' weights folded into the qkv and gate/up weights at start (the provider runs the fused norm ops
    # faster so: no norm kernel beside a library GEMM); the model folds only where its layers run fused.
    fold_norms: bool = False

    @property
    def pipeline_depth(self) -> int:
        """Steps on the device at once, at most (one token buffer each)."""
        return self.run_ahead + 1

    @classmethod
    def from_startup(cls, config: CorelibConfig, plan: Plan, capabilities: Capabilities,
                     provider: OpProvider | None = None, facts: Mapping[str, Any] | None = None,
                     emulated: bool = False) -> EngineOptions:
        """``provider``: the backend's op provider (used when the fused_ops gate allows); ``facts``: the model's;
        ``emulated``: the device is the stream emulator."""
        engine = config.engine
        async_handoff = plan.is_enabled("async_token_handoff")
        # Over SHM a worker whose device is the host overlaps the scheduler by itself (shm_overlap).
        ahead = "async_token_handoff" if async_handoff else "shm_overlap" if plan.is_enabled("shm_overlap") else None
        decision = plan.decisions.get(ahead) if ahead is not None else None
        requirements = decision.step_requirements if decision is not None else ()
        structured_overlap = async_handoff and plan.is_enabled("structured_overlap")
        if structured_overlap:  # a grammar's mask is owed to the step, not waited for before it
            requirements = tuple(r for r in requirements if r.fact != STRUCTURED_FACT)
        step_check = StepCheck(requirements)
        fused = provider.op_names() if provider is not None and plan.is_enabled("fused_ops") else ()
        return cls(
            graphs=plan.is_enabled("graph"),
            lazy_capture=engine.graph_capture is GraphCapture.lazy
            or (engine.graph_capture is GraphCapture.auto and emulated),
            async_handoff=async_handoff,
            run_ahead=run_ahead_for(engine.run_ahead, engine.transport, capabilities) if ahead is not None else 0,
            transport=engine.transport,
            tp=engine.tp,
            fast_allreduce=plan.is_enabled("fast_allreduce"),
            staging=_staging(engine.transport, plan, capabilities),
            fused_ops=fused,
            pdl=plan.is_enabled("pdl") and bool(fused),
            attention_reads_live_blocks_only="paged_attention" in fused and provider is not None
            and provider.live_blocks_only,
            fold_norms=provider is not None and provider.folded_norms
            and {"norm_qkv_rope_kv_write", "norm_gate_up_silu_mul"} <= set(fused),
            compile=engine.compile,
            timeout_s=engine.timeout_s,
            step_check=step_check,
            chunked_prefill=plan.is_enabled("chunked_prefill"),
            mixed_graphs=plan.is_enabled("mixed_graphs"),
            prefix_caching=plan.is_enabled("prefix_caching"),
            share_prompt_blocks=facts is not None and bool(facts.get("paged_kv"))
            and not facts.get("recurrent_state"),
            structured_overlap=structured_overlap,
        )

    @property
    def materialization(self) -> str:
        """How SHM frames reach the device, for reports ("-" in process)."""
        if self.transport is not Transport.shm:
            return "-"
        return "in place" if self.staging is Staging.host else self.staging.value


def _staging(transport: Transport, plan: Plan, capabilities: Capabilities) -> Staging:
    if capabilities.device_is_host:
        return Staging.host
    if transport is Transport.shm:
        return Staging.ordered if plan.is_enabled("shm_ordered_materialization") else Staging.early
    return Staging.inline


def run_ahead_for(configured: int | None, transport: Transport, capabilities: Capabilities) -> int:
    """Steps the scheduler submits beyond the one it reads: ``engine.run_ahead``, or where it is not set, two
    when steps cross to a worker that runs a device, one otherwise.

    Over SHM, the step after next is built from the results the worker sends back and crosses the ring again
    before the device may start it: with one step ahead that round trip has one step to hide in, and at a
    sub-millisecond step it does not always (the worker's launch then lands after the device went idle, and
    stays late from step to step). Two steps ahead give it two. A worker that computes on the host is busy
    with the step itself while the next frame comes: one step ahead hides the hop there.
    """
    if configured is not None:
        return configured
    return 2 if transport is Transport.shm and not capabilities.device_is_host else 1

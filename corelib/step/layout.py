"""Sizes derived once from the config: batch rows, KV blocks, arena sizes and graph buckets.

The scheduler process and every worker derive the same layout from the same config, so the
arenas one packs are the arenas the other reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from corelib.config.options import EngineOptions
from corelib.config.schema import CorelibConfig, Transport
from corelib.errors import ConfigError
from corelib.models.registry import architecture
from corelib.ops.token_mask import mask_words
from corelib.step.arena import ArenaLayout
from corelib.step.buckets import BucketPolicy, blocks_for, token_ladder
from corelib.step.fields import step_layout, with_prompt_logprobs, with_token_mask

TOKEN_GRANULE = 256  # a step's token slots are a multiple of this: a few distinct layouts, not one per length


@dataclass(frozen=True)
class EngineLayout:
    """Batch rows, KV blocks and arena sizes for one engine configuration."""

    rows: int
    block_size: int
    max_blocks: int
    num_blocks: int
    max_model_len: int
    max_batched_tokens: int
    graph_batch_sizes: tuple[int, ...]
    graph_token_sizes: tuple[int, ...] = ()  # empty: the token ladder up to max_batched_tokens
    graph_kv_sizes: tuple[int, ...] = ()  # decode graph widths (tokens) beside the full one (live-block attention)
    mask_words: int = 0  # int32 words of a row's token bitmask (structured output): ceil(vocab_size / 32)

    @classmethod
    def of(cls, config: CorelibConfig) -> EngineLayout:
        engine, model = config.engine, config.model
        block_size = engine.block_size
        max_blocks = blocks_for(model.max_model_len, block_size)
        num_blocks = engine.num_kv_blocks or engine.max_num_seqs * max_blocks + 1
        if num_blocks - 1 < max_blocks:
            raise ConfigError(
                f"engine.num_kv_blocks={num_blocks} holds {(num_blocks - 1) * block_size} tokens; "
                f"one request of model.max_model_len={model.max_model_len} needs {max_blocks} blocks "
                f"of {block_size} (+1 null block): raise engine.num_kv_blocks or lower model.max_model_len"
            )
        if engine.tp < 1:
            raise ConfigError(f"engine.tp={engine.tp}: must be at least 1")
        if engine.tp > 1:
            if engine.transport is not Transport.shm:
                raise ConfigError(
                    f"engine.tp={engine.tp} runs one worker process per rank, fed through shared memory: "
                    "add engine.transport=shm"
                )
            if engine.compile:
                raise ConfigError("engine.compile=true is not supported with engine.tp>1 (collectives in the "
                                  "compiled layer); drop one of them")
        architecture(model.architecture).validate(model, engine.tp)
        return cls(
            rows=engine.max_num_seqs,
            block_size=block_size,
            max_blocks=max_blocks,
            num_blocks=num_blocks,
            max_model_len=model.max_model_len,
            max_batched_tokens=engine.max_num_batched_tokens,
            graph_batch_sizes=tuple(engine.graph_batch_sizes),
            graph_token_sizes=tuple(engine.graph_token_sizes),
            graph_kv_sizes=tuple(engine.graph_kv_sizes),
            mask_words=mask_words(model.vocab_size),
        )

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step feeds: the budget, a whole prompt when prompts are not chunked, or a
        token per row."""
        return max(self.max_batched_tokens, self.max_model_len, self.rows)

    @property
    def arena_bytes(self) -> int:
        """Room for the largest step, its prompt-logprob positions and token bitmask included."""
        largest = self.step_layout(self.max_step_tokens)
        return self.masked(self.with_prompt_logprobs(largest, self.max_step_tokens)).nbytes

    @staticmethod
    def with_prompt_logprobs(layout: ArenaLayout, count: int) -> ArenaLayout:
        """``layout`` with ``count`` prompt positions whose logprobs the step computes (before any bitmask)."""
        return with_prompt_logprobs(layout, count)

    def masked(self, layout: ArenaLayout) -> ArenaLayout:
        """``layout`` with the rows' token bitmask: a step holding a structured-output row."""
        return with_token_mask(layout, self.rows, self.mask_words)

    @property
    def decode_layout(self) -> ArenaLayout:
        """The fixed arena of a decode step: a row and a token per sequence of the largest batch."""
        return step_layout(self.rows, self.rows, self.max_blocks)

    def step_layout(self, num_tokens: int) -> ArenaLayout:
        """The arena of a step feeding ``num_tokens`` tokens (one per row: the decode layout)."""
        if num_tokens <= self.rows:
            return self.decode_layout
        slots = -(-num_tokens // TOKEN_GRANULE) * TOKEN_GRANULE
        return step_layout(min(slots, max(self.max_step_tokens, num_tokens)), self.rows, self.max_blocks)

    def padded_layout(self, tokens: int) -> ArenaLayout:
        """The arena of a step with prompt tokens padded to the token bucket ``tokens``, over every row."""
        return step_layout(tokens, self.rows, self.max_blocks)

    def token_buckets(self, options: EngineOptions) -> list[int]:
        """The token buckets of steps with prompt tokens, up to the step's token budget (none: they run eagerly)."""
        if not (options.graphs and options.mixed_graphs):
            return []
        sizes = self.graph_token_sizes or tuple(token_ladder(self.max_batched_tokens))
        return [size for size in sizes if size <= self.max_batched_tokens]

    @property
    def pad_state_index(self) -> int:
        """The state index padded rows use (one past the real ones)."""
        return self.rows

    def buckets(self, options: EngineOptions, param_update: bool) -> BucketPolicy:
        return BucketPolicy.build(options.graphs, self.graph_batch_sizes, self.rows, self.max_blocks,
                                  param_update, options.attention_reads_live_blocks_only, self.token_buckets(options),
                                  [blocks_for(size, self.block_size) for size in self.graph_kv_sizes])

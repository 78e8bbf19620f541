"""Decode graphs at narrower KV widths where the attention reads only live blocks (``engine.graph_kv_sizes``).

Such an attention (the cuda backend's) is correct at any block-table width, so one full-width graph per batch
size serves every step; but it splits the width it is given across its programs, so a short context in a
full-width graph pays for splits that hold no keys. The config may name narrower widths: a step whose longest
context fits replays the narrowest graph that holds it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import GPU_SMALL_FLOAT32, EngineFactory

from corelib.config.options import EngineOptions
from corelib.engine import Engine, SamplingParams
from corelib.errors import ConfigError
from corelib.step.buckets import BucketPolicy
from corelib.step.layout import EngineLayout

# prompts of 3 and 70 tokens: the first row's context fits 32 tokens (2 blocks of 16) for all its 20 new tokens,
# the second's needs 5 blocks; after the second's 4 tokens the first decodes alone
WORK = [([(3 * j) % 200 + 2 for j in range(n)], SamplingParams(max_tokens=new, ignore_eos=True))
        for n, new in ((3, 20), (70, 4))]
EMULATED = ["backend=mlu", "model.max_model_len=128", "engine.max_num_seqs=2", "engine.graph_batch_sizes=[1,2]"]


def test_live_block_attention_captures_the_full_width_and_the_named_ones() -> None:
    policy = BucketPolicy.build(True, [1, 2], 2, 8, False, live_blocks_only=True, live_widths=[2, 20])
    assert policy.kv_buckets == (2, 8)  # a width past the full one stands for it
    assert [policy.graph_kv(kv) for kv in (1, 2, 3, 8)] == [2, 2, 8, 8]
    assert policy.decode_shape(2, 1) == (2, 1, True)  # the step packs only the columns it needs
    assert set(policy.shapes()) == {(rows, kv) for rows in (1, 2) for kv in (2, 8)}
    # Without named widths, the one full-width graph, as before; elsewhere every power of two.
    assert BucketPolicy.build(True, [1], 1, 8, False, live_blocks_only=True).kv_buckets == (8,)
    assert BucketPolicy.build(True, [1], 1, 8, False, live_widths=[2]).kv_buckets == (1, 2, 4, 8)
    assert BucketPolicy.build(True, [1], 1, 8, True, live_blocks_only=True, live_widths=[2]).kv_buckets == (8,)


def test_a_width_below_one_token_is_refused_in_one_line(make_engine: EngineFactory) -> None:
    with pytest.raises(ConfigError, match=r"engine.graph_kv_sizes: 0 is not a context width") as error:
        make_engine(["backend=npu", "engine.graph_kv_sizes=[32,0]"])
    assert "\n" not in str(error.value)


def _live(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated device's attention taken as reading only live blocks. Its reference attention gathers every
    column it is given, so here a step packs its graph's whole width (block 0 past each row's blocks), where the
    cuda backend's packs only the columns the step needs: the GPU test below runs that path itself."""
    buckets, decode_shape = EngineLayout.buckets, BucketPolicy.decode_shape

    def live(self: EngineLayout, options: EngineOptions, param_update: bool) -> BucketPolicy:
        return buckets(self, dataclasses.replace(options, attention_reads_live_blocks_only=True), param_update)

    def packed_to_the_graph(self: BucketPolicy, num_seqs: int, kv_needed: int) -> tuple[int, int, bool]:
        rows, kv, graph = decode_shape(self, num_seqs, kv_needed)
        return rows, self.graph_kv(kv) if graph else kv, graph

    monkeypatch.setattr(EngineLayout, "buckets", live)
    monkeypatch.setattr(BucketPolicy, "decode_shape", packed_to_the_graph)


def _tokens(engine: Engine) -> list[list[int]]:
    prompts, params = zip(*WORK, strict=True)
    return [list(out.output_token_ids) for out in engine.generate(list(prompts), list(params))]


def test_a_short_context_replays_the_narrow_graph_with_the_tokens_of_the_full_width(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    _live(monkeypatch)
    full = make_engine([*EMULATED, "engine.graph_kv_sizes=[]"])
    narrow = make_engine([*EMULATED, "engine.graph_kv_sizes=[32]"])
    assert full.local_runner.buckets.kv_buckets == (8,) and narrow.local_runner.buckets.kv_buckets == (2, 8)
    assert _tokens(narrow) == _tokens(full)
    used = {kv for _, kv, _, _ in narrow.local_runner.graphs}
    assert used == {2, 8}, f"the short row alone replays the 2-block graph, with the long row the full one: {used}"
    assert narrow.local_runner.num_eager_steps == full.local_runner.num_eager_steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_narrow_graphs_give_the_tokens_of_the_full_width_in_float32(make_engine: EngineFactory) -> None:
    base = [*GPU_SMALL_FLOAT32, "engine.max_num_seqs=4", "engine.graph_batch_sizes=[1,2,4]",
            "engine.async_token_handoff=on"]
    # the long rows finish first: then the short ones decode in the 16-block graphs, at first in the full one
    work = [([(7 * j) % 300 + 2 for j in range(n)], SamplingParams(max_tokens=new, ignore_eos=True))
            for n, new in ((5, 60), (40, 40), (300, 8), (700, 4))]
    prompts, params = zip(*work, strict=True)
    full = make_engine([*base, "engine.graph_kv_sizes=[]"]).generate(list(prompts), list(params))
    engine = make_engine([*base, "engine.graph_kv_sizes=[64,256]"])
    assert engine.local_runner.buckets.kv_buckets == (4, 16, 64)
    narrow = engine.generate(list(prompts), list(params))
    assert [o.output_token_ids for o in narrow] == [o.output_token_ids for o in full]

"""A vocabulary-parallel LM head: each rank's block of the logits, and one token picked the same on every rank.

The ranks are threads here, their all-reduce a barrier that sums what each contributed, so the
pick is checked against the full logits' own argmax and sampler with no process group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import TypeVar

import pytest
import torch

from corelib.models.sharding import TensorShard, VocabShard
from corelib.ops import NONFINITE, SamplingInputs
from corelib.ops.reference import reference_ops
from corelib.ops.sampling import sample_rows
from corelib.step.runner import ModelRunner, Sampler
from corelib.step.vocab_parallel import pick_tokens

T = TypeVar("T")


class ThreadAllReduce:
    """An in-place sum across ``world`` threads, standing in for the process group's all-reduce."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world)
        self._parts: dict[int, torch.Tensor] = {}
        self.calls = 0

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self._parts[rank] = tensor.clone()
            self._barrier.wait(10)
            total = sum(self._parts[r] for r in range(self.world))
            self._barrier.wait(10)
            assert isinstance(total, torch.Tensor)
            tensor.copy_(total)
            if rank == 0:
                self.calls += 1
            return tensor

        return all_reduce


def on_ranks(world: int, vocab: int, step: Callable[[VocabShard], T]) -> list[T]:
    """``step(shard)`` on ``world`` threads at once, their shards' all-reduce summing across them: each rank's
    result, in rank order (one all-reduce per step)."""
    reduce = ThreadAllReduce(world)
    shards = [TensorShard(rank, world, reduce.for_rank(rank)).vocab(vocab) for rank in range(world)]
    out: dict[int, T] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = step(shards[rank])
        except BaseException as error:  # noqa: BLE001 - raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    assert reduce.calls == 1, "one all-reduce per step"
    return [out[rank] for rank in range(world)]


def picks(full: torch.Tensor, world: int, sampling: SamplingInputs | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (tokens, finite) for the full logits [B, V] split into ``world`` blocks."""

    def pick(shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
        block = full.new_zeros((full.shape[0], shard.per_rank))
        block[:, : shard.size] = full[:, shard.start : shard.start + shard.size]  # the padding rows: logit 0
        return pick_tokens(block, sampling, shard, reference_ops())

    return on_ranks(world, full.shape[1], pick)


def logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn((rows, vocab), generator=generator) - 5.0  # all negative: a padding row's 0 would win
    full[1, 3] = full[1, vocab - 1] = full[1].max() + 1.0  # a tie across blocks: the first id wins
    full[2, 5] = float("nan")
    full[3, 0] = float("inf")
    return full


@pytest.mark.parametrize(("vocab", "world"), [(13, 3), (16, 2), (11, 4)])
def test_every_rank_picks_the_argmax_of_the_whole_vocabulary(vocab: int, world: int) -> None:
    full = logits(6, vocab, seed=vocab)
    expected = full.argmax(dim=-1)
    finite = torch.isfinite(full.sum(dim=-1))
    for tokens, flags in picks(full, world, None):
        good = finite
        assert torch.equal(tokens[good], expected[good]), (tokens, expected)
        assert torch.equal(flags, finite)
        assert int(tokens[1]) == 3, "equal logits: the lowest token id, as argmax over the full logits"
        assert bool(((tokens >= 0) & (tokens < vocab)).all()), "a padding row was picked"


def test_a_sampled_step_samples_what_the_full_logits_sample() -> None:
    vocab, rows = 29, 5
    full = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(1))
    sampling = SamplingInputs.of(
        torch.arange(rows, dtype=torch.int64) + 11,
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9]), top_k=torch.tensor([0, 5, 0, 3, 0]),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0]), seeds=torch.arange(rows, dtype=torch.int64) * 7,
    )
    expected = sample_rows(full, sampling)
    for tokens, flags in picks(full, 3, sampling):
        assert torch.equal(tokens, expected)
        assert bool(flags.all())


def test_a_ranks_lm_head_rows_are_its_block_padded_to_equal_size() -> None:
    lm_head = torch.arange(13 * 2, dtype=torch.float32).view(13, 2)
    shards = [VocabShard(rank, 3, 13) for rank in range(3)]
    blocks = [shard.rows(lm_head) for shard in shards]
    assert [tuple(b.shape) for b in blocks] == [(5, 2)] * 3
    assert [(s.start, s.size) for s in shards] == [(0, 5), (5, 5), (10, 3)]
    assert torch.equal(torch.cat([b[: s.size] for b, s in zip(blocks, shards, strict=True)]), lm_head)
    assert not blocks[2][3:].any(), "the last block's padding rows are zero"
    assert blocks[0].data_ptr() != lm_head.data_ptr(), "a block owns its memory: the full head can go"


def test_the_runner_publishes_the_ranks_finite_verdict_for_the_host() -> None:
    # A greedy step over a vocabulary-parallel head: each rank's runner hands the verdict of every rank's block to the
    # host's copy (NONFINITE for a row whose logits hold a NaN or an inf in any block), and the picked id to the relay.
    rows, vocab, world = 6, 16, 2
    full = logits(rows, vocab, seed=vocab)  # rows 2 and 3: a NaN and an inf in rank 0's block
    full[4, 12] = float("nan")  # rank 1's
    slots = torch.tensor([5, 0, 3, 1, 4, 2])

    def emit(shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
        checked, relay = torch.zeros(rows, dtype=torch.int64), torch.full((rows,), -7, dtype=torch.int64)
        runner = SimpleNamespace(vocab_shard=shard, ops=reference_ops(), token_mask=torch.zeros(rows, 1),
                                 handoff=SimpleNamespace(publish_targets=lambda n: (checked[:n], relay)))
        block = full[:, shard.start : shard.start + shard.per_rank].clone()
        ModelRunner._emit(runner, block, rows, {"sample_slots": slots}, None,  # type: ignore[arg-type]
                          torch.arange(rows), Sampler.argmax, logprobs=False)
        return checked, relay

    published = on_ranks(world, vocab, emit)
    finite = torch.isfinite(full.sum(dim=-1))
    assert finite.tolist() == [True, True, False, False, False, True]
    expected = torch.where(finite, full.argmax(dim=-1), NONFINITE)
    for checked, relay in published:
        assert torch.equal(checked, expected), (checked, expected)
        assert torch.equal(relay[slots][finite], full.argmax(dim=-1)[finite])
        assert bool((relay >= 0).all()), "the relay keeps a valid id for every row, finite or not"

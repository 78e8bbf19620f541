"""Random workloads through the engine's configurations, every request's tokens those of the plain reference.

A workload (a function of its seed alone) is a few prompts, some beginning with the same whole
blocks so that the prefix cache finds them, each run as ``n`` requests that share its blocks or
as separate requests, arriving over the first steps, greedy or sampled with a seed, many with
penalties. It runs on an engine whose configuration the seed also draws: the prefix cache on or
off, prompts whole or in chunks of a small token budget, async handoff on the emulated NPU under
chaos or the synchronous CPU path, and a KV pool of blocks of 4 from roomy down to one that
holds a single request of the longest length, so that requests are preempted. Every request
must finish by length (or at a stop id past its min_tokens), with exactly the tokens the plain
reference draws (one full forward per token, the sampler of tests/samplerkit.py): a mistake in
any of those paths changes some token.

Two paths are rare unless a workload aims at them, so most workloads do:

- a burst of prompts that takes every block of a small pool, the last one's samples sharing a block
  they write into: its copy on write finds no free block and preempts, maybe the very sample that
  shared the block (which is then no longer shared);
- penalties on the samples of a shared prompt, a repetition penalty below 1 among them: a copy on
  write moves the prompt's last tokens to a block another request used before, and the repetition
  penalty, which favours the prompt's tokens there, is the one that reads them back.

The default run has one workload for each of the 8 combinations of prefix cache, chunks and
async handoff; ``-m long`` runs a few hundred (``CORELIB_FUZZ_WORKLOADS`` sets how many).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from support import reference_sampled, seeded_weights

from corelib.engine import Engine, RequestOutput, SamplingParams
from corelib.models.llama import ModelWeights
from corelib.sampling_params import SEED_LIMIT

BLOCK_SIZE = 4
MAX_TOKENS = 10  # the most tokens a request asks for
VOCAB = range(2, 512)  # the tiny model's ids but pad (0) and EOS (1)
# (model.max_model_len, engine.num_kv_blocks) and how often each is drawn: a pool of 0 is sized for max_num_seqs
# requests of full length; the others hold one request of full length (+1 null block), or a little more. The
# smallest are drawn most: there a few requests fill the pool, and a sample's copy on write finds no free block.
POOLS = {(52, 0): 1, (52, 20): 1, (52, 14): 1, (32, 9): 2, (24, 7): 2, (16, 5): 2}
MAX_STEPS = 20_000  # far beyond any workload's needs: reaching it means the engine stopped making progress
SHORT_SEEDS = range(8)  # each of the 8 combinations of prefix cache, chunks and async handoff once
LONG_WORKLOADS = int(os.environ.get("CORELIB_FUZZ_WORKLOADS", "240"))
LONG_FIRST_SEED = 1000


# ---------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class Config:
    """An engine configuration; equal ones share an engine across workloads."""

    prefix_caching: bool
    chunked_prefill: bool
    async_handoff: bool  # on the emulated NPU with chaos; off: the CPU backend, synchronous
    max_model_len: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int

    @property
    def overrides(self) -> list[str]:
        backend = (["backend=npu", "backend.emulator.chaos=0.2", "engine.async_token_handoff=on"]
                   if self.async_handoff else ["backend=cpu", "engine.async_token_handoff=off"])
        return [*backend, f"engine.prefix_caching={'on' if self.prefix_caching else 'off'}",
                f"engine.chunked_prefill={'on' if self.chunked_prefill else 'off'}",
                f"engine.max_num_batched_tokens={self.max_num_batched_tokens}",
                f"engine.block_size={BLOCK_SIZE}", f"engine.num_kv_blocks={self.num_kv_blocks}",
                f"engine.max_num_seqs={self.max_num_seqs}", f"model.max_model_len={self.max_model_len}"]


# --------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Group:
    """One prompt's requests: ``shared`` adds them with add_requests_sharing_prompt, else one by one."""

    prompt: tuple[int, ...]
    samplings: tuple[SamplingParams, ...]
    shared: bool
    arrival: int  # the engine steps taken before it is added


@dataclass(frozen=True)
class Workload:
    seed: int
    config: Config
    groups: tuple[Group, ...]

    def request_id(self, group: int, sample: int) -> str:
        return f"w{self.seed}.g{group}.s{sample}"


def _sampling(chance: random.Random, penalised: float) -> SamplingParams:
    """Greedy or sampled (with min-p, top-k and top-p), with penalties at odds ``penalised``, some with a logit
    bias, some with min_tokens and stop ids; always an explicit seed."""
    temperature, top_k, top_p, min_p = 0.0, 0, 1.0, 0.0
    if chance.random() < 0.6:
        temperature, top_k = chance.choice([0.3, 0.7, 1.0, 1.5]), chance.choice([0, 0, -1, 1, 5, 40])
        top_p = chance.choice([1.0, 1.0, 0.95, 0.8, 0.5])
        min_p = chance.choice([0.0, 0.0, 0.05, 0.2, 0.6])
    bias: dict[int, float] | None = None
    if chance.random() < 0.3:  # a ban, a push, a pull; 100 all but forces its token
        values = [-100.0, -3.0, 1.5, 4.0, 100.0]
        bias = {chance.choice(VOCAB): chance.choice(values) for _ in range(chance.randint(1, 4))}
    max_tokens, min_tokens, stop_ids = chance.randint(1, MAX_TOKENS), 0, tuple[int, ...]()
    if chance.random() < 0.25:  # stop ids banned before min_tokens, then able to end the request
        min_tokens = chance.randint(0, max_tokens)
        stop_ids = tuple(chance.sample(VOCAB, chance.randint(1, 6)))
    repetition, frequency, presence = 1.0, 0.0, 0.0
    if chance.random() < penalised:
        # Below 1 the prompt's tokens are favoured (a positive logit multiplied by 10 at 0.1): which tokens
        # the penalty counts then decides most draws.
        repetition = chance.choice([1.3, 2.0, 10.0, 0.8, 0.5, 0.2, 0.1, 0.1])
        frequency, presence = chance.choice([0.0, 0.5, -0.5, 2.0]), chance.choice([0.0, 1.0, -1.0, 2.0])
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=chance.randrange(SEED_LIMIT),
                          temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition,
                          frequency_penalty=frequency, presence_penalty=presence, min_p=min_p, logit_bias=bias,
                          min_tokens=min_tokens, stop_token_ids=stop_ids)


def _samplings(chance: random.Random, n: int, shared: bool) -> tuple[SamplingParams, ...]:
    """A prompt's ``n`` samples: as ``n`` of one request (seeds one apart) or each with settings of its own.

    Samples that share the prompt's blocks mostly carry penalties: a copy on write moves the prompt's
    last tokens to another block, and only the repetition penalty reads a prompt's tokens back.
    """
    penalised = 0.9 if shared else 0.5
    first = _sampling(chance, penalised)
    if chance.random() < 0.5:
        assert first.seed is not None
        return tuple(first.replace(seed=(first.seed + i) % SEED_LIMIT) for i in range(n))
    return (first, *(_sampling(chance, penalised) for _ in range(n - 1)))


def _burst(chance: random.Random, num_kv_blocks: int, longest: int) -> list[int]:
    """Lengths of prompts that arrive together and take every block of the pool; the last one's samples share it.

    The last prompt's samples share all but its last token, a block they both write into: the first
    sample's first decode step needs a copy of it and finds the pool empty, so a sample is preempted
    (maybe the very one that shared the block, which is then the first's alone).
    """
    lengths: list[int] = []
    free = num_kv_blocks - 1
    while free * BLOCK_SIZE - 2 > longest and len(lengths) < 6:
        lengths.append(chance.randint(1, min(longest, (free - 1) * BLOCK_SIZE)))
        free -= -(-lengths[-1] // BLOCK_SIZE)
    last = free * BLOCK_SIZE - chance.randint(1, 2)  # ends 1 or 2 tokens short of a block
    lengths.append(last if last <= longest else min(last - 1, longest))
    return lengths


def make_workload(seed: int) -> Workload:
    """The workload of ``seed``: the same seed, the same configuration and requests."""
    chance = random.Random(seed)
    max_model_len, num_kv_blocks = chance.choices(list(POOLS), weights=list(POOLS.values()))[0]
    config = Config(prefix_caching=bool(seed & 1), chunked_prefill=bool(seed & 2), async_handoff=bool(seed & 4),
                    max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
                    max_num_batched_tokens=chance.choice([8, 16, 32]), max_num_seqs=chance.choice([4, 64, 64]))
    longest = min(40, max_model_len - MAX_TOKENS)  # any request of any prompt fits in max_model_len

    def tokens(count: int) -> list[int]:
        return [chance.choice(VOCAB) for _ in range(count)]

    stems = [tokens(BLOCK_SIZE * chance.randint(1, longest // BLOCK_SIZE)) for _ in range(chance.randint(1, 2))]
    burst = _burst(chance, num_kv_blocks, longest) if num_kv_blocks and chance.random() < 0.75 else []
    groups: list[Group] = []
    for g in range(max(len(burst), chance.randint(3, 8))):
        kind = chance.random()
        if g < len(burst):
            prompt = tokens(burst[g])
        elif groups and kind < 0.15:  # the whole prompt again
            prompt = list(chance.choice(groups).prompt)
        elif kind < 0.55:  # whole blocks in common with others, then its own tokens (maybe none)
            stem = chance.choice(stems)
            prompt = stem + tokens(chance.randint(0, longest - len(stem)))
        elif kind < 0.8:  # within two blocks: a copy on write of its samples' shared block moves most of it
            prompt = tokens(chance.randint(1, min(longest, 2 * BLOCK_SIZE - 1)))
        else:
            prompt = tokens(chance.randint(1, longest))
        burst_end = g == len(burst) - 1
        n = chance.choice([2, 3]) if burst_end else chance.choice([1, 2, 2, 3])
        shared = n > 1 and (burst_end or chance.random() < 0.85)
        arrival = 0 if g < len(burst) or chance.random() < 0.6 else chance.randint(1, 12)
        groups.append(Group(tuple(prompt), _samplings(chance, n, shared), shared, arrival))
    return Workload(seed, config, tuple(groups))


# ---------------------------------------------------------------------------------- running
@dataclass
class Coverage:
    """What the workloads ran and what they made the engine do."""

    workloads: int = 0
    requests: int = 0
    tokens: int = 0
    preemptions: int = 0
    forks: int = 0
    cached_tokens: int = 0
    configs: set[Config] = field(default_factory=set)

    def __str__(self) -> str:
        return (f"{self.workloads} workloads on {len(self.configs)} configurations: {self.requests} requests, "
                f"{self.tokens} tokens; {self.preemptions} preemptions, {self.forks} prompts shared by their "
                f"samples, {self.cached_tokens} prompt tokens found in the prefix cache")


class Engines:
    """One engine per configuration, reused by the workloads that draw it; an engine that failed is replaced."""

    def __init__(self) -> None:
        self._engines: dict[Config, Engine] = {}

    def get(self, config: Config) -> Engine:
        if config not in self._engines:
            self._engines[config] = Engine.from_overrides(config.overrides)
        return self._engines[config]

    def discard(self, config: Config) -> None:
        engine = self._engines.pop(config, None)
        if engine is not None:
            engine.close()

    def close(self) -> None:
        for config in list(self._engines):
            self.discard(config)


_REFERENCE: dict[tuple[tuple[int, ...], SamplingParams], list[int]] = {}  # logit_bias: compared, not hashed
_WEIGHTS: list[ModelWeights] = []


def reference(prompt: tuple[int, ...], sampling: SamplingParams) -> list[int]:
    """The plain reference's tokens, once per prompt and settings (every configuration runs the same model)."""
    if not _WEIGHTS:
        _WEIGHTS.append(seeded_weights([]))
    key = (prompt, sampling)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_sampled(_WEIGHTS[0], prompt, sampling)
    return _REFERENCE[key]


def run(engine: Engine, workload: Workload) -> dict[str, RequestOutput]:
    """Every request of the workload, each group added once the engine has taken its arrival's steps."""
    waiting = sorted(range(len(workload.groups)), key=lambda g: workload.groups[g].arrival)
    outputs: dict[str, RequestOutput] = {}
    for step in range(MAX_STEPS):
        while waiting and (workload.groups[waiting[0]].arrival <= step or not engine.has_unfinished):
            index = waiting.pop(0)
            group = workload.groups[index]
            ids = [workload.request_id(index, i) for i in range(len(group.samplings))]
            if group.shared:
                engine.add_requests_sharing_prompt(list(group.prompt), group.samplings, ids)
            else:
                for request_id, sampling in zip(ids, group.samplings, strict=True):
                    engine.add_request(list(group.prompt), sampling, request_id)
        if not engine.has_unfinished:
            outputs.update((output.request_id, output) for output in engine.take_finished())
            return outputs
        for output in engine.step():
            outputs[output.request_id] = output
    raise AssertionError(f"the workload did not finish in {MAX_STEPS} steps")


def first_mismatch(workload: Workload, outputs: dict[str, RequestOutput]) -> str | None:
    """The first request that did not finish by length with the reference's tokens, described; None: none."""
    for g, group in enumerate(workload.groups):
        for i, sampling in enumerate(group.samplings):
            request_id = workload.request_id(g, i)
            expected = reference(group.prompt, sampling)
            stopped = expected[-1] in sampling.stop_token_ids and len(expected) > sampling.min_tokens
            output = outputs.get(request_id)
            got = None if output is None else (output.finish_reason, output.error, output.output_token_ids)
            if got != ("stop" if stopped else "length", None, expected):
                where = "" if output is None else next(
                    (f" (first difference at output {k})" for k, (a, b) in
                     enumerate(zip(output.output_token_ids, expected, strict=False)) if a != b), "")
                shared = f"one of {len(group.samplings)} sharing the prompt" if group.shared else "added alone"
                return (f"request {request_id} ({shared}, arrival step {group.arrival}), prompt of "
                        f"{len(group.prompt)} {list(group.prompt)}, {sampling}:\n"
                        f"  engine (finish_reason, error, tokens): {got}\n"
                        f"  reference tokens:                       {expected}{where}")
    return None


def attempt(engine: Engine, workload: Workload) -> tuple[str | None, dict[str, RequestOutput]]:
    """Run ``workload`` on ``engine``: what went wrong (None: nothing), and the outputs it got."""
    outputs: dict[str, RequestOutput] = {}
    try:
        outputs = run(engine, workload)
        problem = first_mismatch(workload, outputs)
        blocks = engine.scheduler.blocks
        if problem is None and (blocks.num_free_blocks != blocks.num_blocks - 1 or any(blocks.ref_counts)):
            problem = (f"every request finished, but {blocks.num_blocks - 1 - blocks.num_free_blocks} KV blocks "
                       f"are still held (reference counts {[c for c in blocks.ref_counts if c]})")
    except Exception as error:  # noqa: BLE001 - an engine stop is a finding like any other: reported by the caller
        problem = f"the engine raised {type(error).__name__}: {error}"
    return problem, outputs


def check(engines: Engines, seed: int, coverage: Coverage) -> str | None:
    """Run workload ``seed``; a description of what went wrong (seed, configuration, request), or None.

    A workload that fails runs again on a fresh engine of its configuration, and the description says
    whether it fails there too: where it does not, what earlier workloads left in the engine took part.
    """
    workload = make_workload(seed)
    config = workload.config
    engine = engines.get(config)
    scheduler = engine.scheduler
    before = (scheduler.num_preemptions, scheduler.num_forked, scheduler.blocks.stats.hit_tokens)
    problem, outputs = attempt(engine, workload)
    coverage.workloads += 1
    coverage.configs.add(config)
    coverage.requests += sum(len(g.samplings) for g in workload.groups)
    coverage.tokens += sum(len(output.output_token_ids) for output in outputs.values())
    coverage.preemptions += scheduler.num_preemptions - before[0]
    coverage.forks += scheduler.num_forked - before[1]
    coverage.cached_tokens += scheduler.blocks.stats.hit_tokens - before[2]
    if problem is None:
        return None
    engines.discard(config)  # whatever state it was left in, no later workload inherits it
    again, _ = attempt(engines.get(config), workload)
    if again is not None:
        engines.discard(config)
    alone = ("on a fresh engine it fails too" if again is not None else
             "on a fresh engine it passes (what earlier workloads left in the engine, or async timing, took part)")
    return (f"workload seed {seed} ({len(workload.groups)} prompts, "
            f"{sum(len(g.samplings) for g in workload.groups)} requests), configuration {config.overrides}; "
            f"{alone}:\n{problem}")


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    pool = Engines()
    yield pool
    pool.close()


# ------------------------------------------------------------------------------------- tests
def test_a_seed_makes_the_same_workload() -> None:
    assert make_workload(3) == make_workload(3)
    assert make_workload(3) != make_workload(4)
    for seed in [*SHORT_SEEDS, *range(LONG_FIRST_SEED, LONG_FIRST_SEED + 300)]:
        workload = make_workload(seed)
        assert 3 <= len(workload.groups) <= 8
        for group in workload.groups:
            assert 1 <= len(group.prompt) <= 40 and all(t in VOCAB for t in group.prompt)
            assert all(s.seed is not None and s.ignore_eos for s in group.samplings)
            assert len(group.prompt) + max(s.max_tokens or 0 for s in group.samplings) <= workload.config.max_model_len
            assert all(s.max_tokens for s in group.samplings), "every drawn request asks a length"


@pytest.mark.slow
@pytest.mark.parametrize("seed", SHORT_SEEDS)
def test_random_workloads_get_the_reference_tokens(engines: Engines, seed: int) -> None:
    problem = check(engines, seed, Coverage())
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.mark.long
def test_many_random_workloads_get_the_reference_tokens(engines: Engines) -> None:
    coverage, problems = Coverage(), dict[int, str]()
    began = time.perf_counter()
    for seed in range(LONG_FIRST_SEED, LONG_FIRST_SEED + LONG_WORKLOADS):
        problem = check(engines, seed, coverage)
        if problem is not None:
            problems[seed] = problem
    print(f"\n{coverage}; {len(problems)} failed; {time.perf_counter() - began:.0f} s")
    if problems:
        pytest.fail(f"{len(problems)} of {coverage.workloads} workloads failed (seeds {sorted(problems)}); "
                    f"the first:\n{next(iter(problems.values()))}", pytrace=False)

"""The sampler written out a second time, for the tests: logit bias, min_tokens, penalties, greedy, temperature,
min-p, top-k, top-p, noise.

The engine's sampler (``corelib/ops/sampling.py``) works on batches of rows, sorts, masks and
draws its noise from a vectorised hash on the device. A test that compared the engine with a
reference built on those same functions would agree with any mistake in them, so nothing here
comes from there: each rule is written from its definition, one token at a time, in plain
Python or plain torch, and the noise hash is recomputed on unsigned Python integers.

The definitions (vLLM's, which the engine follows):

- first each ``logit_bias`` entry is added to its token's logit; then, while the request has fewer
  outputs than ``min_tokens``, its stop ids (its ``stop_token_ids``, and EOS unless ``ignore_eos``)
  are set to -inf;
- penalties, in this order: repetition (a token seen in the prompt or the output has its logit
  divided by the penalty when positive, multiplied by it otherwise), frequency (minus the penalty
  times the token's count in the output), presence (minus the penalty when the token is in the
  output at all);
- temperature 0: the argmax of the penalised logits;
- otherwise the penalised logits divided by the temperature, cut to the tokens whose probability is
  at least ``min_p`` times the likeliest one's (0: no cut), to the ``top_k`` largest (0: no cut),
  then to the tokens whose probability mass ranked strictly above them, renormalised over what
  min-p and top-k left, is below ``top_p`` (1: no cut); tokens of equal logits rank by id, the lowest
  first; among those, the token whose scaled logit plus its Gumbel noise is largest, the lowest id of
  equal ones (the Gumbel-max trick: a draw from the softmax of what is left);
- the noise of token ``t`` when sampling position ``p`` (the number of tokens before it) of a
  request seeded ``s`` is a function of (s, p, t) alone: splitmix64's finaliser twice, with its
  right shifts arithmetic (sign-filling, as int64 shifts are), 23 bits of the result as a uniform
  in (0, 1) (bits + 1/2 over 2**23, exact in float32: neither end is reached), and -log(-log(u)).

The arithmetic a token's choice depends on (the penalised and scaled logits, the noise and their
sum) is done in float32, as the engine does it, so that the two agree to the bit wherever the
logits do; the cuts' probabilities are computed in float64, where no rounding decides them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from corelib.engine import SamplingParams

MASK64 = (1 << 64) - 1
SIGN64 = 1 << 63
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
MIX1 = 0xBF58476D1CE4E5B9  # splitmix64's finaliser multipliers
MIX2 = 0x94D049BB133111EB
POSITION_KEY = 0x632BE59BD9B4E019  # spreads the seed before the position is added
UNIFORM_BITS = 23  # the uniform's bits, taken from bit 40 up
UNIFORM_SHIFT = 40
MIN_TEMPERATURE = 1e-5  # the engine divides by at least this: the kit leaves the temperatures below alone


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings, as plain values (vLLM's meanings; top_k 0 or -1: no cut).

    ``seed`` keys the noise; a sampled (temperature > 0) request needs one, or nothing would be
    reproducible. Greedy requests never read it.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    stop_ids: tuple[int, ...] = ()  # what min_tokens bans: the request's stop ids, EOS among them unless ignored

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < -1 or self.repetition_penalty <= 0:
            raise ValueError(f"not a valid setting: {self}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature}: below {MIN_TEMPERATURE}, the engine's floor, "
                             "the kit does not follow it")
        if self.temperature > 0 and self.seed is None:
            raise ValueError("a sampled request needs an explicit seed: a random one could not be reproduced")

    @classmethod
    def of(cls, params: SamplingParams, eos: Sequence[int] = ()) -> Sampling:
        """The settings of an engine request (its values only: nothing of how the engine reads them); ``eos``:
        the model's EOS ids."""
        return cls(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                   repetition_penalty=params.repetition_penalty, frequency_penalty=params.frequency_penalty,
                   presence_penalty=params.presence_penalty, min_p=params.min_p, min_tokens=params.min_tokens,
                   logit_bias=tuple((params.logit_bias or {}).items()),
                   stop_ids=tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos)))


# ------------------------------------------------------------------------------------ noise
def arithmetic_shift(x: int, bits: int) -> int:
    """``x`` (64 bits, unsigned) shifted right by ``bits`` as a signed int64 shifts: the sign bit fills in."""
    shifted = x >> bits
    if x & SIGN64:
        shifted |= (MASK64 << (64 - bits)) & MASK64
    return shifted


def mix64(x: int) -> int:
    """splitmix64's finaliser on 64 bits (unsigned in, unsigned out), with arithmetic right shifts."""
    x = (x + GOLDEN) & MASK64
    x = ((x ^ arithmetic_shift(x, 30)) * MIX1) & MASK64
    x = ((x ^ arithmetic_shift(x, 27)) * MIX2) & MASK64
    return x ^ arithmetic_shift(x, 31)


def noise_bits(seed: int, position: int, token: int) -> int:
    """The 23 uniform bits of token ``token`` at position ``position`` of a request seeded ``seed``."""
    key = mix64((seed * POSITION_KEY + position) & MASK64)
    return (mix64(key ^ token) >> UNIFORM_SHIFT) & ((1 << UNIFORM_BITS) - 1)


def gumbel(seed: int, position: int, tokens: Sequence[int]) -> torch.Tensor:
    """Gumbel(0, 1) noise of each of ``tokens``, float32 [len(tokens)]: u = (bits + 1/2) / 2**23, -log(-log u)."""
    bits = torch.tensor([noise_bits(seed, position, t) for t in tokens], dtype=torch.float32)
    uniform = (bits + 0.5) / float(1 << UNIFORM_BITS)  # exact in float32, below 1
    return -torch.log(-torch.log(uniform))


# -------------------------------------------------------------------------------- penalties
def biased(logits: torch.Tensor, output: Sequence[int], sampling: Sampling) -> torch.Tensor:
    """The logits [V] with each logit_bias entry added, then the stop ids at -inf while the output is shorter than
    min_tokens; float32, a new tensor."""
    out = logits.to(torch.float32).clone()
    for token, bias in sampling.logit_bias:
        out[token] = out[token] + torch.tensor(bias, dtype=torch.float32)
    if len(output) < sampling.min_tokens:
        for token in sampling.stop_ids:
            out[token] = float("-inf")
    return out


def penalised(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], sampling: Sampling) -> torch.Tensor:
    """The logits [V] after the repetition, then frequency, then presence penalty, float32, a new tensor."""
    out = logits.to(torch.float32).clone()
    counts = Counter(output)
    repetition = torch.tensor(sampling.repetition_penalty, dtype=torch.float32)
    frequency = torch.tensor(sampling.frequency_penalty, dtype=torch.float32)
    presence = torch.tensor(sampling.presence_penalty, dtype=torch.float32)
    for token in set(prompt) | set(counts):  # seen: in the prompt or in the output
        value = out[token]
        out[token] = value / repetition if value > 0 else value * repetition
    for token, count in counts.items():  # in the output only
        out[token] = out[token] - frequency * float(count)
        out[token] = out[token] - presence
    return out


# ---------------------------------------------------------------------------------- the cuts
def candidates(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> list[int]:
    """The tokens a sampled request may draw from its scaled logits [V], most likely first."""
    values = scaled.tolist()
    ranked = sorted(range(len(values)), key=lambda t: values[t], reverse=True)
    if min_p > 0:  # p / p_max = exp(scaled - the largest scaled), in float64
        ranked = [t for t in ranked if math.exp(values[t] - values[ranked[0]]) >= min_p]
    if top_k > 0:
        ranked = ranked[:top_k]
    if top_p >= 1:
        return ranked
    top = values[ranked[0]]
    weights = [math.exp(values[t] - top) for t in ranked]  # the softmax over what top-k left, in float64
    total = math.fsum(weights)
    kept, above = [], 0.0
    for token, weight in zip(ranked, weights, strict=True):
        if above >= top_p:
            break
        kept.append(token)
        above += weight / total
    return kept


# ------------------------------------------------------------------------------------ sample
def sample(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], sampling: Sampling) -> int:
    """The next token of a request whose prompt is ``prompt`` and which has sampled ``output`` so far.

    ``logits`` [V]: the model's logits for the next token. Its position, the counter of the noise,
    is the number of tokens before it: ``len(prompt) + len(output)``.
    """
    logits = penalised(biased(logits, output, sampling), prompt, output, sampling)
    if sampling.temperature == 0:
        return int(torch.argmax(logits))  # the first of equal maxima
    assert sampling.seed is not None  # checked when the settings were made
    scaled = logits / torch.tensor(sampling.temperature, dtype=torch.float32)
    kept = candidates(scaled, sampling.top_k, sampling.top_p, sampling.min_p)
    kept = sorted(kept)  # equal scores: the lowest id
    scores = scaled[kept] + gumbel(sampling.seed, len(prompt) + len(output), kept)
    return kept[int(torch.argmax(scores))]

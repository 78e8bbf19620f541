"""Sampling on the device: logit bias, min_tokens, penalties, greedy, temperature, min-p, top-k and top-p,
seeded per request.

No host sync: randomness is a counter-based hash of (request seed, position, token id),
so a request samples the same tokens whatever batch it shares, on any device, and the
whole sampler can be captured in a graph.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from corelib.ops.spec import SAMPLING_COLUMNS, SamplingInputs, TokenHistory

#: the penalties' sampling columns and their neutral values: a row with all three neutral has its logits left exactly
#: as they were whatever its counts hold, so the runner keeps counts only for rows where one is not
PENALTY_NEUTRAL: dict[str, float] = {c.name: c.neutral for c in SAMPLING_COLUMNS
                                     if c.name in ("presence_penalty", "frequency_penalty", "repetition_penalty")}
#: the cuts' sampling columns and their neutral values: a step where no row holds another draws without sorting
CUT_NEUTRAL: dict[str, float] = {c.name: c.neutral for c in SAMPLING_COLUMNS if c.name in ("top_k", "top_p", "min_p")}


def _int64(constant: int) -> int:
    """A 64-bit constant as the signed value torch's int64 arithmetic wraps around."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
_POSITION_KEY = _int64(0x632BE59BD9B4E019)
#: the noise hash's constants (golden, mix 1, mix 2, position key), for a kernel that computes the same noise
NOISE_CONSTANTS = (_GOLDEN, _MIX1, _MIX2, _POSITION_KEY)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    # splitmix64 finaliser on int64 (wrapping arithmetic; shifts are arithmetic, still a bijection mix)
    x = x + _GOLDEN
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, K] for the given token ids [B, K] (or [1, K], the same for every row); seeds and
    positions are [B]."""
    key = _mix64(seeds * _POSITION_KEY + positions)  # [B]
    return -torch.log(-torch.log(uniform_of(_mix64(key[:, None] ^ token_ids))))  # [B, K]


def uniform_of(bits: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1), both ends excluded, from the hash's int64 bits: the 23 bits 40-62 (the mix's last step,
    x ^ (x >> 31), shifts arithmetically, so bit 63 always ends 0), plus a half, over 2**23: exact in float32.
    (24 bits plus a half round the largest to 1.0, whose noise is infinite: one token in 2**24 would win.)"""
    return (((bits >> 40) & 0x7FFFFF).to(torch.float32) + 0.5) / 8388608.0


def apply_token_bias(logits: torch.Tensor, sampling: SamplingInputs) -> torch.Tensor:
    """logit_bias added, then min_tokens' ban on the stop ids (vLLM applies both before the penalties);
    logits [B, V] float32 -> a new [B, V], or ``logits`` itself with no table."""
    if sampling.stop_ids is None and (sampling.bias_ids is None or sampling.bias_values is None):
        return logits
    logits = logits.clone()
    add_token_bias_(logits, sampling)
    return logits


def add_token_bias_(logits: torch.Tensor, sampling: SamplingInputs) -> None:
    """:func:`apply_token_bias` in place.

    A row's stop ids are banned (-inf) while it has fewer outputs (positions - prompt_lens) than
    min_tokens. Padded entries add 0 to token 0: exactly nothing, so neutral rows keep their logits.
    """
    if sampling.bias_ids is not None and sampling.bias_values is not None:
        logits.scatter_add_(1, sampling.bias_ids, sampling.bias_values)
    stop_ids = sampling.stop_ids
    if stop_ids is not None:
        outputs = sampling.positions if sampling.prompt_lens is None else sampling.positions - sampling.prompt_lens
        banned = (outputs < sampling.min_tokens)[:, None] & (stop_ids >= 0)
        logits.scatter_add_(1, stop_ids.clamp_min(0), torch.where(banned, float("-inf"), 0.0).to(logits.dtype))


def apply_penalties(logits: torch.Tensor, sampling: SamplingInputs) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (vLLM's order); logits [B, V] float32 -> a new [B, V].

    A token counts as seen when it is in the prompt or was sampled; frequency and presence count
    sampled tokens only. Neutral values (1, 0, 0) leave a row's logits exactly as they were.
    """
    history: TokenHistory | None = sampling.history
    if history is None:
        return logits
    sampled = history.output_counts[history.states].to(logits.dtype)  # [B, V]
    seen = (sampled > 0) | (history.prompt_counts[history.states] > 0)
    repetition = sampling.repetition_penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - sampling.frequency_penalty[:, None] * sampled
    return logits - sampling.presence_penalty[:, None] * (sampled > 0).to(logits.dtype)


def processed_logits(logits: torch.Tensor, sampling: SamplingInputs) -> torch.Tensor:
    """What the sampler draws from, before the temperature: logit_bias and min_tokens' ban, then the penalties."""
    return apply_penalties(apply_token_bias(logits, sampling), sampling)


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, V] / each row's temperature [B] (at least 1e-5), what a drawing row's cuts and noise are added to."""
    return logits / temperature.clamp_min(1e-5)[:, None]


def cut_thresholds(scaled: torch.Tensor, sampling: SamplingInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's cuts end: (value [B] float32, token id [B] int64) of the last token it keeps.

    The cuts keep a prefix of the row's tokens ranked by scaled logit, ties by token id (a stable sort): top-k,
    then min_p (exp(scaled - the largest) >= min_p, as vLLM), then top-p over what is left, renormalised: a
    token stays while the mass ranked above it is below top_p; top_p 1 cuts nothing. So a token is kept where
    its scaled logit is above the value, or equal to it with an id no larger: no [B, V] mask leaves the sort.
    """
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    top_k, top_p = sampling.top_k, sampling.top_p
    keep = ranks < torch.where(top_k > 0, top_k.clamp_max(vocab), vocab)[:, None]
    keep = keep & ((sorted_logits - sorted_logits[:, :1]).exp() >= sampling.min_p[:, None])
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
    keep = keep & ((before < top_p[:, None]) | (top_p >= 1.0)[:, None])
    last = (keep.sum(dim=-1, keepdim=True) - 1).clamp_min(0)  # the rank of the last kept token (the top at least)
    return sorted_logits.gather(-1, last)[:, 0], order.gather(-1, last)[:, 0]


def sample_rows(logits: torch.Tensor, sampling: SamplingInputs) -> torch.Tensor:
    """Per-row sampling; rows with temperature 0 are greedy. logits [B, V] float32 -> [B] int64.

    ``sampling.draws`` False (no row has a temperature above 0): every row's argmax of its processed logits,
    exactly what the draw gives a greedy row, without the draw's noise over the vocabulary.
    A drawing row takes the argmax of its scaled logits plus Gumbel noise over the tokens its cuts keep
    (:func:`cut_thresholds`), ties to the lowest token id. ``sampling.cuts`` False (no row has top-k, top-p
    below 1 or min_p): nothing is cut and nothing is sorted; a row without cuts gets the same token either way.
    """
    logits = processed_logits(logits, sampling)
    if not sampling.draws:
        return logits.argmax(dim=-1)
    temperature = sampling.temperature
    scaled = scaled_logits(logits, temperature)
    ids = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    noisy = scaled + gumbel_noise(sampling.seeds, sampling.positions, ids)
    if sampling.cuts:
        value, last = cut_thresholds(scaled, sampling)
        keep = (scaled > value[:, None]) | ((scaled == value[:, None]) & (ids <= last[:, None]))
        noisy = noisy.masked_fill(~keep, float("-inf"))
    return torch.where(temperature > 0, noisy.argmax(dim=-1), logits.argmax(dim=-1))


def penalized(columns: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[B] bool: the rows some penalty applies to, from their sampling columns [B] (a step's views); graph-safe."""
    flags = [columns[name] != neutral for name, neutral in PENALTY_NEUTRAL.items()]
    return flags[0] | flags[1] | flags[2]


def count_fed_tokens(history: TokenHistory, tokens: torch.Tensor, positions: torch.Tensor, prompt_lens: torch.Tensor,
                     counted: torch.Tensor) -> None:
    """Add the tokens a step feeds to their sequences' counts, on the device: O(tokens), graph-safe.

    One entry per fed token [T]: ``tokens`` its id, ``history.states`` its row's state index,
    ``positions`` its position and ``prompt_lens`` its row's prompt length (earlier positions are the
    prompt's, later ones outputs), ``counted`` False where it adds nothing (a row without penalties,
    a padded token). With the counts of the tokens a sequence held before its first step
    (:func:`count_history`), a row's counts at a sampled step are those of every position before the
    one it samples, exactly what :func:`count_history` over its whole context gives.
    """
    vocab = history.output_counts.shape[1]
    flat = history.states * vocab + tokens
    is_prompt = positions < prompt_lens
    dtype = history.output_counts.dtype
    history.prompt_counts.view(-1).scatter_add_(0, flat, (counted & is_prompt).to(dtype))
    history.output_counts.view(-1).scatter_add_(0, flat, (counted & ~is_prompt).to(dtype))


def count_history(
    history: TokenHistory, slot_tokens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    seq_lens: torch.Tensor, prompt_lens: torch.Tensor,
) -> None:
    """Count each row's tokens so far into ``history``, on the device: its rows ``history.states`` [B] are set to
    the counts of the row's first ``seq_lens`` tokens, the other rows are left as they are.

    slot_tokens [S]: the token fed at each KV slot; block_tables [B, W]; seq_lens [B]: the row's tokens
    (the one fed this step included); prompt_lens [B]: positions before it are the prompt's, later ones
    outputs. A row reads its own blocks, so a prefix taken from the cache, blocks shared with another
    sample of the prompt and a sequence recomputed after preemption all count what they hold. Graph-safe.
    O(B x (vocab + context)): the runner calls it once per sequence given a state index, for the tokens it
    holds before its first step; :func:`count_fed_tokens` adds the rest as they are fed.
    """
    rows, width = block_tables.shape
    slots = (block_tables.to(torch.int64)[:, :, None] * block_size
             + torch.arange(block_size, device=block_tables.device)).reshape(rows, width * block_size)
    position = torch.arange(width * block_size, device=block_tables.device)[None, :]
    held = position < seq_lens[:, None]
    # Columns past a row's blocks may hold anything (a graph reads the bucket's whole width): never index by them.
    tokens = slot_tokens[torch.where(held, slots, 0)]  # [B, W * block_size]
    is_prompt = position < prompt_lens[:, None]
    vocab = history.output_counts.shape[1]
    flat = (history.states[:, None] * vocab + tokens).reshape(-1)
    counts_dtype = history.output_counts.dtype
    history.output_counts.index_fill_(0, history.states, 0)
    history.prompt_counts.index_fill_(0, history.states, 0)
    history.prompt_counts.view(-1).scatter_add_(0, flat, (held & is_prompt).reshape(-1).to(counts_dtype))
    history.output_counts.view(-1).scatter_add_(0, flat, (held & ~is_prompt).reshape(-1).to(counts_dtype))

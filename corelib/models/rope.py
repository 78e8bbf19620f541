"""RoPE frequencies, plain or scaled the way Hugging Face configs describe it.

A checkpoint's ``rope_scaling`` (``rope_parameters`` since transformers 5) names a
``rope_type`` and its parameters. The types here give the same inverse frequencies and
attention factor as transformers' ``ROPE_INIT_FUNCTIONS``; the others are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from corelib.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """One ``rope_scaling`` entry, validated (``original_max_position_embeddings`` is 0 only for linear)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: derived from factor and mscale
    mscale: float = 0.0  # yarn
    mscale_all_dim: float = 0.0  # yarn
    truncate: bool = True  # yarn

    @classmethod
    def parse(cls, entry: Mapping[str, Any], max_model_len: int,
              where: str = "model.rope_scaling") -> RopeScaling | None:
        """None for plain RoPE; a ConfigError naming ``where``'s key that is wrong (see :meth:`from_entry`)."""
        scaling = cls.from_entry(entry, where)
        if scaling is None or scaling.rope_type != "dynamic":
            return scaling
        original = scaling.original_max_position_embeddings
        if max_model_len > original:
            # Dynamic NTK re-derives the frequencies from the longest sequence in the batch once it
            # passes the original length; a fixed table cannot do that, and below it RoPE is plain.
            raise ConfigError(
                f"{where}.rope_type=dynamic rescales past {original} positions, which a fixed RoPE "
                f"table cannot follow; set model.max_model_len<={original} (it is {max_model_len})"
            )
        return scaling

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], where: str = "model.rope_scaling") -> RopeScaling | None:
        """The entry's values checked on their own, each error one line naming ``where.KEY=VALUE``.

        ``where`` is ``model.rope_scaling`` for the command line, or a checkpoint's
        ``.../config.json: rope_scaling``. Beyond types and finiteness, each value is kept where
        the formulas stay finite: a zero llama3 frequency factor or yarn beta divided by zero,
        and a huge yarn attention factor or mscale made every logit infinite.
        """
        if not entry:
            return None
        type_key = "type" if "type" in entry and "rope_type" not in entry else "rope_type"
        rope_type = str(entry.get(type_key, "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"{where}.{type_key}={rope_type}: not supported; supported: {', '.join(ROPE_TYPES)}")
        if rope_type == "default":
            return None
        for key, value in entry.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where}.{key}={value!r}: must be a finite number")

        def refuse(key: str, why: str) -> ConfigError:
            shown = repr(entry.get(key))  # cut: a JSON integer can have thousands of digits
            return ConfigError(f"{where}.{key}={shown if len(shown) <= 40 else shown[:40] + '...'}: {why}")

        original = entry.get("original_max_position_embeddings") or 0
        if not isinstance(original, int) or isinstance(original, bool):
            raise refuse("original_max_position_embeddings", "expected an integer")
        if original <= 0 and rope_type != "linear":
            raise refuse("original_max_position_embeddings", f"rope_type={rope_type} needs a positive integer")
        if original > MAX_ORIGINAL_POSITIONS:
            raise refuse("original_max_position_embeddings", f"must be at most {MAX_ORIGINAL_POSITIONS}")
        factor = entry.get("factor")
        if not _number(factor) or not 1 <= factor <= MAX_FACTOR:
            raise refuse("factor", f"rope_type={rope_type} needs a factor in [1, {MAX_FACTOR:g}]")
        optional: dict[str, Any] = {}
        for key in _OPTIONAL_FLOATS:
            value = entry.get(key)
            if value is None:
                continue
            if not _number(value):
                raise refuse(key, "must be a finite number")
            optional[key] = float(value)
        truncate = entry.get("truncate", True)
        if not isinstance(truncate, bool):
            raise refuse("truncate", "expected true or false")
        scaling = cls(rope_type, float(factor), original, truncate=truncate, **optional)
        scaling._check_domain(refuse)
        return scaling

    def _check_domain(self, refuse: Callable[[str, str], ConfigError]) -> None:
        """The values this rope_type computes with, where its formulas stay finite and meaningful."""
        if self.rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor"):
                if not getattr(self, key) > 0:
                    raise refuse(key, "must be > 0 (the original length is divided by it)")
            if not self.high_freq_factor > self.low_freq_factor:
                raise refuse("high_freq_factor", f"must be greater than low_freq_factor={self.low_freq_factor:g} "
                                                 "(the blend between them divides by their difference)")
        if self.rope_type != "yarn":
            return
        for key in ("beta_fast", "beta_slow"):
            if not getattr(self, key) > 0:
                raise refuse(key, "must be > 0 (its logarithm is taken)")
        if self.attention_factor is not None and not 0 < self.attention_factor <= MAX_ATTENTION_FACTOR:
            raise refuse("attention_factor", f"must be in (0, {MAX_ATTENTION_FACTOR:g}]")
        for key in ("mscale", "mscale_all_dim"):
            if not 0 <= getattr(self, key) <= MAX_ATTENTION_FACTOR:
                raise refuse(key, f"must be in [0, {MAX_ATTENTION_FACTOR:g}]")


MAX_FACTOR = 1e4  # a context stretched ten thousand times; 1e308 would leave RoPE no rotation at all
MAX_ORIGINAL_POSITIONS = 2**31  # far beyond any model's context; 10**400 overflowed the float formulas
# cos and sin are multiplied by yarn's attention factor, so every attention score by its square. Its
# own formula, 0.1 * mscale * ln(factor) + 1, stays under 2 for mscale 1 and any factor allowed here;
# 10 (for it and for mscale) is far beyond any checkpoint, and a score 100 times larger stays finite.
MAX_ATTENTION_FACTOR = 10.0
_OPTIONAL_FLOATS = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
                    "mscale_all_dim")


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float64) and the factor cos/sin are multiplied by."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    plain = 1.0 / theta**exponents
    if scaling is None or scaling.rope_type == "dynamic":
        return plain, 1.0
    if scaling.rope_type == "linear":
        return plain / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(plain, scaling), 1.0
    return _yarn(plain, head_dim, theta, scaling)


def _llama3(plain: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by factor, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / plain
    scaled = torch.where(wavelen > low_wavelen, plain / s.factor, plain)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(plain: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    else:
        attention = mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency, unchanged), 0: interpolate (divided by factor)
    return plain / s.factor * (1 - keep) + plain * keep, attention

"""Rotary position embedding (RoPE) with the scaling variants Llama-family checkpoints use.

The inverse frequencies are fixed at construction; cos/sin are computed once per
forward from the flattened positions (so one step can mix requests at any
position) and shared by every layer. The arithmetic follows transformers'
`LlamaRotaryEmbedding` (fp32 angles, then cast to the activation dtype), so fp32
results match it to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Re-exported: the scalings and their normal form live in the torch-free config module.
from pagoda.model.rope_scaling import SUPPORTED_ROPE_TYPES, normalize_rope_scaling  # noqa: F401


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None,
                     max_position_embeddings: int, max_model_len: int | None = None
                     ) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32 for the given scaling (see module doc)."""
    return rope_frequencies(head_dim, rope_theta, rope_scaling, max_position_embeddings,
                            max_model_len)[0]


def rope_frequencies(rotary_dim: int, rope_theta: float, rope_scaling: dict | None,
                     max_position_embeddings: int, max_model_len: int | None = None
                     ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] in fp32, attention factor).

    The attention factor multiplies cos and sin (transformers' `attention_scaling`):
    1.0 except for yarn and longrope. Follows transformers' `ROPE_INIT_FUNCTIONS`.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    scaling = normalize_rope_scaling(rope_scaling)
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "yarn":
        return _yarn(rotary_dim, rope_theta, scaling, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(exponents, rope_theta, scaling, max_position_embeddings, max_model_len)
    if rope_type == "dynamic":
        # vLLM's choice, not transformers': fix the base for the longest supported
        # length, so keys cached early and queries computed later agree on frequencies.
        factor = scaling["factor"]
        exponent = rotary_dim / (rotary_dim - 2)
        rope_theta = rope_theta * (factor * factor - (factor - 1)) ** exponent
    inv_freq = 1.0 / (rope_theta ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling, max_position_embeddings)
    elif rope_type == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    return inv_freq, 1.0


def _yarn(dim: int, base: float, scaling: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen3, DeepSeek): interpolate the low frequencies by `factor`, keep the high
    ones, ramp between the dimensions that turn `beta_slow` and `beta_fast` times over
    the pretraining length; cos/sin grow by `0.1 ln(factor) + 1`."""
    original = scaling.get("original_max_position_embeddings") or max_pos
    factor = scaling.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all \
            else mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # share of the original (unscaled) frequency
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attention_factor)


def _longrope(exponents: torch.Tensor, base: float, scaling: dict, max_pos: int,
              max_model_len: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency divisors, `long_factor` for long contexts and
    `short_factor` otherwise.

    transformers switches per forward pass (long once a pass sees a position past
    `original_max_position_embeddings`), which mixes frequencies within one sequence.
    We choose once, as vLLM does: long when the engine's context length (else the
    model's) exceeds the pretraining length. Both agree on every sequence that stays
    within the pretraining length under a short context, and on every sequence whose
    prompt already exceeds it under a long one.
    """
    original = scaling.get("original_max_position_embeddings") or max_pos
    factor = scaling.get("factor") or max_pos / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else \
            math.sqrt(1 + math.log(factor) / math.log(original))
    use_long = (max_model_len or max_pos) > original
    ext = torch.tensor(scaling["long_factor" if use_long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** exponents), float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_pos: int) -> torch.Tensor:
    """Llama 3.1: scale low frequencies by `factor`, keep high ones, interpolate between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", max_pos)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds `inv_freq` [rotary_dim // 2] (fp32, not saved in checkpoints) and the
    attention factor that scales cos and sin. `rotary_dim` defaults to `head_dim`;
    a smaller one rotates only the first `rotary_dim` dims of each head (Phi-4-mini)."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None,
                 max_position_embeddings: int, rotary_dim: int | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(
            rotary_dim or head_dim, rope_theta, rope_scaling, max_position_embeddings,
            max_model_len)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed_sin), each [T, rotary_dim] in `dtype`.

        `cos` is HF's cat(cos, cos); `signed_sin` is cat(-sin, sin), which folds the
        negation of HF's rotate_half into the table (see `apply_rotary`). Both are
        scaled by the attention factor in fp32 before the cast, as HF does.
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(dtype), sin.to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, num_heads, head_dim] in the "rotate half" (GPT-NeoX / HF Llama) layout.

    HF computes `x * cos + cat(-x2, x1) * sin`; `cat(x2, x1) * cat(-sin, sin)` gives the
    same products bit for bit (negation is exact), in 4 ops instead of 7. Tables
    narrower than head_dim rotate only the leading dims (HF's partial rotary) and
    copy the rest. Returns a new contiguous tensor.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, signed_sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((x2, x1), dim=-1) * signed_sin[:, None, :]

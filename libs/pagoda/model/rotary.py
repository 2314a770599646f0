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

# rope_type values understood by `compute_inv_freq` (None / "default" is plain RoPE).
# "freq_factors" is GGUF's form of Llama-3 scaling: llama.cpp stores the per-frequency
# divisors as a `rope_freqs.weight` tensor instead of the HF parameters.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "freq_factors")


def normalize_rope_scaling(rope: dict | None) -> dict | None:
    """HF `rope_scaling` / `rope_parameters` -> a dict with `rope_type`, or None for plain RoPE.

    Accepts the old key `type` and drops `rope_theta` (carried separately).
    Raises ValueError for a rope type we do not implement (yarn, longrope, ...),
    rather than silently running the model with wrong positions.
    """
    if not rope:
        return None
    rope = dict(rope)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    rope.pop("rope_theta", None)
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Unsupported rope scaling type {rope_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return {"rope_type": rope_type, **rope}


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None,
                     max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32 for the given scaling (see module doc)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    scaling = normalize_rope_scaling(rope_scaling)
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "dynamic":
        # vLLM's choice, not transformers': fix the base for the longest supported
        # length, so keys cached early and queries computed later agree on frequencies.
        factor = scaling["factor"]
        rope_theta = rope_theta * (factor * factor - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (rope_theta ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling, max_position_embeddings)
    elif rope_type == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    return inv_freq


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
    """Holds `inv_freq` [head_dim // 2] (fp32, not saved in checkpoints)."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None,
                 max_position_embeddings: int) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed_sin), each [T, head_dim] in `dtype`.

        `cos` is HF's cat(cos, cos); `signed_sin` is cat(-sin, sin), which folds the
        negation of HF's rotate_half into the table (see `apply_rotary`).
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, num_heads, head_dim] in the "rotate half" (GPT-NeoX / HF Llama) layout.

    HF computes `x * cos + cat(-x2, x1) * sin`; `cat(x2, x1) * cat(-sin, sin)` gives the
    same products bit for bit (negation is exact), in 4 ops instead of 7. Returns a new
    contiguous tensor.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((x2, x1), dim=-1) * signed_sin[:, None, :]

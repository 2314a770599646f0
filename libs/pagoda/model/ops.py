"""The one switch between the Triton kernels (CUDA) and the torch path (CPU).

Each function takes the arguments of the torch function it stands for, so a model
swaps `from pagoda.model.attention import paged_attention` for
`from pagoda.model.ops import paged_attention` and nothing else changes:

    ops function       torch path (CPU, or CUDA with PAGODA_DISABLE_TRITON=1)
    write_kv_cache     pagoda.model.attention.write_kv_cache
    paged_attention    pagoda.model.attention.paged_attention
    rms_norm           pagoda.model.layers.RMSNorm.forward's math
    rotary_embedding   pagoda.model.rotary.apply_rotary
    silu_and_mul       pagoda.model.layers.silu_and_mul

The decision depends only on the first tensor's device (and the environment, read
once), never on data, so it is stable inside a captured CUDA graph. Kernel modules
are imported on first CUDA use: CPU-only processes never import triton.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pagoda.model import attention as torch_attention
from pagoda.model import layers as torch_layers
from pagoda.model import rotary as torch_rotary
from pagoda.model.attention_metadata import AttentionMetadata

# Debug/benchmark escape hatch: run the torch path on CUDA too.
_TRITON_DISABLED = os.environ.get("PAGODA_DISABLE_TRITON", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """True when calls on tensors like `t` go to the Triton kernels."""
    return t.is_cuda and not _TRITON_DISABLED


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] at flat slots `slot_mapping` [T] of the caches."""
    if use_triton(key):
        from pagoda.kernels.kv_cache import write_kv_cache as kernel

        return kernel(key, value, key_cache, value_cache, slot_mapping)
    return torch_attention.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of query [T, H, D] over each request's cached context -> [T, H, D]."""
    if use_triton(query):
        from pagoda.kernels.attention import paged_attention as kernel

        return kernel(query, key_cache, value_cache, attn_metadata, scale)
    return torch_attention.paged_attention(query, key_cache, value_cache, attn_metadata, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual) * weight, x + residual)`; without residual `(norm(x) * weight, x)`.
    Same contract as `pagoda.model.layers.RMSNorm.forward`."""
    if use_triton(x):
        from pagoda.kernels.rms_norm import rms_norm as kernel

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if residual is None:
            return kernel(x2, weight, eps).view(shape), x
        out, new_residual = kernel(x2, weight, eps, residual.reshape(-1, shape[-1]))
        return out.view(shape), new_residual.view(shape)
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed, x


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] (NeoX layout) by the per-token tables of
    `pagoda.model.rotary.RotaryEmbedding`; a new tensor. Same contract as
    `pagoda.model.rotary.apply_rotary`.

    The kernel wants half tables `[T, D/2]` of cos and +sin. Full-width tables (HF's
    `cat(cos, cos)` with `cat(-sin, sin)` or `cat(sin, sin)`) carry exactly those in
    their first and second halves, so they are passed as strided views, not copied.
    """
    if use_triton(x):
        from pagoda.kernels.rotary import rotary_embedding as kernel

        half = x.shape[-1] // 2
        if cos.shape[-1] == x.shape[-1]:
            cos, sin = cos[:, :half], sin[:, half:]
        return kernel(x, cos, sin)
    return torch_rotary.apply_rotary(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    if use_triton(gate_up):
        from pagoda.kernels.activation import silu_and_mul as kernel

        shape = gate_up.shape
        return kernel(gate_up.reshape(-1, shape[-1])).view(*shape[:-1], shape[-1] // 2)
    return torch_layers.silu_and_mul(gate_up)

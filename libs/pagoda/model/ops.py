"""The one switch between the Triton kernels (CUDA) and the torch path (CPU).

Each function takes the arguments of the torch function it stands for, so a model
swaps `from pagoda.model.attention import paged_attention` for
`from pagoda.model.ops import paged_attention` and nothing else changes:

    ops function       torch path (CPU, or CUDA with PAGODA_DISABLE_TRITON=1)
    write_kv_cache     pagoda.model.attention.write_kv_cache
    paged_attention    pagoda.model.attention.paged_attention
    rms_norm           pagoda.model.layers.RMSNorm.forward's math (GemmaRMSNorm's with
                       unit_offset)
    rotary_embedding   pagoda.model.rotary.apply_rotary
    silu_and_mul       pagoda.model.layers.silu_and_mul
    gelu_tanh_and_mul  pagoda.model.layers.gelu_tanh_and_mul

bf16 tensors on the CPU go to Pagoda's fused C++ kernels (`pagoda.kernels.cpu`: one
pass instead of a chain of small torch calls; decode attention reads the paged cache
in place) for every function but gelu_tanh_and_mul, and in paged_attention for decodes
(for every token in batch-invariant mode); other dtypes, or PAGODA_CPU_KERNELS=0, keep the torch path.

An FP8 KV cache (`--kv-cache-dtype fp8`) goes through `fp8_kv_cache` first, on any
device: writes quantize, attention reads the step's blocks dequantized.

The decision depends only on the first tensor's device (and the environment, read
once), never on data, so it is stable inside a captured CUDA graph. Kernel modules
are imported on first CUDA use: CPU-only processes never import triton.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model import attention as torch_attention
from pagoda.model import fp8_kv_cache
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
    if fp8_kv_cache.is_fp8(key_cache):  # --kv-cache-dtype fp8: quantized on the way in
        return fp8_kv_cache.write_kv_cache_fp8(key, value, key_cache, value_cache, slot_mapping)
    if use_triton(key):
        # lazy: triton loads on the first CUDA call only: CPU processes never import it
        from pagoda.kernels.kv_cache import write_kv_cache as kernel

        return kernel(key, value, key_cache, value_cache, slot_mapping)
    if cpu_kernels.applies(key) and key_cache.dtype == key.dtype:
        return cpu_kernels.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return torch_attention.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float,
                    sliding_window: int | None = None,
                    logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query [T, H, D] over each request's cached context -> [T, H, D];
    optionally within a sliding window, with soft-capped scores, with attention sinks
    ([H] logits, one per query head: the torch path and the Triton kernels; not the
    CPU decode kernel, so bf16 CPU decodes with sinks take the torch path)."""
    if fp8_kv_cache.is_fp8(key_cache):  # this step's blocks, dequantized; then as usual
        key_cache, value_cache, attn_metadata = fp8_kv_cache.dense_step_cache(
            key_cache, value_cache, attn_metadata, query.dtype)
    if use_triton(query):
        # lazy: triton loads on the first CUDA call only: CPU processes never import it
        from pagoda.kernels.attention import paged_attention as kernel

        return kernel(query, key_cache, value_cache, attn_metadata, scale,
                      sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                      sinks=sinks)
    decode_kernel = None
    # Prefills stay on SDPA, but under batch invariance every token (prompt ones too)
    # goes to the kernel as a decode row, so a prompt token's attention does not depend
    # on whether its chunk had one token or more (`pagoda.model.attention`'s doc).
    if cpu_kernels.applies(query) and key_cache.dtype == query.dtype and sinks is None:
        decode_kernel = cpu_kernels.paged_decode_attention
    return torch_attention.paged_attention(query, key_cache, value_cache, attn_metadata, scale,
                                           sliding_window, logits_soft_cap, decode_kernel,
                                           sinks)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual) * weight, x + residual)`; without residual `(norm(x) * weight, x)`.
    Same contract as `pagoda.model.layers.RMSNorm.forward` (`GemmaRMSNorm.forward`, which
    scales by `1 + weight` in fp32, with `unit_offset`)."""
    if use_triton(x):
        # lazy: triton loads on the first CUDA call only: CPU processes never import it
        from pagoda.kernels.rms_norm import rms_norm as kernel

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if residual is None:
            return kernel(x2, weight, eps, unit_offset=unit_offset).view(shape), x
        out, new_residual = kernel(x2, weight, eps, residual.reshape(-1, shape[-1]),
                                   unit_offset=unit_offset)
        return out.view(shape), new_residual.view(shape)
    if cpu_kernels.applies(x) and weight.dtype == x.dtype:
        return cpu_kernels.rms_norm(x, weight, eps, residual, unit_offset)
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype), x
    return weight * normed.to(x.dtype), x


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] (NeoX layout) by the per-token tables of
    `pagoda.model.rotary.RotaryEmbedding`; a new tensor. Same contract as
    `pagoda.model.rotary.apply_rotary`.

    The kernel wants half tables `[T, R/2]` of cos and +sin; the full-width tables
    `[T, R]` (HF's `cat(cos, cos)` with `cat(-sin, sin)`) carry exactly those in their
    first and second halves, so they are passed as strided views, not copied. R is
    the rotary dim: head_dim, or less under partial rotary (only those dims rotate).
    """
    if use_triton(x):
        # lazy: triton loads on the first CUDA call only: CPU processes never import it
        from pagoda.kernels.rotary import rotary_embedding as kernel

        half = cos.shape[-1] // 2  # narrower than head_dim / 2 under partial rotary
        return kernel(x, cos[:, :half], sin[:, half:])
    if cpu_kernels.applies(x) and cos.dtype == x.dtype:
        return cpu_kernels.rotary_embedding(x, cos, sin)
    return torch_rotary.apply_rotary(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    if use_triton(gate_up):
        # lazy: triton loads on the first CUDA call only: CPU processes never import it
        from pagoda.kernels.activation import silu_and_mul as kernel

        shape = gate_up.shape
        return kernel(gate_up.reshape(-1, shape[-1])).view(*shape[:-1], shape[-1] // 2)
    if cpu_kernels.applies(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    return torch_layers.silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> gelu_tanh(gate) * up, [T, I] (Gemma's `gelu_pytorch_tanh` MLP)."""
    if use_triton(gate_up):
        # lazy: triton loads on the first CUDA call only: CPU processes never import it
        from pagoda.kernels.activation import gelu_tanh_and_mul as kernel

        shape = gate_up.shape
        return kernel(gate_up.reshape(-1, shape[-1])).view(*shape[:-1], shape[-1] // 2)
    return torch_layers.gelu_tanh_and_mul(gate_up)

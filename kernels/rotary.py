"""Rotary position embedding: rotate every head of `x [T, num_heads, head_dim]`.

Token `t` uses row `r = positions[t]` (or `r = t` without positions) of `cos` and
`sin`, each `[rows, rot_dim / 2]`. That covers both ways callers hold the angles:
the model's per-step `cos, sin = rotary_emb(positions)` (`[T, D/2]`, no positions),
and vLLM's `cos_sin_cache [max_position, rot_dim]` (pass its two halves as views,
with positions). Any RoPE scaling is already folded into the angles.

Only the first `rot_dim` dims of a head rotate; the rest are copied. NeoX style
(HF Llama) pairs dim `i` with `i + rot_dim/2`; GPT-J style pairs `2i` with `2i + 1`.
Queries and keys are rotated in one launch by passing them as one `[T, H + Hkv, D]`
view (the model's `qk`). One program per token, all its heads at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, positions_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cos, stride_sin,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:
        row = tl.load(positions_ptr + t).to(tl.int64)
    else:
        row = t
    half = ROT_DIM // 2
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < half
    cos = tl.load(cos_ptr + row * stride_cos + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_sin + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    if IS_NEOX:
        i1 = offs_r
        i2 = offs_r + half
    else:
        i1 = 2 * offs_r
        i2 = 2 * offs_r + 1
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < NUM_HEADS
    mask = h_mask[:, None] & r_mask[None, :]
    src = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
    dst = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh
    x1 = tl.load(src + i1[None, :], mask=mask, other=0.0)
    x2 = tl.load(src + i2[None, :], mask=mask, other=0.0)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    tl.store(dst + i1[None, :], (f1 * cos[None, :] - f2 * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(dst + i2[None, :], (f2 * cos[None, :] + f1 * sin[None, :]).to(x1.dtype), mask=mask)
    if ROT_DIM < HEAD_DIM:  # partial rotary: copy the pass-through dims
        offs_p = ROT_DIM + tl.arange(0, BLOCK_P)
        p_mask = h_mask[:, None] & (offs_p[None, :] < HEAD_DIM)
        tl.store(dst + offs_p[None, :], tl.load(src + offs_p[None, :], mask=p_mask), mask=p_mask)


def rotary_embedding(
    x: torch.Tensor,  # [T, num_heads, head_dim]
    cos: torch.Tensor,  # [rows, rot_dim // 2]
    sin: torch.Tensor,  # [rows, rot_dim // 2]
    positions: torch.Tensor | None = None,  # [T] row of cos/sin per token; None = row t
    is_neox_style: bool = True,
) -> torch.Tensor:
    """Return a rotated, contiguous copy of `x`; `x` is not modified."""
    num_tokens, num_heads, head_dim = x.shape
    half = cos.shape[1]
    check_tensor("x", x, (num_tokens, num_heads, head_dim), FLOAT_DTYPES)
    rows = num_tokens if positions is None else None
    check_tensor("cos", cos, (rows, half), FLOAT_DTYPES)
    check_tensor("sin", sin, tuple(cos.shape), (cos.dtype,))
    assert 2 * half <= head_dim, f"rot_dim {2 * half} exceeds head_dim {head_dim}"
    if positions is not None:
        check_tensor("positions", positions, (num_tokens,), (torch.int32, torch.int64))
        check_same_device(x=x, positions=positions)
    check_same_device(x=x, cos=cos, sin=sin)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    _rotary_kernel[(num_tokens,)](
        x, out, cos, sin, positions if positions is not None else cos,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, BLOCK_H=next_power_of_2(num_heads), HEAD_DIM=head_dim,
        ROT_DIM=2 * half, BLOCK_R=next_power_of_2(half),
        BLOCK_P=next_power_of_2(max(1, head_dim - 2 * half)),
        HAS_POSITIONS=positions is not None, IS_NEOX=is_neox_style,
    )
    return out

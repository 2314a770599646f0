"""Punica-style batched LoRA: each token row goes through its own adapter's A and B.

    shrink:  y[t, :]  = x[t, :] @ A[slot[t]]^T          A: [S, R, K]  ->  y: [T, R] fp32
    expand:  out[t, :] += y[t, :] @ B[slot[t]]^T        B: [S, N, R]

`slot[t] == -1` means the row has no adapter: both kernels skip it, so its output is
the base layer's, bit for bit. One program per (token, tile): rows of different adapters
share one launch, which is what lets a step mix adapters (vLLM's bgmv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, y_ptr, K, R, stride_x, stride_as, stride_ar,
                   stride_y, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + t * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(y_ptr + t * stride_y + offs_r, acc, mask=mask_r)


@triton.jit
def _expand_kernel(y_ptr, b_ptr, slot_ptr, out_ptr, N, R, stride_y, stride_bs, stride_bn,
                   stride_o, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        y = tl.load(y_ptr + t * stride_y + offs_r, mask=mask_r, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * y[None, :], axis=1)
    ptrs = out_ptr + t * stride_o + offs_n
    base = tl.load(ptrs, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=mask_n)


def add_lora(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             token_slots: torch.Tensor) -> torch.Tensor:
    """out [T, N] += per-row LoRA of x [T, K] (in place; returns `out`).
    a_stack [S, R, K], b_stack [S, N, R], token_slots [T] int64 (-1: no adapter)."""
    num_tokens, k = x.shape
    num_slots, rank, _ = a_stack.shape
    n = out.shape[1]
    check_tensor("x", x, (num_tokens, k), FLOAT_DTYPES)
    check_tensor("out", out, (num_tokens, n), FLOAT_DTYPES)
    check_tensor("a_stack", a_stack, (num_slots, rank, k), FLOAT_DTYPES)
    check_tensor("b_stack", b_stack, (num_slots, n, rank), FLOAT_DTYPES)
    check_tensor("token_slots", token_slots, (num_tokens,), (torch.int64, torch.int32))
    check_same_device(x=x, out=out, a_stack=a_stack, b_stack=b_stack, token_slots=token_slots)
    if num_tokens == 0:
        return out
    y = torch.zeros((num_tokens, rank), dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(rank))
    block_k = min(128, triton.next_power_of_2(k))
    _shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, a_stack, token_slots, y, k, rank, x.stride(0), a_stack.stride(0), a_stack.stride(1),
        y.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    block_n = min(128, triton.next_power_of_2(n))
    _expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
        y, b_stack, token_slots, out, n, rank, y.stride(0), b_stack.stride(0), b_stack.stride(1),
        out.stride(0), BLOCK_N=block_n, BLOCK_R=min(64, triton.next_power_of_2(rank)))
    return out

"""`x @ W^T` from quantized weights, dequantized tile by tile inside the GEMM.

The weight is read in its stored form (a quarter or an eighth of the bytes of a bf16
weight) and each `[BLOCK_K, BLOCK_N]` tile of W^T is dequantized in registers, cast to
x's dtype and fed to `tl.dot` (fp32 accumulation): the same numbers as dequantizing W
to x's dtype first (the CPU path, `pagoda.model.quantization`), without ever writing it.

- `int4_matmul`: `int4.py`'s layout. qweight int32 [K/8, N] (nibble j of word r = row
  8r + j), scales fp32 [G, N], zeros uint8 [G, N], optional g_idx int32 [K] (act-order);
  W^T[k, n] = (q - zeros[g(k), n]) * scales[g(k), n], g(k) = g_idx[k] or k // group.
- `fp8_matmul`: weight float8_e4m3fn [N, K], scale fp32 [N, ceil(K / block_k)];
  W[n, k] = weight[n, k] * scale[n, k // block_k]. The fp8 bytes are decoded with
  integer ops, so the kernel runs on GPUs without an fp8 type too.

Grid `(ceil(M / BLOCK_M), ceil(N / BLOCK_N))`; each program walks K. Decode (M = 1)
pays for a 16-row tile (tl.dot's minimum) but reads each weight tile once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor, dot_precision


@triton.jit
def _int4_matmul_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr,
                        M, N, K, group_size, stride_xm, stride_om,
                        HAS_G_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        kn_mask = k_mask[:, None] & n_mask[None, :]
        packed = tl.load(qweight_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :],
                         mask=kn_mask, other=0)
        q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if HAS_G_IDX:
            group = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)
        else:
            group = offs_k // group_size
        rows = group[:, None].to(tl.int64) * N + offs_n[None, :]
        scale = tl.load(scales_ptr + rows, mask=kn_mask, other=0.0)
        zero = tl.load(zeros_ptr + rows, mask=kn_mask, other=0).to(tl.int32)
        w = ((q - zero).to(tl.float32) * scale).to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _e4m3_to_float(byte):
    """float8_e4m3fn bits (as uint8) -> fp32, exactly, with integer ops only: no native fp8
    type needed (GPUs before sm_89 have none). NaN (0x7f/0xff) is never stored here."""
    b = byte.to(tl.int32)
    sign, exponent, mantissa = (b >> 7) & 1, (b >> 3) & 0xF, b & 0x7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32,
                                                                             bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125 * (1 - 2 * sign).to(tl.float32)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _fp8_matmul_kernel(x_ptr, weight_ptr, scale_ptr, out_ptr, M, N, K, block_k,
                       stride_xm, stride_wn, stride_sn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        kn_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(weight_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=kn_mask, other=0.0)
        scale = tl.load(scale_ptr + offs_n[None, :].to(tl.int64) * stride_sn
                        + (offs_k // block_k)[:, None], mask=kn_mask, other=0.0)
        wt = (_e4m3_to_float(w) * scale).to(a.dtype)
        acc += tl.dot(a, wt, input_precision=DOT_PRECISION)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _blocks(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small M (decode) keeps the 16-row minimum of tl.dot."""
    return (16 if num_rows <= 16 else 64), 64, 64


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype (layout in the module docstring)."""
    num_rows, k = x.shape
    n = qweight.shape[1]
    check_tensor("x", x, (num_rows, None), FLOAT_DTYPES)
    check_tensor("qweight", qweight, (k // 8, n), (torch.int32,))
    assert k % 8 == 0, f"x: {k} input columns are not a multiple of 8"
    check_tensor("scales", scales, (None, n), (torch.float32,))
    check_tensor("zeros", zeros, (scales.shape[0], n), (torch.uint8,))
    assert qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()
    if g_idx is not None:
        check_tensor("g_idx", g_idx, (k,), (torch.int32,))
        check_same_device(x=x, qweight=qweight, g_idx=g_idx)
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros)
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    bm, bn, bk = _blocks(num_rows)
    _int4_matmul_kernel[(triton.cdiv(num_rows, bm), triton.cdiv(n, bn))](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        num_rows, n, k, group_size, x.stride(0), out.stride(0),
        HAS_G_IDX=g_idx is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PRECISION=dot_precision(x.dtype))
    return out


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block_k: int) -> torch.Tensor:
    """x [M, K] @ (weight * scale)^T -> [M, N] in x's dtype."""
    num_rows, k = x.shape
    n = weight.shape[0]
    check_tensor("x", x, (num_rows, k), FLOAT_DTYPES)
    check_tensor("weight", weight, (n, k), (torch.float8_e4m3fn,))
    check_tensor("scale", scale, (n, -(-k // block_k)), (torch.float32,))
    check_same_device(x=x, weight=weight, scale=scale)
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    bm, bn, bk = _blocks(num_rows)
    _fp8_matmul_kernel[(triton.cdiv(num_rows, bm), triton.cdiv(n, bn))](
        x, weight.view(torch.uint8), scale, out, num_rows, n, k, block_k,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=dot_precision(x.dtype))
    return out

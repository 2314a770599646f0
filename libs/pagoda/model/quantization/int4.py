"""Packed int4 weights with per-group scales and zero points: the one in-memory form that
AWQ and GPTQ checkpoints are repacked into after loading (never dequantized).

    qweight  int32 [K/8, N]   nibble j (bits 4j..4j+3) of qweight[r, n] = q[8r + j, n]
    scales   fp32  [G, N]     (the checkpoint's fp16 scales, exactly)
    zeros    uint8 [G, N]     zero points, 0..16 (GPTQ's v1 offset can give 16)
    g_idx    int32 [K] | None group of input row k; None: group k // group_size

    W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]

K, N are this rank's input and output sizes. The layout is GPTQ's (packed along the
input), which a kernel reads as `[BLOCK_K / 8, BLOCK_N]` tiles of the `x @ W^T`
product; AWQ's column-packed, interleaved words are unpacked and repacked once.
On CUDA `pagoda.kernels.quant_matmul.int4_matmul` multiplies from this form; on the
CPU `tiled_linear` dequantizes a tile of output columns at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.ops import use_triton
from pagoda.model.quantization.base import new_parameter, tiled_linear

# AWQ packs output column 8c + ORDER[i] into nibble i of word c.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SEQUENTIAL_ORDER = tuple(range(8))
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [R, N] packed along rows -> int32 [8R, N] of 0..15."""
    q = (qweight[:, None, :] >> _SHIFTS.to(qweight.device)[None, :, None]) & 0xF
    return q.reshape(-1, qweight.shape[1])


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [8R, N] of 0..15 -> int32 [R, N] (inverse of `unpack_rows`)."""
    q = q.to(torch.int32).reshape(-1, 8, q.shape[1])
    shifted = q << _SHIFTS.to(q.device)[None, :, None]
    # The nibbles are disjoint, so a sum is their bitwise or (int32 wraps like C).
    return shifted.sum(dim=1, dtype=torch.int32)


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, N/8] packed along columns in `order` -> int32 [R, N] of 0..15."""
    nibbles = (packed[:, :, None] >> _SHIFTS.to(packed.device)[None, None, :]) & 0xF
    columns = torch.empty_like(nibbles)
    columns[:, :, list(order)] = nibbles  # nibble i holds column order[i]
    return columns.reshape(packed.shape[0], -1)


def pack_columns(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int [R, N] of 0..15 -> int32 [R, N/8] (inverse of `unpack_columns`)."""
    q = q.to(torch.int32).reshape(q.shape[0], -1, 8)[:, :, list(order)]
    return (q << _SHIFTS.to(q.device)).sum(dim=2, dtype=torch.int32)


def set_int4_weights(layer: nn.Module, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int) -> None:
    """Replace whatever the layer loaded with the int4 form above."""
    for name in ("qweight", "qzeros", "scales", "g_idx", "zeros"):
        if hasattr(layer, name):
            delattr(layer, name)
    layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
    layer.scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
    layer.zeros = nn.Parameter(zeros.to(torch.uint8).contiguous(), requires_grad=False)
    if g_idx is not None:
        layer.g_idx = nn.Parameter(g_idx.to(torch.int32).contiguous(), requires_grad=False)
    else:
        layer.g_idx = None
    layer.group_size = group_size


def groups_of_rows(g_idx: torch.Tensor | None, num_rows: int, group_size: int,
                   device: torch.device) -> torch.Tensor | None:
    """None when row k's group is k // group_size for whole groups (the fast path);
    otherwise the explicit group of every row."""
    if g_idx is not None:
        return g_idx
    if num_rows % group_size == 0:
        return None
    return torch.arange(num_rows, device=device, dtype=torch.int32) // group_size


def dequantize_int4(layer: nn.Module, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """W[start:end] as [end - start, K] in `dtype` (the CPU path and the test oracle).

    The arithmetic is fp32: (q - zero) is a small exact integer and the fp16 scales
    are exact in fp32, so the one rounding is the product's, then the cast to `dtype`.
    """
    q = unpack_rows(layer.qweight[:, start:end])  # [K, n]
    scales, zeros = layer.scales[:, start:end], layer.zeros[:, start:end].to(torch.int32)
    if layer.g_idx is None:
        num_groups = scales.shape[0]
        q = q.view(num_groups, -1, end - start)
        w = (q - zeros[:, None, :]).to(torch.float32) * scales[:, None, :]
        w = w.view(-1, end - start)
    else:
        g = layer.g_idx.long()
        w = (q - zeros[g]).to(torch.float32) * scales[g]
    return w.to(dtype).t()


def apply_int4(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) from the packed form: the Triton kernel on CUDA, else the tiled
    dequantize-and-multiply."""
    num_columns = layer.qweight.shape[1]
    if use_triton(x):
        from pagoda.kernels.quant_matmul import int4_matmul  # lazy: Triton, only on CUDA

        out = int4_matmul(x.reshape(-1, x.shape[-1]), layer.qweight, layer.scales,
                          layer.zeros, layer.g_idx, layer.group_size)
        out = out.view(*x.shape[:-1], num_columns)
        return out if bias is None else out + bias
    return tiled_linear(x, num_columns, lambda s, e: dequantize_int4(layer, s, e, x.dtype),
                        bias, rows_per_column=layer.qweight.shape[0] * 8)


def new_int32(*shape: int) -> nn.Parameter:
    return new_parameter(*shape, dtype=torch.int32)

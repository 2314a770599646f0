"""The quantized-weight GEMMs against the CPU path's dequantize-then-multiply.

fp32: the kernel dequantizes each tile exactly as the CPU path does (fp32 arithmetic,
one rounding), so only the summation order differs (atol 1e-4 on outputs of size ~10).
bf16: the tile is rounded to bf16 as the CPU path rounds W, and both accumulate in
fp32; the outputs agree to bf16 rounding (torch's default bf16 tolerance).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels.quant_matmul import fp8_matmul, int4_matmul
from pagoda.model.quantization.fp8 import dequantize_fp8
from pagoda.model.quantization.int4 import dequantize_int4, pack_rows

DTYPES = [torch.float32, torch.bfloat16]


def assert_close(actual, expected):
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(actual, expected)


def int4_layer(k: int, n: int, group: int, act_order: bool, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    num_groups = k // group
    g_idx = None
    if act_order:
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        g_idx = g_idx.to(device)
    return SimpleNamespace(
        qweight=pack_rows(q).to(device),
        scales=(torch.rand(num_groups, n, generator=gen) * 0.1 + 0.01).half().float().to(device),
        zeros=torch.randint(0, 17, (num_groups, n), generator=gen).to(torch.uint8).to(device),
        g_idx=g_idx, group_size=group)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_matmul_matches_dequantized_weights(device, dtype, num_rows, act_order):
    k, n, group = 96, 80, 32  # N and K not multiples of the 64-wide tiles
    layer = int4_layer(k, n, group, act_order, device)
    x = torch.randn(num_rows, k, device=device).to(dtype)
    out = int4_matmul(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, group)
    expected = F.linear(x.cpu(), dequantize_int4(_cpu(layer), 0, n, dtype))
    assert out.dtype == dtype and out.shape == (num_rows, n)
    assert_close(out.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 20])
@pytest.mark.parametrize("block_k", [None, 32])  # per channel, and 32-column blocks
def test_fp8_matmul_matches_dequantized_weights(device, dtype, num_rows, block_k):
    k, n = 96, 72
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn)
    block = block_k or k
    scale = torch.rand(n, -(-k // block), generator=gen) * 0.01
    x = torch.randn(num_rows, k, generator=gen).to(dtype)
    out = fp8_matmul(x.to(device), weight.to(device), scale.to(device), block)
    expected = F.linear(x, dequantize_fp8(weight, scale, block, dtype))
    assert_close(out.cpu(), expected)


def test_launchers_check_their_arguments(device):
    layer = int4_layer(64, 16, 32, False, device)
    x = torch.randn(2, 64, device=device)
    with pytest.raises(AssertionError, match="zeros: dtype"):
        int4_matmul(x, layer.qweight, layer.scales, layer.zeros.int(), None, 32)
    with pytest.raises(AssertionError, match="qweight: dim 0 is 8, expected 4"):
        int4_matmul(x[:, :32], layer.qweight, layer.scales, layer.zeros, None, 32)


def _cpu(layer):
    return SimpleNamespace(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                              for k, v in vars(layer).items()})


def test_fp8_decoding_is_exact_for_every_finite_byte(device):
    # All 254 finite e4m3fn values (normals, subnormals, both zeros) through the kernel:
    # x = identity picks out each weight row, scale 1.
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = values[~values.float().isnan()]
    weight = finite.view(-1, 1).expand(-1, 16).contiguous()  # [254, 16]
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    out = fp8_matmul(x.to(device), weight.to(device), torch.ones(254, 1, device=device), 16)
    assert torch.equal(out.cpu()[0], finite.float())

"""Pagoda's skinny int4/int8 GEMV (kernels/cpu/csrc/gemv.h) against fp64 products of the
dequantized weights, and its portable code against its AVX-512 code bit for bit."""

from __future__ import annotations


import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model.quantization import gguf_int4

from cpu_kernel_guard import kernels_loaded, requires_compiler  # noqa: F401 (autouse)

BF16 = torch.bfloat16

pytestmark = requires_compiler


def _within_bf16_of(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor) -> None:
    """got is exact rounded to bf16 (half an ulp: at most 2^-8 relative) after fp32 sums
    whose error is far below 1e-5 of the products' magnitude (sum |x| |w|)."""
    err = (got.double() - exact).abs()
    bound = exact.abs() * 2.0 ** -8 + magnitude * 1e-5
    assert bool((err <= bound).all()), float((err - bound).max())


def _int4_case(n: int, k: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(BF16)
    q, scales_zeros = gguf_int4.quantize_groups(weight)
    scale = scales_zeros[..., 0].double().t().repeat_interleave(gguf_int4.GROUP_SIZE, 1)
    zero = scales_zeros[..., 1].double().t().repeat_interleave(gguf_int4.GROUP_SIZE, 1)
    dequantized = (q.double() - 8) * scale + zero  # W[n, k] as the module doc defines it
    x = (torch.randn(m, k, generator=g) * 3).to(BF16)
    packed, scales = gguf_int4.pack_int4_gemv(q, scales_zeros)
    return x, packed, scales, dequantized


@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (80, 160), (960, 576)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_int4_gemv_is_the_dequantized_product(n, k, m):
    x, packed, scales, w = _int4_case(n, k, m, seed=n * k + m)
    got = cpu_kernels.int4_gemv(x, packed, scales)
    assert got.shape == (m, n) and got.dtype == BF16
    _within_bf16_of(got, x.double() @ w.t(), x.double().abs() @ w.abs().t())


@pytest.mark.parametrize("n,k,m", [(48, 96, 1), (80, 160, 3), (960, 576, 4), (32, 64, 6)])
def test_int4_gemv_portable_code_gives_the_vector_codes_bits(n, k, m):
    x, packed, scales, _ = _int4_case(n, k, m, seed=7 + m)
    x[0, 5] = 0.0  # zeros and a tiny value among the activations
    x[-1, 3] = 1e-30
    vector = cpu_kernels.int4_gemv(x, packed, scales)
    assert torch.equal(cpu_kernels.int4_gemv(x, packed, scales, portable=True), vector)


def test_int4_gemv_rows_are_independent():
    """A row's result does not depend on the other rows of the call (batch invariant)."""
    x, packed, scales, _ = _int4_case(64, 128, 6, seed=3)
    together = cpu_kernels.int4_gemv(x, packed, scales)
    for i in range(x.shape[0]):
        assert torch.equal(cpu_kernels.int4_gemv(x[i:i + 1], packed, scales)[0], together[i])


def _int8_case(n: int, k: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) / 50 + 1e-3).to(BF16)
    x = (torch.randn(m, k, generator=g) * 3).to(BF16)
    return x, weight, scales


@pytest.mark.parametrize("n,k", [(4, 16), (37, 48), (130, 576)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6])
def test_int8_gemv_is_the_scaled_int8_product(n, k, m):
    x, weight, scales = _int8_case(n, k, m, seed=n + k + m)
    w = weight.double() * scales.double()[:, None]
    got = cpu_kernels.int8_gemv(x, weight, scales)
    assert got.shape == (m, n) and got.dtype == BF16
    _within_bf16_of(got, x.double() @ w.t(), x.double().abs() @ w.abs().t())
    assert torch.equal(cpu_kernels.int8_gemv(x, weight, scales, portable=True), got)


def test_bad_shapes_raise():
    x, packed, scales, _ = _int4_case(32, 64, 1, seed=0)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.int4_gemv(x[:, :32].contiguous(), packed, scales)
    with pytest.raises(RuntimeError, match="scales"):
        cpu_kernels.int4_gemv(x, packed, scales[:1].contiguous())
    x8, weight, s8 = _int8_case(8, 32, 1, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.int8_gemv(x8[:, :24].contiguous(), weight[:, :24].contiguous(), s8)

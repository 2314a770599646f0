"""RMSNorm (Llama's and Gemma's, + fused residual), rotary embedding and the gated
activations (SiLU, tanh-GELU) against references.

With the interpreter patched to round like the GPU, bf16 results are bit-exact;
on the GPU a reduction order may move the last bit, hence the 1-ulp tolerance there.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reference as ref
from pagoda.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pagoda.kernels.rms_norm import rms_norm
from pagoda.kernels.rotary import rotary_embedding

DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.device.type == "cpu":
        rtol = 1e-6 if actual.dtype == torch.float32 else 0.0
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-6 if rtol else 0.0)
    else:
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [40, 100])
def test_rms_norm_with_and_without_residual(device, dtype, hidden):
    torch.manual_seed(0)
    # Rows as a strided view (every other row of a bigger buffer).
    x = torch.randn(14, hidden, dtype=dtype, device=device)[::2]
    residual = torch.randn(7, hidden, dtype=dtype, device=device)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    x_before, residual_before = x.clone(), residual.clone()

    assert_matches(rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_residual = ref.rms_norm(x, weight, 1e-5, residual)
    assert_matches(out, expected_out)
    assert_matches(new_residual, expected_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # out of place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot_dim", [(6, 2, 16, 16), (3, 3, 24, 8), (8, 1, 16, 16)])
def test_rotary_embedding(device, dtype, is_neox_style, heads, kv_heads, head_dim, rot_dim):
    torch.manual_seed(1)
    num_tokens = 5
    # Queries and keys rotated together as the model's `qk` view of its fused qkv.
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    qk = qkv.view(num_tokens, -1, head_dim)[:, : heads + kv_heads]
    # vLLM layout: a [max_position, rot_dim] cache read at each token's position.
    positions = torch.tensor([7, 0, 3, 3, 30], device=device)
    cache = torch.randn(32, rot_dim, dtype=dtype, device=device)
    cos, sin = cache[:, : rot_dim // 2], cache[:, rot_dim // 2 :]

    out = rotary_embedding(qk, cos, sin, positions, is_neox_style)
    assert_matches(out, ref.rotary_embedding(qk, cos, sin, positions, is_neox_style))
    assert not torch.equal(out[..., :rot_dim], qk[..., :rot_dim])
    assert torch.equal(out[..., rot_dim:], qk[..., rot_dim:])  # pass-through dims
    # The model's layout: per-token rows, no positions.
    per_token_cos, per_token_sin = cos[positions].contiguous(), sin[positions].contiguous()
    assert torch.equal(rotary_embedding(qk, per_token_cos, per_token_sin, None, is_neox_style), out)


def test_rotary_reference_matches_hf_llama_rotation():
    # The reference (hence the kernel) is HF's `q * cos + rotate_half(q) * sin`.
    torch.manual_seed(2)
    head_dim, positions = 8, torch.tensor([0, 1, 5])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    q = torch.randn(3, 2, head_dim)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    rotate_half = torch.cat([-q[..., head_dim // 2:], q[..., : head_dim // 2]], dim=-1)
    expected = q * emb.cos() + rotate_half * emb.sin()
    torch.testing.assert_close(ref.rotary_embedding(q, freqs.cos(), freqs.sin()), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [37, 1500])
def test_silu_and_mul(device, dtype, inter):
    torch.manual_seed(3)
    x = torch.randn(6, 2 * inter, dtype=dtype, device=device) * 4
    assert_matches(silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_scales_by_one_plus_weight_in_fp32(device, dtype):
    torch.manual_seed(4)
    x = torch.randn(5, 48, dtype=dtype, device=device)
    residual = torch.randn(5, 48, dtype=dtype, device=device)
    weight = 0.3 * torch.randn(48, dtype=dtype, device=device)
    assert_matches(rms_norm(x, weight, 1e-6, unit_offset=True), ref.gemma_rms_norm(x, weight, 1e-6))
    out, new_residual = rms_norm(x, weight, 1e-6, residual, unit_offset=True)
    expected_out, expected_residual = ref.gemma_rms_norm(x, weight, 1e-6, residual)
    assert_matches(out, expected_out)
    assert_matches(new_residual, expected_residual)
    assert not torch.allclose(out, ref.rms_norm(x, weight, 1e-6, residual)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [37, 1500])
def test_gelu_tanh_and_mul(device, dtype, inter):
    torch.manual_seed(5)
    x = torch.randn(6, 2 * inter, dtype=dtype, device=device) * 4
    out, expected = gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x)
    assert out.dtype == dtype and out.shape == expected.shape
    # tanh comes from exp in the kernel, from libm in torch: a few fp32 ulps apart, which
    # may flip the last bf16 bit after rounding.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(out, expected, **tol)


def test_elementwise_launchers_reject_bad_arguments(device):
    x = torch.randn(4, 10, device=device)
    with pytest.raises(AssertionError, match="weight"):
        rms_norm(x, torch.ones(11, device=device), 1e-5)
    with pytest.raises(AssertionError, match="residual"):
        rms_norm(x, torch.ones(10, device=device), 1e-5, residual=torch.randn(3, 10, device=device))
    with pytest.raises(AssertionError, match="2 \\* intermediate_size"):
        silu_and_mul(torch.randn(4, 9, device=device))
    with pytest.raises(AssertionError, match="rot_dim"):
        rotary_embedding(x.view(4, 1, 10), torch.randn(4, 6, device=device),
                         torch.randn(4, 6, device=device))
    with pytest.raises(AssertionError, match="cos: dim 0"):
        rotary_embedding(x.view(4, 1, 10), torch.randn(3, 5, device=device),
                         torch.randn(3, 5, device=device))

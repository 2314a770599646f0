"""RoPE frequencies and rotation against transformers, for each supported scaling."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagoda.model.rotary import (RotaryEmbedding, apply_rotary, compute_inv_freq,
                                 normalize_rope_scaling, rope_frequencies)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": LLAMA3,
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_config(scaling: dict | None, theta: float = 500000.0, max_pos: int = 4096) -> LlamaConfig:
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                       max_position_embeddings=max_pos, rope_parameters=params)


@pytest.mark.parametrize("name", SCALINGS)
def test_inv_freq_matches_transformers(name):
    scaling = SCALINGS[name]
    config = hf_config(scaling)
    if name == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    elif name == "dynamic":
        # We fix the NTK base for the longest supported length (vLLM's choice);
        # transformers reaches the same frequencies at that length.
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=4096 * 2)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[name](config)
    ours = compute_inv_freq(128, 500000.0, scaling, 4096)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    if scaling is not None:  # and the scaling really changes something
        assert not torch.allclose(ours, compute_inv_freq(128, 500000.0, None, 4096))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_transformers_bit_for_bit(dtype):
    config = hf_config(LLAMA3)
    hf_rope = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(128, 500000.0, LLAMA3, 4096)
    positions = torch.tensor([0, 1, 7, 100, 4095, 3])
    q = torch.randn(6, 2, 128).to(dtype)
    k = torch.randn(6, 1, 128).to(dtype)
    cos, sin = hf_rope(q, positions[None])
    # HF layout: [batch, heads, seq, dim]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    c, s = ours(positions, dtype)
    assert torch.equal(apply_rotary(q, c, s), hq[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, c, s), hk[0].transpose(0, 1))


def test_gguf_freq_factors_divide_the_frequencies():
    factors = [1.0] * 32 + [4.0] * 32
    plain = compute_inv_freq(128, 10000.0, None, 2048)
    scaled = compute_inv_freq(128, 10000.0, {"rope_type": "freq_factors", "freq_factors": factors}, 2048)
    torch.testing.assert_close(scaled, plain / torch.tensor(factors))


def test_normalize_rope_scaling():
    assert normalize_rope_scaling(None) is None
    assert normalize_rope_scaling({"rope_type": "default", "rope_theta": 1e4}) is None
    assert normalize_rope_scaling({"type": "linear", "factor": 2.0}) == {"rope_type": "linear",
                                                                          "factor": 2.0}
    assert normalize_rope_scaling({"type": "su", "short_factor": [1.0]})["rope_type"] == "longrope"
    with pytest.raises(ValueError, match="mrope"):
        normalize_rope_scaling({"rope_type": "mrope", "mrope_section": [16, 24, 24]})


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
LONGROPE_FACTORS = {"short_factor": [1.0 + 0.05 * i for i in range(64)],
                    "long_factor": [1.0 + 0.5 * i for i in range(64)]}


@pytest.mark.parametrize("scaling,max_model_len,hf_seq_len", [
    (YARN, None, None),
    ({**YARN, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}, None, None),
    ({**YARN, "attention_factor": 1.25, "truncate": False}, None, None),
    # longrope: short factors when the context fits the pretraining length, long beyond.
    ({"rope_type": "longrope", "original_max_position_embeddings": 1024, **LONGROPE_FACTORS},
     1024, None),
    ({"rope_type": "longrope", "original_max_position_embeddings": 1024, **LONGROPE_FACTORS},
     4096, 1025),
], ids=["yarn", "yarn-mscale", "yarn-attention-factor", "longrope-short", "longrope-long"])
def test_yarn_and_longrope_match_transformers(scaling, max_model_len, hf_seq_len):
    config = hf_config(scaling, theta=10000.0, max_pos=4096)
    init = ROPE_INIT_FUNCTIONS[scaling["rope_type"]]
    expected, expected_factor = init(config, seq_len=hf_seq_len)
    ours, factor = rope_frequencies(128, 10000.0, scaling, 4096, max_model_len)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12) and factor != 1.0
    # The factor scales cos and sin, as transformers' rotary embedding does.
    rope = RotaryEmbedding(128, 10000.0, scaling, 4096, max_model_len=max_model_len)
    hf_rope = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 5, 1023] if hf_seq_len is None else [0, 5, 1024])
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, signed_sin = rope(positions, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(signed_sin[:, 64:], hf_sin[0, :, 64:], rtol=1e-6, atol=1e-6)


def test_partial_rotary_rotates_the_leading_dims_only():
    rope = RotaryEmbedding(16, 10000.0, None, 64, rotary_dim=12)
    cos, sin = rope(torch.tensor([3, 7]), torch.float32)
    assert cos.shape == (2, 12)
    x = torch.randn(2, 3, 16)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[..., :12], apply_rotary(x[..., :12], cos, sin))
    assert torch.equal(out[..., 12:], x[..., 12:])

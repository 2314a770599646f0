"""RoPE frequencies and rotation against transformers, for each supported scaling."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagoda.model.rotary import (RotaryEmbedding, apply_rotary, compute_inv_freq,
                                 normalize_rope_scaling)

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
    with pytest.raises(ValueError, match="yarn"):
        normalize_rope_scaling({"rope_type": "yarn", "factor": 4.0})

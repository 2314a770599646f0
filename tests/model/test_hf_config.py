"""config.json -> ModelArchConfig: sliding windows (every layer, per `layer_types`, Qwen2's
rule, off), the activation, partial rotary and Phi-3's longrope keys."""

from __future__ import annotations

import json

import pytest

from pagoda.model.hf_config import arch_config_from_hf_dir


def parse(tmp_path, **overrides):
    config = {"architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256}
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return arch_config_from_hf_dir(str(tmp_path))


def windows(arch) -> list[int | None]:
    return [arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)]


def test_a_window_without_layer_types_slides_every_layer(tmp_path):
    arch = parse(tmp_path, sliding_window=4096)
    assert windows(arch) == [4096] * 4 and arch.kv_cache_sliding_window == 4096


def test_layer_types_choose_the_sliding_layers(tmp_path):
    types = ["sliding_attention", "full_attention"] * 2
    arch = parse(tmp_path, sliding_window=16, layer_types=types)
    assert windows(arch) == [16, None, 16, None]
    assert arch.kv_cache_sliding_window is None  # a full layer reads every block


@pytest.mark.parametrize("overrides", [
    {"sliding_window": None},
    {"sliding_window": 4096, "use_sliding_window": False},  # Qwen2/Qwen3 checkpoints
    {"sliding_window": 4096, "layer_types": ["full_attention"] * 4},
])
def test_no_window(tmp_path, overrides):
    arch = parse(tmp_path, **overrides)
    assert windows(arch) == [None] * 4 and arch.kv_cache_sliding_window is None


def test_qwen2_slides_from_max_window_layers_on(tmp_path):
    arch = parse(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32,
                 use_sliding_window=True, max_window_layers=2)
    assert windows(arch) == [None, None, 32, 32]


def test_activation_partial_rotary_and_phi3_longrope_keys(tmp_path):
    arch = parse(tmp_path, architectures=["Phi3ForCausalLM"], hidden_act="silu",
                 partial_rotary_factor=0.75, original_max_position_embeddings=64,
                 rope_scaling={"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6})
    assert arch.hidden_act == "silu" and arch.family_settings.partial_rotary_factor == 0.75
    assert arch.rope_scaling == {"rope_type": "longrope", "short_factor": [1.0] * 6,
                                 "long_factor": [2.0] * 6, "original_max_position_embeddings": 64}

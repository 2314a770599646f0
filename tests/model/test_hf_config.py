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


@pytest.mark.parametrize("top, text", [(True, False), (False, True), (False, False), (True, True)])
@pytest.mark.parametrize("architecture", ["LlavaForConditionalGeneration",
                                          "Qwen2VLForConditionalGeneration"])
def test_a_multimodal_head_is_tied_as_transformers_ties_it(tmp_path, architecture, top, text):
    """transformers ties by the top-level flag its config class derives from both levels;
    untying where it ties would load a head the checkpoint does not have (or the wrong one)."""
    import transformers

    text_config = {"model_type": "llama" if "Llava" in architecture else "qwen2_vl_text",
                   "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128,
                   "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": text}
    vision_config = ({"model_type": "clip_vision_model", "hidden_size": 16,
                      "intermediate_size": 32, "num_attention_heads": 2,
                      "num_hidden_layers": 2, "image_size": 28, "patch_size": 14}
                     if "Llava" in architecture else {"depth": 1, "embed_dim": 16,
                                                     "hidden_size": 32, "num_heads": 2})
    body = {"architectures": [architecture], "text_config": text_config,
            "vision_config": vision_config, "tie_word_embeddings": top,
            "model_type": "llava" if "Llava" in architecture else "qwen2_vl"}
    if "Qwen2VL" in architecture:
        text_config["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 1, 1]}
    (tmp_path / "config.json").write_text(json.dumps(body))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert arch_config_from_hf_dir(str(tmp_path)).tie_word_embeddings == hf.tie_word_embeddings

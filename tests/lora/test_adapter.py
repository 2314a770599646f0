"""Adapter loading: PEFT names to our fused modules, scaling folded into B."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagoda.lora.adapter import load_lora_model

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def test_peft_names_map_to_fused_parts_with_scaling(adapters):
    lora = load_lora_model(1, adapters[0], PACKED, max_rank=16, dtype=torch.float32)
    assert lora.rank == 8
    assert set(lora.weights["model.layers.0.self_attn.qkv_proj"]) == {"q_proj", "k_proj", "v_proj"}
    assert set(lora.weights["model.layers.0.mlp.gate_up_proj"]) == {"gate_proj", "up_proj"}
    assert set(lora.weights["model.layers.0.self_attn.o_proj"]) == {None}
    raw = load_file(f"{adapters[0]}/adapter_model.safetensors")
    b = raw["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    a, scaled_b = lora.weights["model.layers.0.self_attn.qkv_proj"]["k_proj"]
    assert torch.equal(a, raw["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"])
    torch.testing.assert_close(scaled_b, b * 2.0)  # lora_alpha / r = 16 / 8


def test_rank_above_max_and_unsupported_features_are_refused(adapters, tmp_path):
    with pytest.raises(ValueError, match="max_lora_rank"):
        load_lora_model(1, adapters[0], PACKED, max_rank=4, dtype=torch.float32)
    config = json.load(open(f"{adapters[0]}/adapter_config.json"))
    config["use_dora"] = True
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DoRA"):
        load_lora_model(1, str(tmp_path), PACKED, max_rank=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_lora_model(1, str(tmp_path / "missing"), PACKED, max_rank=16, dtype=torch.float32)

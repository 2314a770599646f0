"""A tiny random Qwen2-VL checkpoint (transformers' own config classes) with SmolLM2's
tokenizer plus Qwen2-VL's vision tokens, and the PIL image processor at a small patch
size, so images of different shapes give different grids (dynamic resolution)."""

from __future__ import annotations

import copy

import torch

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def save_tiny_qwen2_vl(path, tokenizer, seed: int = 0, version: str = "2") -> str:
    """version "2": Qwen2-VL; "2.5": Qwen2.5-VL (window attention over 24-pixel windows,
    blocks 1 full attention)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLConfig, Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    vocab = (len(tokenizer) + 63) // 64 * 64
    if version == "2":
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                      patch_size=6, spatial_merge_size=2, temporal_patch_size=2)
    else:
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48,
                      num_heads=4, patch_size=6, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=24, fullatt_block_indexes=[1])
    config = config_cls(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rms_norm_eps=1e-5,
                         bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight") or "ln_q.weight" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif param.dim() > 1:
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 12 * 12 * 4, "longest_edge": 48 * 48},
                             patch_size=6, temporal_patch_size=2, merge_size=2
                             ).save_pretrained(path)
    return str(path)

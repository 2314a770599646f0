"""Gemma 2 against transformers: soft-capped attention scores and logits, alternating
sliding-window/global layers, scaled embeddings, (1 + weight) sandwich norms, GeGLU."""

from __future__ import annotations

from transformers import Gemma2Config

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, assert_same, hf_greedy,
                         pagoda_greedy, random_prompts, save_tiny_checkpoint)
from pagoda import LLM
from pagoda.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig, SlidingWindowConfig
from pagoda.model.architectures.gemma2 import Gemma2ForCausalLM, GemmaSettings, gemma2_arch_config
from pagoda.model.loader import load_arch_config
from pagoda.model.registry import MODEL_REGISTRY


def test_gemma2_greedy_and_logprobs_match_transformers(tmp_path, smollm2_tokenizer):
    # Small caps (2 on scores, 3 on logits) so tanh really bends them; a scalar that
    # differs from head_dim so the attention scale is checked too.
    config = Gemma2Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, max_position_embeddings=256, sliding_window=8,
                          query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                          final_logit_softcapping=3.0)
    path = save_tiny_checkpoint(tmp_path, config, smollm2_tokenizer)
    arch = load_arch_config(path)
    assert MODEL_REGISTRY.resolve(arch.architecture).model_cls is Gemma2ForCausalLM
    assert arch.sliding_window.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION) * 2
    assert arch.family_settings == GemmaSettings(24.0, 2.0, 3.0)
    assert arch.kv_cache_sliding_window is None  # the global layers need every block
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.tie_word_embeddings
    llm = assert_matches_transformers(path, random_prompts([5, 23, 41]), 16)
    assert llm.llm_engine.config.cache.sliding_window is None


def test_gemma2_config_without_layer_types_alternates_from_a_sliding_layer():
    # Checkpoints saved before transformers named `layer_types` (google/gemma-2-2b).
    arch = ModelArchConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=3,
                           num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                           sliding_window=SlidingWindowConfig(4096))
    hf_config = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                 "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"}
    arch = gemma2_arch_config(hf_config, arch)
    assert [arch.layer_sliding_window(i) for i in range(3)] == [4096, None, 4096]
    settings = GemmaSettings.from_hf_config(hf_config, arch)
    assert settings.query_pre_attn_scalar == 256 and settings.attn_logit_softcapping == 50.0


def test_a_prompt_prefilled_alone_matches_transformers(tmp_path, smollm2_tokenizer):
    """A step holding one lone prefill (one request at a time, as LLM.generate([p]) or a
    server mostly runs): soft-capped attention's output was a strided view the output
    projection could not take, and every such step failed."""
    config = Gemma2Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, max_position_embeddings=256, sliding_window=8,
                          attn_logit_softcapping=2.0)
    path = save_tiny_checkpoint(tmp_path, config, smollm2_tokenizer)
    llm = LLM(model=path, dtype="float32", block_size=16, num_gpu_blocks_override=64)
    prompt = random_prompts([20])[0]
    assert_same(pagoda_greedy(llm, [prompt], 6)[0], hf_greedy(path, [prompt], 6))

"""GGUF loading: llama.cpp's names and Q/K permutation undone; SmolLM2 equals transformers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagoda.model.architectures.llama import LLAMA_GGUF_LAYOUT
from pagoda.model.gguf_loader import unpermute_rotary_rows
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.loader import load_arch_config, load_model


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize("shape,heads", [((12 * 8, 5), 12), ((3 * 64, 576), 3), ((4 * 16,), 4)])
def test_unpermute_inverts_llama_cpp_permute(shape, heads):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rotary_rows(permuted, heads), w)


def test_tensor_names_map_to_hf():
    hf_tensor_name = LLAMA_GGUF_LAYOUT.hf_tensor_name
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def shard_rows(arch) -> dict[str, tuple[int, int]]:
    """HF shard name -> (first row, number of rows) inside its fused Llama parameter."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    inter = arch.intermediate_size
    return {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv),
            "gate_proj": (0, inter), "up_proj": (inter, inter)}


def our_tensor(model, hf_name: str) -> torch.Tensor:
    """Our parameter (or its row range in a fused one) holding HF weight `hf_name`."""
    params = dict(model.named_parameters())
    for fused, shards in model.packed_modules_mapping.items():
        for shard in shards:
            if f".{shard}." in hf_name:
                start, rows = shard_rows(model.arch)[shard]
                return params[hf_name.replace(f".{shard}.", f".{fused}.")][start:start + rows]
    return params[hf_name]


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf_path):
    from transformers import AutoModelForCausalLM

    arch = load_arch_config(smollm2_gguf_path)
    ours = load_model(smollm2_gguf_path, arch, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf_path),
                                              gguf_file=os.path.basename(smollm2_gguf_path),
                                              dtype=torch.float32).eval()
    return ours, hf


@pytest.mark.slow
def test_smollm2_arch_config(smollm2_gguf_path):
    arch = load_arch_config(smollm2_gguf_path)
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (49152, 576, 1536)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (30, 9, 3)
    assert arch.head_dim == 64 and arch.rope_theta == 100000.0 and arch.rope_scaling is None
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert arch.max_position_embeddings == 8192 and arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.bos_token_id == 1 and arch.eos_token_ids == [2]


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_bit_for_bit(smollm2_pair):
    ours, hf = smollm2_pair
    hf_state = hf.state_dict()
    names = [n for n in hf_state if n != "lm_head.weight"]  # tied: the embedding itself
    assert len(names) == 1 + 30 * 9 + 1
    for name in names:
        assert torch.equal(our_tensor(ours, name), hf_state[name]), name


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_pair, smollm2_tokenizer, paged_sequences):
    ours, hf = smollm2_pair
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True)
    tokens = smollm2_tokenizer(prompt).input_ids
    seqs = paged_sequences(num_blocks=16, block_size=16)
    seqs.add("a", tokens)
    kv_caches = allocate_kv_caches(ours.arch, 16, 16, torch.float32, "cpu")
    with torch.inference_mode():
        # A prefill of all but the last token, then the last one as a decode.
        logits = []
        for n in (len(tokens) - 1, 1):
            input_ids, positions, md = seqs.step([("a", n)])
            logits.append(ours.compute_logits(ours(input_ids, positions, kv_caches, md)))
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits[1].argmax(-1), expected[-1:].argmax(-1))

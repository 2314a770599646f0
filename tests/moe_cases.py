"""Tiny random Mixtral, Qwen3-MoE and Qwen2-MoE checkpoints (transformers' own config classes and
save_pretrained) for the MoE tests of tests/model and tests/distributed, and the
metadata of a one-request prefill for calling a model directly."""

from __future__ import annotations

import torch

from pagoda.model.attention_metadata import AttentionMetadata

# 4 experts, 2 per token; intermediate 32 splits over 2 ranks, 4 experts place 2 a rank.
TINY_MIXTRAL = dict(vocab_size=49152, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                    initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2)


def save_tiny_mixtral(path, tokenizer=None, **overrides) -> str:
    """Save a seeded random Mixtral (fp32) to `path`; returns the path."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return _save(MixtralForCausalLM(MixtralConfig(**{**TINY_MIXTRAL, **overrides})), path,
                 tokenizer)


TINY_QWEN3_MOE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      mlp_only_layers=[1], max_position_embeddings=512, initializer_range=0.2,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2)


def save_tiny_qwen3_moe(path, tokenizer=None, **overrides) -> str:
    """A seeded random Qwen3-MoE (layer 1 dense) in `path`; returns the path."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return _save(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})),
                 path, tokenizer)


TINY_QWEN2_MOE = {**{k: v for k, v in TINY_QWEN3_MOE.items() if k != "head_dim"},
                  "shared_expert_intermediate_size": 64}


def save_tiny_qwen2_moe(path, tokenizer=None, **overrides) -> str:
    """A seeded random Qwen2-MoE (layer 1 dense, a gated shared expert) in `path`."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return _save(Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**TINY_QWEN2_MOE, **overrides})),
                 path, tokenizer)


def _save(model, path, tokenizer) -> str:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)  # a router that spreads tokens over every expert
    model.eval().save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


def hf_greedy(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (fp32): the reference tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                          min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prefill_metadata(n: int, block_size: int = 4) -> AttentionMetadata:
    blocks = -(-n // block_size)
    return AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n]),
                             seq_lens=torch.tensor([n]),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                             num_decodes=0, max_query_len=n, max_seq_len=n,
                             query_start_loc_cpu=[0, n], seq_lens_cpu=[n])

"""Tiny random gpt-oss (attention sinks, alternating sliding/full layers) and DeepSeek-V3
(MLA over a latent cache) with every `pagoda.model.ops` call on the Triton kernels.

Without a GPU the switch is forced on CPU tensors and the interpreter runs the kernels
(as `test_ops_switch.py` does for Llama and Gemma); nothing pretends to be CUDA. A
driver steps the model like the runner does: request A prefills alone, then A's
decode and B's prefill share a step (decode and prefill kernels in one call), then
both decode, past gpt-oss's window. Greedy tokens must equal transformers' (fp32,
eager) and every step's logits the torch path's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig

from pagoda.model import ops
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.random_checkpoint import random_hf_model

VOCAB = 128
BLOCK = 4
NEW_TOKENS = 6
PROMPTS = [[5, 17, 2, 90, 41, 7, 7, 30, 11, 64, 3, 99, 12], [8, 8, 33, 60, 1, 2, 3, 4, 77, 15]]


def gpt_oss_config() -> GptOssConfig:
    # Window 4 < every prompt: the sliding layers really cut keys off.
    return GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=4, max_position_embeddings=256, swiglu_limit=1.5)


def deepseek_v3_config() -> DeepseekV3Config:
    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                            num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=2,
                            max_position_embeddings=256, tie_word_embeddings=False,
                            q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=True, num_nextn_predict_layers=0)


CONFIGS = {"gpt_oss": gpt_oss_config, "deepseek_v3": deepseek_v3_config}


def save_checkpoint(path, config):
    """A random checkpoint (`random_hf_model`); returns the transformers model."""
    model = random_hf_model(config)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy_steps(model, arch, device) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of both prompts and each step's logits (A alone; A decoding with B
    prefilling; then both decoding), over a block table scattered across the cache."""
    caches = allocate_kv_caches(arch, 32, BLOCK, torch.float32, device)
    tables = [[3, 17, 9, 22, 5, 30], [12, 1, 26, 7, 19, 14]]
    seqs = [list(PROMPTS[0]), list(PROMPTS[1])]
    done = [0, None]  # tokens already in the cache per request; None: not started
    all_logits = []
    for step in range(NEW_TOKENS + 1):
        if step == 1:
            done[1] = 0
        active = [i for i in (0, 1) if done[i] is not None and len(seqs[i]) - len(PROMPTS[i])
                  < NEW_TOKENS]
        active.sort(key=lambda i: len(seqs[i]) - done[i] != 1)  # decodes first
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for i in active:
            for p in range(done[i], len(seqs[i])):
                ids.append(seqs[i][p])
                pos.append(p)
                slots.append(tables[i][p // BLOCK] * BLOCK + p % BLOCK)
            qsl.append(len(ids))
            seq_lens.append(len(seqs[i]))

        def t(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        num_decodes = sum(1 for a, b in zip(qsl, qsl[1:]) if b - a == 1)
        md = AttentionMetadata(t(slots), t(qsl, torch.int32), t(seq_lens, torch.int32),
                               t([tables[i] for i in active], torch.int32),
                               num_decodes=num_decodes,
                               max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
                               max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
                               seq_lens_cpu=seq_lens)
        hidden = model(t(ids), t(pos), caches, md)
        logits = model.compute_logits(hidden[[q - 1 for q in qsl[1:]]])
        all_logits.append(logits)
        for i, tok in zip(active, logits.argmax(-1).tolist()):
            done[i] = len(seqs[i])
            seqs[i].append(tok)
    return [s[len(p):] for s, p in zip(seqs, PROMPTS)], all_logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_model_on_triton_kernels_matches_transformers(tmp_path, device, monkeypatch, name):
    hf_model = save_checkpoint(tmp_path, CONFIGS[name]())
    arch = load_arch_config(str(tmp_path))
    model = load_model(str(tmp_path), arch, torch.float32).to(device)
    with torch.no_grad():
        monkeypatch.setattr(ops, "use_triton", lambda t: False)
        torch_tokens, torch_logits = greedy_steps(model, arch, device)
        monkeypatch.setattr(ops, "use_triton", lambda t: True)
        tokens, logits = greedy_steps(model, arch, device)
    assert tokens == [hf_greedy(hf_model, p) for p in PROMPTS]
    assert tokens == torch_tokens
    for got, want in zip(logits, torch_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

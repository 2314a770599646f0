"""gpu_check's checks for gpt-oss (attention sinks + sliding window) and DeepSeek MLA
(576-wide heads over one KV head) on the Triton attention.

Kernels: sink and MLA cases against `pagoda.kernels.reference` (bf16 and fp32; decode,
split-K, mixed prefill+decode, sliding window). Under the CPU interpreter these all
pass (tests/kernels); on a GPU they also tell whether the wide-head tiles
(`kernels/_checks.tile_config`) fit its shared memory and registers, which the
interpreter cannot. Greedy: tiny random gpt-oss and DeepSeek-V3 through `pagoda.LLM`
in fp32 against HF `generate` (gpt-oss decodes eager: its expert loop syncs to the
host; DeepSeek's decodes replay CUDA graphs). A few seconds each on a GPU, plus the
kernel compiles.
"""

from __future__ import annotations

import tempfile

import torch

import gpu_harness as h
from pagoda.model.random_checkpoint import random_hf_model

ATTENTION_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _cases(small: bool) -> list[tuple]:
    """(name, requests, heads, kv_heads, head_dim, dtype, sinks, window, num_splits, mla)."""
    if small:
        decodes = [(5, 1), (40, 1), (0, 1), (90, 1)]
        mixed = [(3, 1), (50, 1), (0, 7), (13, 5), (33, 25)]
        long_decode = [(400, 1), (30, 1)]
        window = 8
    else:
        decodes = [(c, 1) for c in (1, 17, 300, 1024, 2047, 4000)] * 4
        mixed = [(100, 1), (2000, 1), (0, 300), (512, 77), (33, 1000)]
        long_decode = [(16000, 1), (300, 1)]
        window = 128  # gpt-oss's
    bf16, fp32 = torch.bfloat16, torch.float32
    return [  # gpt-oss: 64 query heads, 8 KV heads, head dim 64 (TP=1)
        ("sinks/decode_gqa8_d64", decodes, 64, 8, 64, bf16, True, None, None, False),
        ("sinks/decode_splitk_long_ctx", long_decode, 64, 8, 64, bf16, True, None, None, False),
        ("sinks/decode_splitk_forced4_fp32", decodes, 64, 8, 64, fp32, True, None, 4, False),
        ("sinks/mixed_gqa8_d64", mixed, 64, 8, 64, bf16, True, None, None, False),
        ("sinks/mixed_gqa8_d64_fp32", mixed, 64, 8, 64, fp32, True, None, None, False),
        ("sinks/sliding_mixed", mixed, 64, 8, 64, bf16, True, window, None, False),
        ("sinks/sliding_splitk_fp32", long_decode, 64, 8, 64, fp32, True, window, 3, False),
        # DeepSeek-V3 MLA: 576 = 512 latent + 64 rope, one KV head; 16 heads (TP=8) and 128 (TP=1)
        ("mla/decode_d576_h16", decodes, 16, 1, 576, bf16, False, None, None, True),
        ("mla/decode_d576_h128", decodes, 128, 1, 576, bf16, False, None, None, True),
        ("mla/decode_splitk_d576_h16", long_decode, 16, 1, 576, bf16, False, None, None, True),
        ("mla/mixed_d576_h16", mixed, 16, 1, 576, bf16, False, None, None, True),
        ("mla/mixed_d576_h16_fp32", mixed, 16, 1, 576, fp32, False, None, None, True),
    ]


def check_family_kernels(report, device: torch.device, small: bool) -> None:
    from pagoda.kernels import reference as ref
    from pagoda.kernels.attention import paged_attention
    from pagoda.kernels.kv_cache import write_kv_cache
    from pagoda.kernels.testing import random_paged_batch, relative_error

    for name, requests, heads, kv_heads, dim, dtype, with_sinks, window, splits, mla in _cases(small):
        try:
            b = random_paged_batch(requests, heads, kv_heads, dim, 16, dtype, device,
                                   seed=len(requests))
            md = b.attn_metadata
            value, value_cache = (b.key, b.key_cache) if mla else (b.value, b.value_cache)
            write_kv_cache(b.key, value, b.key_cache, value_cache, md.slot_mapping)
            sinks = None
            if with_sinks:
                g = torch.Generator().manual_seed(heads)
                sinks = (1.5 * torch.randn(heads, generator=g) + 3.0).to(dtype).to(device)
            scale = dim ** -0.5
            got = paged_attention(b.query, b.key_cache, value_cache, md, scale, num_splits=splits,
                                  sliding_window=window, sinks=sinks)
            want = ref.paged_attention(b.query, b.key_cache, value_cache, md, scale,
                                       sliding_window=window, sinks=sinks)
            err = relative_error(got, want)
            tol = ATTENTION_TOL[dtype]
            report.check("kernels", f"attention/{name}", err, tol, err < tol,
                         f"{len(requests)} reqs, max ctx {md.max_seq_len}, {str(dtype)[6:]}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next case runs
            report.error("kernels", f"attention/{name}", exc)


def _gpt_oss_config(vocab: int):
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=8, max_position_embeddings=512, swiglu_limit=1.5)


def _deepseek_v3_config(vocab: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                            num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=2,
                            max_position_embeddings=512, tie_word_embeddings=False,
                            q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=True, num_nextn_predict_layers=0)


def check_family_greedy(report, device: torch.device, small: bool) -> None:
    """Tiny gpt-oss and DeepSeek-V3, fp32, `pagoda.LLM` (Triton kernels) vs HF generate."""
    from gpu_check_sections import (_compare_greedy, _random_prompts, _write_word_tokenizer,
                                    count_attention_calls)

    try:
        from pagoda import LLM, SamplingParams

        LLM.__name__  # noqa: B018 - resolves the lazy import (needs the whole engine + gguf)
    except Exception as exc:  # noqa: BLE001
        report.skip("greedy", "families", f"pagoda.LLM unavailable: {exc}")
        return
    vocab = 128
    lengths, max_tokens = ([5, 13], 6) if small else ([3, 17, 40, 100], 24)
    prompts = _random_prompts(lengths, vocab, seed=1)
    for family, make_config in (("gpt_oss", _gpt_oss_config), ("deepseek_v3", _deepseek_v3_config)):
        name = f"{family}_LLM_vs_hf/float32"
        try:
            hf = random_hf_model(make_config(vocab)).to(device)
            expected = h.hf_greedy(hf, prompts, max_tokens, device)
            with tempfile.TemporaryDirectory() as tmp:
                hf.save_pretrained(tmp)
                _write_word_tokenizer(tmp, vocab)
                llm = LLM(model=tmp, dtype="float32", device=device.type, max_model_len=256,
                          num_gpu_blocks_override=256, block_size=16)
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                with count_attention_calls() as calls:
                    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                        use_tqdm=False)
                got = [list(o.outputs[0].token_ids) for o in outs]
                del llm
            matches, ties_only, why = _compare_greedy(hf, prompts, expected, got, device)
            report.check("greedy", name, f"{matches}/{len(prompts)}", "all",
                         ties_only and calls[0] > 0, f"{calls[0]} eager Triton attention calls{why}")
        except Exception as exc:  # noqa: BLE001
            report.error("greedy", name, exc)


"""Mixtral (mixture of experts) against transformers on a tiny random checkpoint: the
router's top-k, the renormalised weights and every expert's SwiGLU must agree."""

from __future__ import annotations

import pytest
import torch
from moe_cases import hf_greedy, prefill_metadata, save_tiny_mixtral

from pagoda import LLM, SamplingParams
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.moe import experts_by_group, select_experts


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_mixtral(tmp_path_factory.mktemp("mixtral"), smollm2_tokenizer)


def test_config_and_parameters(mixtral_dir):
    arch = load_arch_config(mixtral_dir)
    assert (arch.architecture, arch.num_experts, arch.num_experts_per_tok, arch.norm_topk_prob) \
        == ("MixtralForCausalLM", 4, 2, True)
    model = load_model(mixtral_dir, arch, torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.shape == (4, 64, 64) and experts.w2_weight.shape == (4, 64, 32)


def test_prefill_logits_match_transformers(mixtral_dir):
    from transformers import AutoModelForCausalLM

    arch = load_arch_config(mixtral_dir)
    model = load_model(mixtral_dir, arch, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 49152, (23,), generator=torch.Generator().manual_seed(3))
    kv = allocate_kv_caches(arch, 8, 4, torch.float32, "cpu")
    with torch.inference_mode():
        ours = model.compute_logits(model(tokens, torch.arange(23), kv, prefill_metadata(23)))
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_through_llm_equal_transformers(mixtral_dir):
    prompts = [[5, 17, 300, 42, 7, 8, 9], list(range(300, 320))]
    llm = LLM(model=mixtral_dir, dtype="float32", block_size=4, max_model_len=128,
              num_gpu_blocks_override=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.llm_engine.core.shutdown()
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(mixtral_dir, prompt, 10)


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_is_softmax_top_k(renormalize):
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids = select_experts(logits, 2, renormalize)
    assert ids.tolist() == [[1, 2], [3, 0]]
    probs = torch.softmax(logits, dim=-1)
    expected = probs.gather(1, ids)
    if renormalize:  # Mixtral / norm_topk_prob: the k weights sum to 1
        expected = expected / expected.sum(dim=1, keepdim=True)
    torch.testing.assert_close(weights, expected)


def test_experts_by_group_equals_a_per_token_loop():
    # The batched path (sort pairs by expert, one matmul pair per expert) against the
    # obvious per-token computation; expert 3 gets no token, expert 0 several.
    torch.manual_seed(0)
    x, w13, w2 = torch.randn(6, 8), torch.randn(4, 10, 8), torch.randn(4, 8, 5)
    ids = torch.tensor([[0, 1], [0, 2], [1, 0], [2, 0], [0, 1], [1, 2]])
    out = experts_by_group(x, ids, w13, w2, expert_start=0)
    for t in range(6):
        for slot in range(2):
            e = ids[t, slot]
            gate, up = (w13[e] @ x[t]).chunk(2)
            want = w2[e] @ (torch.nn.functional.silu(gate) * up)
            torch.testing.assert_close(out[t * 2 + slot], want, atol=1e-5, rtol=1e-5)
    # A rank holding experts 2..3 only: pairs of experts 0 and 1 are zero rows.
    part = experts_by_group(x, ids, w13[2:], w2[2:], expert_start=2)
    held = (ids.reshape(-1) >= 2)
    assert torch.equal(part[~held], torch.zeros_like(part[~held]))
    torch.testing.assert_close(part[held], out[held])

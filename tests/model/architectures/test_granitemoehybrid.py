"""GraniteMoeHybrid (Granite-4.0-H) against transformers: Mamba2 layers between
attention layers, their recurrent state carried across prefill chunks (the token budget
of 16 splits every prompt; mamba_chunk_size 8 splits each chunk's scan) and decode
steps, rebuilt after preemption, restored from state checkpoints on prefix-cache hits,
rewound past rejected drafts under n-gram and draft-model speculation; and what the
family refuses at start-up."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GraniteMoeHybridConfig, LlamaConfig

from arch_parity import (ENGINE, VOCAB_SIZE, assert_matches_transformers, assert_same,
                         cache_runner, hf_greedy, pagoda_greedy, random_prompts,
                         save_tiny_checkpoint)
from pagoda import LLM
from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from pagoda.model.loader import load_arch_config
from pagoda.model.mamba2 import Mamba2Mixer

LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def granite_hybrid_config(**overrides) -> GraniteMoeHybridConfig:
    values = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32,
                  shared_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                  layer_types=LAYERS, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                  mamba_n_groups=2, mamba_chunk_size=8, max_position_embeddings=256,
                  embedding_multiplier=1.5, residual_multiplier=0.7, logits_scaling=1.3,
                  attention_multiplier=0.2, tie_word_embeddings=False)
    return GraniteMoeHybridConfig(**{**values, **overrides})


@pytest.mark.parametrize("overrides", [
    dict(position_embedding_type="rope"),
    dict(position_embedding_type=None),  # NoPE, as Granite-4.0-H
    dict(position_embedding_type=None, num_local_experts=0),  # shared MLP only
], ids=["rope-moe", "nope-moe", "nope-dense"])
def test_granite_hybrid_greedy_and_logprobs_match_transformers(tmp_path, smollm2_tokenizer,
                                                               overrides):
    path = save_tiny_checkpoint(tmp_path, granite_hybrid_config(**overrides), smollm2_tokenizer)
    arch = load_arch_config(path)
    assert arch.mamba.layers == (0, 2, 3)
    llm = assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)
    model = llm.llm_engine.core.executor.runner.model
    assert sum(isinstance(m, Mamba2Mixer) for m in model.modules()) == 3
    # The second pass started from prefix hits (every request: assert_matches_transformers)
    # restored from state checkpoints at block boundaries.
    assert llm.llm_engine.config.cache.enable_prefix_caching is True


def test_preemption_rebuilds_the_mamba_state(tmp_path, smollm2_tokenizer):
    """A pool too small for the batch preempts requests; their state slots are freed
    and the state recomputed from the tokens: tokens and logprobs still equal HF's."""
    path = save_tiny_checkpoint(tmp_path, granite_hybrid_config(), smollm2_tokenizer)
    prompts = random_prompts([7, 30, 45])
    reference = hf_greedy(path, prompts, 16)
    llm = LLM(model=path, **{**ENGINE, "num_gpu_blocks_override": 24})
    ours, _ = pagoda_greedy(llm, prompts, 16)
    assert_same(ours, reference)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    again, _ = pagoda_greedy(llm, prompts, 16)  # every slot came back
    assert_same(again, reference)


def test_mamba_layers_hold_no_kv_blocks(tmp_path, smollm2_tokenizer):
    """A block costs the attention layer alone; each Mamba layer's cache pair is its
    per-request state pool."""
    path = save_tiny_checkpoint(tmp_path, granite_hybrid_config(), smollm2_tokenizer)
    arch = load_arch_config(path)
    # one attention layer: 2 KV heads x 16 dims, keys and values, fp32, 4 tokens a block
    assert kv_cache_bytes_per_block(arch, 4, torch.float32) == 4 * 2 * 16 * 2 * 4
    caches = allocate_kv_caches(arch, 10, 4, torch.float32, "cpu", num_state_slots=3)
    conv_dim = 8 * 16 + 2 * 2 * 16
    assert caches[0][0].shape == (3, conv_dim, 3)
    assert caches[0][1].shape == (3, 8, 16, 16) and caches[0][1].dtype == torch.float32
    assert caches[1][0].shape == (10, 4, 2, 16)


def test_prefix_caching_keeps_state_checkpoints(tmp_path, smollm2_tokenizer, caplog):
    """Prefix caching stays on, with one state checkpoint slot per running request
    (pagoda.core.state_checkpoints); without it, none."""
    path = save_tiny_checkpoint(tmp_path, granite_hybrid_config(), smollm2_tokenizer)
    with caplog.at_level(logging.INFO):
        config = EngineArgs(model=path, dtype="float32", max_num_seqs=6,
                            enable_prefix_caching=True).create_engine_config()
    assert config.cache.enable_prefix_caching is True
    assert config.cache.num_state_checkpoints == 6
    assert "keeps its Mamba2 layers' state at block boundaries" in caplog.text
    off = EngineArgs(model=path, dtype="float32",
                     enable_prefix_caching=False).create_engine_config()
    assert off.cache.num_state_checkpoints == 0


def repetitive_prompts() -> list[list[int]]:
    """Prompts made of repeated snippets, so the n-gram proposer finds matches (and the
    random model mostly rejects them), plus a plain random one."""
    g = torch.Generator().manual_seed(1)
    snippets = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (3, 5)]
    return [snippets[0] * 6, snippets[1] * 4 + snippets[0], *random_prompts([20])[:1]]


@pytest.fixture
def draft_dir(tmp_path, smollm2_tokenizer) -> str:
    """A random two-layer Llama draft of the same vocabulary: a poor draft."""
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
    return save_tiny_checkpoint(tmp_path / "draft", config, smollm2_tokenizer, seed=3)


# Tied embeddings, a large embedding and a small residual multiplier: the greedy output
# runs into repeats of a token (after a few changes), so n-gram drafts are accepted in
# part, while the Mamba and attention layers still decide where the runs change.
REPEATING = dict(tie_word_embeddings=True, embedding_multiplier=4.0, residual_multiplier=0.3)


@pytest.mark.parametrize("method,overrides", [("ngram", REPEATING), ("ngram", {}),
                                              ("draft", {})],
                         ids=["ngram-accepts-some", "ngram-rejects", "draft-rejects"])
def test_speculative_decoding_gives_the_greedy_tokens_of_plain_decoding(
        tmp_path, smollm2_tokenizer, draft_dir, method, overrides):
    """vLLM's hybrid bug (#39273): rejected drafts must leave nothing in the Mamba
    state. Verification keeps the state after each draft and rewinds to the last
    accepted one: tokens and logprobs equal transformers' with drafts rejected (and,
    with `REPEATING`, partly accepted)."""
    path = save_tiny_checkpoint(tmp_path / "target", granite_hybrid_config(**overrides),
                                smollm2_tokenizer)
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1} if method == "ngram"
            else {"model": draft_dir, "num_speculative_tokens": 3})
    prompts = repetitive_prompts()
    reference = hf_greedy(path, prompts, 24)
    llm = LLM(model=path, **{**ENGINE, "speculative_config": spec})
    ours, _ = pagoda_greedy(llm, prompts, 24)
    assert_same(ours, reference)
    stats = llm.llm_engine.core.get_stats().spec_decoding
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some were rejected
    if overrides:
        assert stats.num_accepted_tokens > 0
        # some verification accepted a draft and rejected the next one
        assert stats.accepted_per_pos[0] > stats.accepted_per_pos[-1]


def test_a_hybrid_draft_model_is_refused(tmp_path, smollm2_tokenizer):
    target = save_tiny_checkpoint(tmp_path / "a", granite_hybrid_config(), smollm2_tokenizer)
    with pytest.raises(ValueError, match="a hybrid draft model \\(GraniteMoeHybridForCausalLM"):
        EngineArgs(model=target, dtype="float32", speculative_config={
            "model": target, "num_speculative_tokens": 2}).create_engine_config()


@pytest.mark.parametrize("args", [dict(tensor_parallel_size=2),
                                  dict(pipeline_parallel_size=2),
                                  dict(enable_lora=True), dict(async_scheduling=True),
                                  dict(kv_offloading_size=0.01)],
                         ids=["tp", "pp", "lora", "async-scheduling", "kv-offloading"])
def test_parallelism_and_lora_are_refused(tmp_path, smollm2_tokenizer, args):
    path = save_tiny_checkpoint(tmp_path, granite_hybrid_config(), smollm2_tokenizer)
    with pytest.raises(ValueError, match="GraniteMoeHybridForCausalLM"):
        EngineArgs(model=path, dtype="float32", **args).create_engine_config()


def test_moving_kv_blocks_is_refused_by_name(tmp_path, smollm2_tokenizer):
    """P/D and the prefix pull ask the worker's KV geometry: the Mamba state is not in
    the blocks, so a hybrid model answers NotImplementedError naming the architecture."""
    from pagoda.kv_transfer.block_shares import runner_geometry

    path = save_tiny_checkpoint(tmp_path, granite_hybrid_config(), smollm2_tokenizer)
    with pytest.raises(NotImplementedError, match="GraniteMoeHybridForCausalLM is a hybrid "
                                                  "model with Mamba2 layers"):
        runner_geometry(cache_runner(path))


def test_a_request_without_its_state_is_refused():
    """A request that arrives with computed tokens and no state checkpoint (pulled or
    transferred KV blocks) has no Mamba state here: refused by name, never run from a
    zero state; one with a checkpoint gets a copy of it."""
    from pagoda.worker.recurrent_state import RecurrentStateSlots

    slots = RecurrentStateSlots(2)
    caches = [(torch.ones(2, 3, 3), torch.ones(2, 1, 1, 1))]
    assert slots.assign(["a"], [0], caches, [0]) == [0]
    assert caches[0][0][0].abs().sum() == 0 and caches[0][0][1].sum() == 9
    with pytest.raises(RuntimeError, match="request 'b' starts at token 5 but its Mamba state"):
        slots.assign(["b"], [5], caches, [0])
    slots.release("a")
    assert slots.assign(["c"], [0], caches, [0]) == [0]
    pools = [(torch.zeros(3, 3, 3), torch.zeros(3, 1, 1, 1))]  # 2 slots + 1 checkpoint
    pools[0][0][2].fill_(7.0)
    pools[0][1][2].fill_(5.0)
    assert slots.assign(["d"], [8], pools, [0], {"d": 0}) == [1]
    assert pools[0][0][1].sum() == 63 and pools[0][1][1].sum() == 5


def test_sleep_and_wake_up_restore_the_kv_blocks_and_state_pools(tmp_path, smollm2_tokenizer):
    """Waking up re-allocates as many KV blocks as before (not the first layer's
    length, which is a Mamba state pool here) and the same state pools."""
    path = save_tiny_checkpoint(tmp_path, granite_hybrid_config(), smollm2_tokenizer)
    prompts = random_prompts([7, 30])
    llm = LLM(model=path, **{**ENGINE, "enable_sleep_mode": True})
    before, _ = pagoda_greedy(llm, prompts, 8)
    [kv] = llm.collective_rpc("kv_cache_bytes")
    llm.sleep(level=1)
    llm.wake_up()
    assert llm.collective_rpc("kv_cache_bytes") == [kv]
    after, _ = pagoda_greedy(llm, prompts, 8)
    assert_same(after, before)

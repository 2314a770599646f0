"""`LLM(..., tensor_parallel_size=T, pipeline_parallel_size=P)` on real process groups
(the `mp` backend: one process per follower rank): the same tokens as one device,
with each rank holding only its share of the weights and the KV cache."""

from __future__ import annotations

import pytest
from group_cases import GREEDY_PROMPTS, engine_kwargs, greedy_params

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def groups(tiny_llama_dir):
    """One LLM per (T, P), started on demand and shut down after the module."""
    started: dict[tuple[int, int], LLM] = {}

    def get(tp: int, pp: int) -> LLM:
        if (tp, pp) not in started:
            started[(tp, pp)] = LLM(model=tiny_llama_dir, tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp, distributed_executor_backend="mp",
                                    **engine_kwargs())
        return started[(tp, pp)]

    yield get
    for llm in started.values():
        llm.llm_engine.core.shutdown()


SPLITS = [(2, 1), (1, 2), (2, 2), (4, 1)]


@pytest.mark.parametrize("tp,pp", SPLITS)
def test_greedy_tokens_equal_one_device(groups, reference, tp, pp):
    llm = groups(tp, pp)
    outputs = llm.generate(GREEDY_PROMPTS, greedy_params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference.token_ids
    # A second batch on the same group: the ranks' batch states were cleaned up.
    again = llm.generate(GREEDY_PROMPTS[:2], greedy_params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference.token_ids[:2]


def replicated_kv_projection_bytes(arch, tp: int) -> int:
    """Extra bytes per rank when there are fewer KV heads than ranks: each rank keeps
    a whole KV head's k and v rows instead of a 1/T share of them."""
    kv_rows = arch.num_key_value_heads * arch.head_dim
    per_rank_rows = max(arch.head_dim, kv_rows // tp)
    return 2 * (per_rank_rows - kv_rows / tp) * arch.hidden_size * 4 * arch.num_hidden_layers


@pytest.mark.parametrize("tp,pp", SPLITS)
def test_each_rank_holds_its_share(groups, reference, tp, pp):
    llm = groups(tp, pp)
    report = llm.llm_engine.core.executor.memory_report()
    assert [r["rank"] for r in report] == list(range(tp * pp))
    params = [r["parameter_bytes"] for r in report]
    kv = [r["kv_cache_bytes"] for r in report]
    if pp == 1:
        # Sharded matrices split T ways; every rank keeps its own copy of the norms (and,
        # with 4 ranks for the tiny model's 2 KV heads, of one KV head's projections).
        sharded = reference.parameter_bytes - reference.replicated_bytes
        extra = replicated_kv_projection_bytes(llm.llm_engine.config.arch, tp)
        assert params == [sharded / tp + reference.replicated_bytes + extra] * tp
        # KV cache: 2 heads split over 2 ranks; over 4, one replicated head each.
        assert kv == [reference.kv_cache_bytes // min(tp, 2)] * tp
    else:
        # Stages split the layers: parameters and KV cache add up to the whole, per TP slice.
        for tp_rank in range(tp):
            stage_kv = sum(kv[s * tp + tp_rank] for s in range(pp))
            assert stage_kv == reference.kv_cache_bytes // tp
        assert max(params) < reference.parameter_bytes / tp


def test_logprobs_and_prompt_logprobs_match_one_device(groups, tiny_llama_dir):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    prompt = {"prompt_token_ids": GREEDY_PROMPTS[4]}
    single = LLM(model=tiny_llama_dir, **engine_kwargs())
    want = single.generate(prompt, params, use_tqdm=False)[0]
    single.llm_engine.core.shutdown()
    got = groups(2, 2).generate(prompt, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for ours, theirs in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert ours.keys() == theirs.keys()
        for token, lp in ours.items():
            assert lp.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
    for ours, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert ours.keys() == theirs.keys()


def test_preemption_and_chunked_prefill_stay_in_step(tiny_llama_dir, reference):
    """Too few KV blocks for the batch: requests are preempted and recomputed on every
    rank alike (the scheduler runs once, at the driver)."""
    kwargs = engine_kwargs(num_gpu_blocks_override=24)
    single = LLM(model=tiny_llama_dir, **kwargs)
    want = [o.outputs[0].token_ids for o in single.generate(GREEDY_PROMPTS, greedy_params(),
                                                            use_tqdm=False)]
    assert single.llm_engine.core.get_stats().num_preemptions > 0
    single.llm_engine.core.shutdown()
    group = LLM(model=tiny_llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2,
                distributed_executor_backend="mp", **kwargs)
    try:
        got = group.generate(GREEDY_PROMPTS, greedy_params(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want == reference.token_ids
        assert group.llm_engine.core.get_stats().num_preemptions > 0
    finally:
        group.llm_engine.core.shutdown()


def test_seeded_sampling_matches_one_device(groups, tiny_llama_dir):
    """Only the output rank samples; the others follow its tokens, so a seeded request
    draws the same stream as on one device."""
    prompts = [{"prompt_token_ids": p} for p in GREEDY_PROMPTS[:3]]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    single = LLM(model=tiny_llama_dir, **engine_kwargs())
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    single.llm_engine.core.shutdown()
    got = groups(2, 2).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.extended  # make test-extended: the tiny model's TP/PP grid above runs in make test
@pytest.mark.slow
def test_smollm2_split_three_ways_matches_one_device(smollm2_gguf_path):
    """The real model (GGUF, 9 heads, 3 KV heads): one query group per rank."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    kwargs = dict(model=smollm2_gguf_path, dtype="float32", max_model_len=256,
                  num_gpu_blocks_override=64)
    single = LLM(**kwargs)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    single.llm_engine.core.shutdown()
    del single
    group = LLM(tensor_parallel_size=3, distributed_executor_backend="mp", **kwargs)
    try:
        got = group.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    finally:
        group.llm_engine.core.shutdown()

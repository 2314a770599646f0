"""Batch-invariant mode end to end: a bf16 request's greedy tokens do not depend on
what else runs with it, on how its prompt is chunked, or on prefix-cache hits."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams

WORDS = ("the a cat dog sea star king river blue green runs jumps over under quickly "
         "slowly and or but").split()
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 150))) for _ in range(32)]


def _tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_32_greedy_streams_equal_their_solo_runs(tiny_llama_dir, prompts):
    # A small token budget chunks prompts at arbitrary points (one-token chunks too);
    # prefix caching makes the solo runs hit the blocks the batch left behind.
    llm = LLM(model=str(tiny_llama_dir), dtype="bfloat16", batch_invariant=True,
              max_num_batched_tokens=97, enable_prefix_caching=True)
    together = _tokens(llm, prompts)
    reversed_order = _tokens(llm, prompts[::-1])[::-1]
    assert reversed_order == together
    for i in (0, 7, 19, 31):
        assert _tokens(llm, [prompts[i]]) == [together[i]], i
    fresh = LLM(model=str(tiny_llama_dir), dtype="bfloat16", batch_invariant=True,
                enable_prefix_caching=False)
    assert _tokens(fresh, [prompts[3], prompts[11]]) == [together[3], together[11]]


def test_batch_invariant_flag_and_variables(monkeypatch, tiny_llama_dir):
    from pagoda.engine.arg_utils import EngineArgs

    def resolved(**kwargs) -> bool:
        return EngineArgs(model=str(tiny_llama_dir), device="cpu",
                          **kwargs).create_engine_config().batch_invariant

    monkeypatch.delenv("PAGODA_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert resolved() is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert resolved() is True
    assert resolved(batch_invariant=False) is False
    monkeypatch.setenv("PAGODA_BATCH_INVARIANT", "0")  # Pagoda's name wins over vLLM's
    assert resolved() is False

"""thinking_token_budget in the offline engine: greedy, the reasoning is exactly the
budget's length, then the end marker, with and without speculative decoding (n-gram
prompt lookup, and a draft model equal to the target, whose drafts are all accepted:
without the budget applied to every draft row they would run past it, vLLM's #39573).

The tiny random Llama (SmolLM2's tokenizer) never writes `</think>` by itself, so every
end marker seen here was forced; the prompt ends with `<think>` (a template that opens
the block), so reasoning starts at the first output token.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.repetition_detection import RepetitionDetectionParams, check_sequence_repetition

pytestmark = pytest.mark.slow  # three engines of the tiny model

REASONING = {"think_start_str": "<think>", "think_end_str": "</think>"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}
BUDGETS = [0, 1, 5, 13]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def markers(smollm2_tokenizer):
    ids = lambda s: smollm2_tokenizer.convert_tokens_to_ids(smollm2_tokenizer.tokenize(s))
    return ids("<think>"), ids("</think>")


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer, markers):
    start, _ = markers
    texts = ["Monday, Tuesday, Wednesday, Monday, Tuesday,", "2 + 2 = 4. 3 + 3 = 6.", "def f(x):"]
    return [{"prompt_token_ids": smollm2_tokenizer.encode(t) + start} for t in texts]


def _llm(model: str, **kwargs) -> LLM:
    # a small KV cache: three engines at the default size would take gigabytes
    return LLM(model, dtype="float32", seed=0, max_model_len=256, block_size=16,
               num_gpu_blocks_override=128,
               reasoning_config=REASONING, **kwargs)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return {"plain": _llm(tiny_llama_dir), "ngram": _llm(tiny_llama_dir, speculative_config=NGRAM),
            "draft": _llm(tiny_llama_dir, speculative_config={"model": tiny_llama_dir,
                                                             "num_speculative_tokens": 4})}


def _outputs(llm: LLM, prompts, budget: int | None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            thinking_token_budget=budget)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _find(tokens: list[int], marker: list[int]) -> int:
    return next((i for i in range(len(tokens)) if tokens[i:i + len(marker)] == marker), -1)


def test_unbudgeted_model_never_closes_its_thinking(engines, prompts, markers):
    """The precondition of the tests below: every end marker they see was forced."""
    assert all(_find(t, markers[1]) == -1 for t in _outputs(engines["plain"], prompts, None))


@pytest.mark.parametrize("engine", ["plain", "ngram", "draft"])
def test_reasoning_is_exactly_the_budget(engines, prompts, markers, engine):
    _, end = markers
    plain_free = _outputs(engines["plain"], prompts, None)
    for budget in BUDGETS:
        outputs = _outputs(engines[engine], prompts, budget)
        for tokens, free in zip(outputs, plain_free):
            assert _find(tokens, end) == budget, (engine, budget, tokens)
            assert tokens[:budget] == free[:budget]  # the budget changed nothing before it
            assert len(tokens) == MAX_TOKENS
        if engine != "plain":  # speculation changes no token (greedy)
            assert outputs == _outputs(engines["plain"], prompts, budget)


def test_drafts_were_verified_past_the_budget_point(engines, prompts):
    """Speculation really ran: the draft model's drafts are all accepted, so each step
    would have crossed the budget without the cut and the per-row rule."""
    before = engines["draft"].llm_engine.core.get_stats().spec_decoding.num_accepted_tokens
    _outputs(engines["draft"], prompts, 5)
    after = engines["draft"].llm_engine.core.get_stats().spec_decoding.num_accepted_tokens
    assert after - before > len(prompts) * 10


def test_repetition_detection_stops_a_real_loop(engines, prompts):
    """logit_bias makes the model write one token forever; detection ends it with vLLM's
    finish and stop reasons after min_count repeats, speculation or not."""
    loop = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={1000: 100.0})
    detect = SamplingParams(**loop, repetition_detection={"max_pattern_size": 3, "min_count": 4})
    for engine in ("plain", "ngram"):
        out = engines[engine].generate(prompts[:1], detect, use_tqdm=False)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
        assert out.token_ids == [1000] * 4
    out = engines["plain"].generate(prompts[:1], SamplingParams(**loop), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"  # without detection: to max_tokens
    detection = RepetitionDetectionParams(max_pattern_size=2, min_count=6)
    varied = engines["plain"].generate(prompts, SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_detection=detection),
        use_tqdm=False)
    for o, free in zip(varied, _outputs(engines["plain"], prompts, None)):
        # the answer without detection, cut where its output first loops (if it does)
        cut = next((k for k in range(1, len(free) + 1)
                    if check_sequence_repetition(free[:k], detection)), None)
        assert o.outputs[0].token_ids == free[:cut]
        assert o.outputs[0].finish_reason == ("length" if cut is None else "repetition")

"""n-gram speculation in the offline engine: the same tokens as decoding without it
(greedy, with penalties, bad words, logprobs, stop ids and max_tokens), drafts really
accepted, and requests it cannot serve decoded plainly."""

from __future__ import annotations

import math

import pytest

from pagoda import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
# SmolLM2 (the default model) copies and continues lists, so prompt lookup is often
# right; a random tiny model rarely repeats and would exercise only rejections.
PROMPTS = ["Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
           "The quick brown fox jumps over the lazy dog. The quick brown"]


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32", seed=0, max_model_len=512)


@pytest.fixture(scope="module")
def speculative():
    return LLM(dtype="float32", seed=0, max_model_len=512, speculative_config=SPEC)


def _outputs(llm: LLM, params: SamplingParams):
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _spec_stats(llm: LLM):
    return llm.llm_engine.core.get_stats().spec_decoding


def test_greedy_tokens_equal_plain_decoding_and_drafts_are_accepted(plain, speculative):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    before = _spec_stats(speculative)
    accepted_before, drafted_before = before.num_accepted_tokens, before.num_draft_tokens
    expected = [o.token_ids for o in _outputs(plain, params)]
    got = [o.token_ids for o in _outputs(speculative, params)]
    assert got == expected
    assert all(len(t) == 48 for t in got)  # drafts never run past max_tokens
    stats = _spec_stats(speculative)
    # Prompt lookup must have been right often: a verifier that rejected everything
    # would pass the equality above.
    assert stats.num_accepted_tokens - accepted_before > 10
    assert stats.num_draft_tokens - drafted_before > stats.num_accepted_tokens - accepted_before
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens


def test_penalties_bad_words_and_logprobs_match(plain, speculative):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.3, frequency_penalty=0.2, bad_words=[" Friday"])
    expected, got = _outputs(plain, params), _outputs(speculative, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for e, g in zip(expected, got):
        assert len(g.logprobs) == len(g.token_ids)
        for e_step, g_step in zip(e.logprobs, g.logprobs):
            assert e_step.keys() == g_step.keys()
            assert all(math.isclose(e_step[t].logprob, g_step[t].logprob, abs_tol=1e-4)
                       for t in e_step)


def test_a_stop_id_among_accepted_drafts_ends_the_request_there(plain, speculative):
    probe = _outputs(plain, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stop_id = probe[0].token_ids[17]  # a token the first prompt produces (a copied day)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                            stop_token_ids=[stop_id])
    expected, got = _outputs(plain, params), _outputs(speculative, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) <= 18


def test_seeded_sampling_is_unchanged(plain, speculative):
    """A seeded random request gets no drafts: its stream is the plain engine's."""
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True)
    before = _spec_stats(speculative).num_drafts
    assert [o.token_ids for o in _outputs(speculative, params)] == \
        [o.token_ids for o in _outputs(plain, params)]
    assert _spec_stats(speculative).num_drafts == before


def test_unseeded_sampling_runs_with_drafts(speculative):
    params = SamplingParams(temperature=0.7, max_tokens=32, ignore_eos=True)
    before = _spec_stats(speculative).num_drafts
    outputs = _outputs(speculative, params)
    assert all(len(o.token_ids) == 32 for o in outputs)
    assert _spec_stats(speculative).num_drafts > before


def test_bad_speculative_config_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=str(tiny_llama_dir), speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="pipeline parallelism"):
        LLM(model=str(tiny_llama_dir), pipeline_parallel_size=2, speculative_config=SPEC)


@pytest.mark.extended  # make test-extended: bf16 is emulated (slow) on CPUs without native bf16
def test_bf16_greedy_is_unchanged_under_batch_invariance():
    """In bf16 a verify step (k + 1 rows) may round a near-tie differently from a
    one-row decode; --batch-invariant makes each row's arithmetic independent of the
    step's shape, so speculation then leaves greedy tokens exactly as they were."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kwargs = dict(dtype="bfloat16", batch_invariant=True, seed=0, max_model_len=512)
    expected = [o.token_ids for o in _outputs(LLM(**kwargs), params)]
    speculative = LLM(**kwargs, speculative_config=SPEC)
    assert [o.token_ids for o in _outputs(speculative, params)] == expected
    assert _spec_stats(speculative).num_accepted_tokens > 10

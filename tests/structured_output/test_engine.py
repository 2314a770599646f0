"""Structured outputs through the whole offline engine (`LLM`): every constraint kind,
greedy and sampled, n > 1, preemption, prefix caching, logprobs, stop strings, and
unconstrained neighbours left exactly as they were."""

from __future__ import annotations

import math
import re

import pytest

from pagoda import LLM
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from structured_output_cases import CASES, MAX_TOKENS, REGEX, check_output

PROMPTS = ["The weather today is", "List three colours:", "My favourite number"]


def constrained(kind: str, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputsParams(**CASES[kind]), **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, max_model_len=512, max_num_seqs=16)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", list(CASES))
def test_every_constraint_kind_holds(llm, kind, temperature):
    outputs = llm.generate(PROMPTS, constrained(kind, n=3, temperature=temperature, seed=11),
                           use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for request in outputs:
        assert len(request.outputs) == 3
        for completion in request.outputs:
            check_output(kind, completion.text, completion.finish_reason, tokenizer)
    if temperature and kind in ("json", "regex", "grammar"):  # each child its own matcher
        assert len({c.text for r in outputs for c in r.outputs}) > 3


def test_constrained_requests_leave_their_neighbours_unchanged(llm):
    free = [SamplingParams(max_tokens=24, temperature=0.0),
            SamplingParams(max_tokens=24, temperature=0.9, seed=3, logprobs=2)]
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[2]],
                         [free[0], constrained("regex"), free[1], constrained("json", n=2)],
                         use_tqdm=False)
    for a, m in zip(alone, [mixed[0], mixed[2]]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    # The same tokens, ranks and logprobs up to float rounding: a batch of another size
    # may take another matmul kernel (bit-equal on some CPUs, not on others); a mask
    # leaking from a constrained row would move them by far more.
    for want, got in zip(alone[1].outputs[0].logprobs, mixed[2].outputs[0].logprobs,
                         strict=True):
        assert want.keys() == got.keys()
        for token, entry in want.items():
            assert (entry.rank, entry.decoded_token) == (got[token].rank,
                                                         got[token].decoded_token)
            assert entry.logprob == pytest.approx(got[token].logprob, abs=1e-4)


def test_seeded_constrained_sampling_is_reproducible(llm):
    params = constrained("json", temperature=1.0, seed=123)
    first = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    again = llm.generate([PROMPTS[1], PROMPTS[0]], [constrained("regex", temperature=1.0),
                                                    params], use_tqdm=False)
    assert again[1].outputs[0].text == first


def test_preemption_recomputes_without_breaking_the_grammar(tiny_llama_dir):
    """Ten constrained requests in a KV cache of 80 tokens: requests are preempted and
    recomputed, and each still ends with a valid answer (its matcher stayed in step with
    its tokens). Token-for-token equality with an unpreempted run is not asserted: a
    recompute prefill and a decode may round a near-tie differently, constrained or not."""
    small = LLM(tiny_llama_dir, max_model_len=512, num_gpu_blocks_override=20, block_size=4,
                enable_prefix_caching=False)
    prompts = [f"{p} #{i}" for i in range(4) for p in PROMPTS[:3]][:10]
    params = [constrained(k, temperature=t, seed=i) for i, (k, t) in enumerate(
        [(k, t) for k in ("json", "regex", "grammar") for t in (0.0, 1.0)] * 2)][:10]
    squeezed = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.core.scheduler.num_preemptions > 0
    for out, p in zip(squeezed, params):
        check_output(p.structured_outputs.kind, out.outputs[0].text, out.outputs[0].finish_reason)


def test_prefix_cache_hits_keep_the_constraint(llm):
    prompt = "A long shared prefix that fills several blocks of the cache: " * 4
    first, second = (llm.generate(prompt, constrained("regex", temperature=0.0),
                                  use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    check_output("regex", second.outputs[0].text)


def test_logprobs_are_those_of_the_constrained_distribution(llm):
    """The bitmask is applied before the sampler (vLLM's order), so every candidate with
    a finite logprob is a token the grammar allows, and the allowed tokens' probabilities
    sum to one."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")
    first = out.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if math.isfinite(lp.logprob)}
    assert out.token_ids[0] in finite
    tokenizer = llm.get_tokenizer()
    assert all(any(c.startswith(tokenizer.decode([t])) for c in ("yes", "no")) for t in finite)
    assert sum(math.exp(v) for v in finite.values()) == pytest.approx(1.0, abs=1e-4)


def test_stop_strings_cut_a_constrained_output(llm):
    out = llm.generate(PROMPTS[1], constrained("regex", stop=["-"]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "-"
    assert re.fullmatch(r"[a-z]{2,4}", out.text)


@pytest.mark.parametrize("constraint, field", [
    (dict(regex="[a-"), "structured_outputs.regex"),
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "structured_outputs.json"),
    (dict(grammar="root ::= missing"), "structured_outputs.grammar"),
    (dict(json="{not json"), "structured_outputs.json"),
])
def test_an_invalid_constraint_is_a_value_error_and_the_engine_goes_on(llm, constraint, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(PROMPTS[0], SamplingParams(
            structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    check_output("regex", llm.generate(PROMPTS[0], constrained("regex"),
                                       use_tqdm=False)[0].outputs[0].text)


def test_reasoning_parser_starts_the_grammar_after_the_reasoning(think_model_dir):
    """`</think>` is pushed up by a logit bias. With deepseek_r1 the model is reasoning
    first, so the bias wins (the grammar waits), and the answer after it obeys the
    grammar; without a reasoning parser the grammar applies at once and `</think>`
    never appears. The model's vocabulary (49160) is larger than the tokenizer's."""
    with_parser = LLM(think_model_dir, max_model_len=256, reasoning_parser="deepseek_r1")
    end = with_parser.get_tokenizer().get_vocab()["</think>"]
    params = SamplingParams(max_tokens=32, temperature=0.0, logit_bias={end: 100.0},
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    text = with_parser.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith("</think>") and re.fullmatch(REGEX, text[len("</think>"):])
    plain = LLM(think_model_dir, max_model_len=256)
    text = plain.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch(REGEX, text)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json", "choice", "regex"])
def test_the_default_model_follows_each_constraint(kind):
    llm = _smollm2()
    messages = [{"role": "user", "content": "Describe a person called Ana, aged 31, who is "
                                            "an admin, as JSON. Or answer yes/no: is it cold?"}]
    for temperature in (0.0, 0.8):
        out = llm.chat(messages, constrained(kind, temperature=temperature, seed=1, n=2),
                       use_tqdm=False)[0]
        for completion in out.outputs:
            check_output(kind, completion.text, completion.finish_reason)


_DEFAULT = []


def _smollm2() -> LLM:
    if not _DEFAULT:
        _DEFAULT.append(LLM(max_model_len=1024))
    return _DEFAULT[0]


# vLLM's structural_tag response format (xgrammar's tag format): a fixed opening tag, a
# JSON value from a schema, a fixed closing tag; nothing else may be written.
STRUCTURAL_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<color>"},
    {"type": "json_schema", "json_schema": {"enum": ["red", "green", "blue"]}},
    {"type": "const_string", "value": "</color>"}]}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_structural_tag_holds(llm, temperature):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=5, n=2,
                            structured_outputs=StructuredOutputsParams(
                                structural_tag=STRUCTURAL_TAG))
    for request in llm.generate(PROMPTS, params, use_tqdm=False):
        for completion in request.outputs:
            assert completion.finish_reason == "stop", completion.text
            assert re.fullmatch(r'<color>"(red|green|blue)"</color>', completion.text), \
                completion.text

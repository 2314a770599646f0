"""The offline `LLM` API on a tiny random model: the behaviour vLLM users rely on."""

import pytest

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", block_size=4, max_model_len=256)


def test_results_in_input_order_with_token_and_text_prompts(llm):
    tok = llm.get_tokenizer()
    prompts = ["a b c d e f g h", {"prompt_token_ids": tok.encode("hello")}, "x"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [tok.encode("a b c d e f g h"), tok.encode("hello"),
                                                  tok.encode("x")]
    assert all(len(o.outputs[0].token_ids) <= 5 and o.finished for o in outs)


def test_text_is_detokenized_output(llm):
    out = llm.generate("hello world", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "length"


def test_stop_string_truncates_and_reports(llm):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate("tell me", params, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 10
    stop = full[4:7]
    cut = full.index(stop)
    out = llm.generate("tell me", params.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:cut], "stop", stop)
    out = llm.generate("tell me", params.clone(stop=[stop], include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:cut + len(stop)]


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate("seeded", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    mixed = llm.generate(["other one", "seeded", "third"], [others, params, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_n_completions_are_distinct_and_indexed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate("many", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate("one two three", params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position and position[token_id].rank == 1  # greedy = top-1
        assert 3 <= len(position) <= 4
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids)))
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token_id, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in position


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.rstrip().endswith("assistant")


def test_prompt_too_long_raises_and_engine_stays_usable(llm):
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate([list(range(100, 400))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.generate("still fine", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished

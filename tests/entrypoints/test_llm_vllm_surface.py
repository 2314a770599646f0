"""vLLM 0.19's offline surface on `LLM`: enqueue / wait_for_completion (greedy equal to
HF), get_metrics (vLLM's metric objects and names), flat_logprobs (FlatLogprobs reads
like the list of dicts), chat(tools=...) and default_chat_template_kwargs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.logprobs import FlatLogprobs
from pagoda.metrics.reader import Counter, Gauge, Histogram

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", block_size=4, max_model_len=256,
               disable_log_stats=False,
               default_chat_template_kwargs={"persona": "pirate", "mood": "calm"})


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    results = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 min_new_tokens=8, do_sample=False, pad_token_id=0)
        results.append(out[0, ids.shape[1]:].tolist())
    return results


def test_enqueue_returns_ids_without_running_and_wait_returns_all_in_order(llm, hf_greedy):
    first = llm.enqueue(PROMPTS[:2], GREEDY)
    second = llm.enqueue(PROMPTS[2], GREEDY)
    assert len(first) == 2 and len(second) == 1 and len(set(first + second)) == 3
    assert llm.llm_engine.has_unfinished_requests()  # queued, not run
    # A blocking call in between returns only its own output; the queued ones keep.
    between = llm.generate("x y z", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(between) == 1 and between[0].request_id not in first + second
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == first + second
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy
    assert all(o.finished for o in outputs)
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_get_metrics_counts_what_the_engine_did(llm):
    def values():
        return {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}

    before = values()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    after = values()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    counter = after[("vllm:prompt_tokens", None)]
    assert isinstance(counter, Counter)
    assert counter.value - before[("vllm:prompt_tokens", None)].value == prompt_tokens
    assert (after[("vllm:generation_tokens", None)].value
            - before[("vllm:generation_tokens", None)].value) == 8 * len(PROMPTS)
    assert (after[("vllm:request_success", "length")].value
            - before[("vllm:request_success", "length")].value) == len(PROMPTS)
    running = after[("vllm:num_requests_running", None)]
    assert isinstance(running, Gauge) and running.value == 0
    ttft = after[("vllm:time_to_first_token_seconds", None)]
    assert isinstance(ttft, Histogram) and ttft.buckets["+Inf"] == ttft.count
    assert ttft.count - before[("vllm:time_to_first_token_seconds", None)].count == len(PROMPTS)
    assert counter.labels["model_name"] and counter.labels["engine"] == "0"


def test_get_metrics_needs_log_stats(tiny_llama_dir):
    quiet = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        quiet.get_metrics()


def test_flat_logprobs_read_like_the_list_of_dicts(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    nested = llm.generate("one two three", params, use_tqdm=False)[0]
    flat = llm.generate("one two three", params.clone(flat_logprobs=True), use_tqdm=False)[0]
    sample, prompt = flat.outputs[0].logprobs, flat.prompt_logprobs
    assert isinstance(sample, FlatLogprobs) and isinstance(prompt, FlatLogprobs)
    assert len(sample) == len(nested.outputs[0].logprobs) == 5
    assert list(sample) == nested.outputs[0].logprobs
    assert prompt[0] == {} and nested.prompt_logprobs[0] is None
    assert list(prompt)[1:] == nested.prompt_logprobs[1:]
    assert list(sample[1:3]) == nested.outputs[0].logprobs[1:3]
    assert sample[-1] == nested.outputs[0].logprobs[-1]
    assert flat.outputs[0].cumulative_logprob == pytest.approx(nested.outputs[0].cumulative_logprob)
    # Flat: a constant number of lists, however long the completion.
    assert len(sample.token_ids) == sample.end_indices[-1] and sample.start_indices[0] == 0
    with pytest.raises(TypeError):
        sample[0] = {}


TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
            "{% endif %}[{{ persona }}|{{ mood }}]"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_chat_renders_tools_and_default_kwargs_under_request_kwargs(llm):
    tokenizer = llm.get_tokenizer()
    saved = tokenizer.chat_template
    tokenizer.chat_template = TEMPLATE
    try:
        messages = [{"role": "user", "content": "weather in Paris?"}]
        out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS,
                       chat_template_kwargs={"mood": "stormy"})[0]
        assert out.prompt.startswith("TOOLS:get_weather;[pirate|stormy]<user>weather in Paris?")
        assert out.prompt.endswith("<assistant>")
        plain = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert plain.prompt.startswith("[pirate|calm]<user>")
    finally:
        tokenizer.chat_template = saved

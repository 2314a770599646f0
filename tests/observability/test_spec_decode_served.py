"""`pagoda serve --speculative-config` (n-gram) with the official openai client: the same
greedy text as the engine without speculation, vLLM's spec-decode metrics and stats line,
and the dashboards' speculative-decoding panels answered by a real Prometheus (the
conftest's `prometheus` fixture scrapes this module's `cluster`)."""

from __future__ import annotations

import json

import openai
import pytest
from obs_harness import panel_queries, panel_query_failures
from serve_cluster import ServeProcess, wait_until

from pagoda import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
PROMPTS = ["Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]


@pytest.fixture(scope="module")
def cluster():
    serve = ServeProcess(["--dtype", "float32", "--max-model-len", "1024",
                          "--speculative-config", json.dumps(SPEC), "--log-stats-interval", "1"],
                         timeout=300)
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-40:])


@pytest.fixture(scope="module")
def plain_texts():
    llm = LLM(dtype="float32", max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_text_equals_decoding_without_drafts(cluster, plain_texts):
    client = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    extra = {"ignore_eos": True}
    whole = client.completions.create(model=model, prompt=PROMPTS, temperature=0, max_tokens=40,
                                      extra_body=extra, logprobs=1)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == plain_texts
    assert whole.usage.completion_tokens == 80
    for choice in whole.choices:  # one logprob entry per token, drafts or not
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 40
    streamed = client.completions.create(model=model, prompt=PROMPTS[0], temperature=0,
                                         max_tokens=40, extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain_texts[0]


def test_spec_decode_metrics_and_stats_line(cluster):
    client = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt=PROMPTS[1], temperature=0, max_tokens=30)

    def counter(name: str, **labels) -> float:
        wanted = set(labels.items())
        return sum(v for (n, ls), v in cluster.scrape().items() if n == name and wanted <= ls)

    assert wait_until(lambda: counter("vllm:spec_decode_num_accepted_tokens_total") > 0, 10)
    drafts = counter("vllm:spec_decode_num_drafts_total")
    drafted = counter("vllm:spec_decode_num_draft_tokens_total")
    accepted = counter("vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted <= 4 * drafts
    per_position = [counter("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                            position=str(i)) for i in range(4)]
    assert per_position[0] >= per_position[-1] and sum(per_position) == accepted
    assert wait_until(lambda: any("SpecDecoding metrics: Mean acceptance length" in line
                                  for line in cluster.log), 10)


def test_speculative_decoding_panels_return_data(cluster, prometheus):
    client = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    # rate() needs a scrape before the traffic and one after it.
    assert wait_until(lambda: prometheus.values("sum(vllm:spec_decode_num_drafts_total)"), 30)
    client.completions.create(model=model, prompt=PROMPTS[0], temperature=0, max_tokens=30)
    queries = panel_queries("speculative")
    assert len(queries) == 4
    assert wait_until(lambda: not panel_query_failures(prometheus, queries, model), 30, 1.0), \
        "\n".join(panel_query_failures(prometheus, queries, model))

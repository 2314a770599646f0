"""vLLM's request fields, priorities and the Responses API against real services.

One cluster (tiny random Llama) with `--scheduling-policy priority` and one sequence at
a time (`--max-num-seqs 1`), so the order in which waiting requests run is the order
in which they finish. Token ids come back as `token_id:N` logprob tokens
(`return_tokens_as_token_ids`), so tests compare ids, not detokenized text.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from serve_cluster import ServeProcess, wait_until

from pagoda.tokenizer.bad_words import bad_words_token_ids

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
MAX_MODEL_LEN = 512
PROMPT = "one two three four five six seven eight nine ten eleven twelve"
GREEDY = {"temperature": 0.0}
IDS = {"logprobs": 0, "extra_body": {"return_tokens_as_token_ids": True, "ignore_eos": True}}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1",
                          "--scheduling-policy", "priority"])
    yield serve
    assert serve.stop() == 0, serve.stderr_text()[-3000:]


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.url, api_key="unused", max_retries=0, timeout=120)


def completion_ids(client, prompt, max_tokens=12, extra=None, **kw) -> tuple[list[int], object]:
    kwargs = {**GREEDY, **kw}
    body = {**IDS["extra_body"], **(extra or {})}
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                    logprobs=0, extra_body=body, **kwargs)
    tokens = out.choices[0].logprobs.tokens
    return [int(t.removeprefix("token_id:")) for t in tokens], out


def test_waiting_requests_run_in_priority_order(cluster, load):
    """A long request holds the only sequence slot; four more queue behind it with
    priorities 3, 1, 2, 0 (arriving in that order); once it is gone they finish
    lowest value first."""
    finished: list[int] = []
    lock = threading.Lock()

    def run(priority: int) -> None:
        body = {"model": "tiny", "prompt": f"queued {priority}", "max_tokens": 24,
                "ignore_eos": True, "priority": priority}
        assert httpx.post(f"{cluster.url}/completions", json=body, timeout=120).status_code == 200
        with lock:
            finished.append(priority)

    blocker = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 32,
               "ignore_eos": True, "stream": True}
    threads = []
    with httpx.stream("POST", f"{cluster.url}/completions", json=blocker, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs
        for i, priority in enumerate([3, 1, 2, 0]):
            threads.append(threading.Thread(target=run, args=(priority,)))
            threads[-1].start()
            assert wait_until(lambda: load().num_waiting == i + 1, 30), load()
    for t in threads:  # closing the blocker's stream aborted it: the queue drains
        t.join(120)
    assert finished == [0, 1, 2, 3]


def test_truncation_keeps_the_right_tokens(cluster, client):
    full = httpx.post(f"{cluster.url[:-3]}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    cut, out = completion_ids(client, PROMPT, extra={"truncate_prompt_tokens": 5})
    direct, _ = completion_ids(client, full[-5:])
    assert out.usage.prompt_tokens == 5 and cut == direct
    whole, _ = completion_ids(client, PROMPT)
    assert whole != cut  # the cut changed what the model saw


def test_bad_words_never_appear(client, smollm2_tokenizer):
    tok = smollm2_tokenizer
    encode = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    free, _ = completion_ids(client, PROMPT, max_tokens=20)
    # A token the free completion uses that a bad word bans wherever it could be sampled.
    token, word = next((t, w) for t in free if (w := tok.decode([t]).strip())
                       and [t] in bad_words_token_ids([w], encode))
    banned, _ = completion_ids(client, PROMPT, max_tokens=20, extra={"bad_words": [word]})
    assert token not in banned and len(banned) == 20
    until = free.index(token)
    assert banned[:until] == free[:until]  # the same text up to where the word would be


def test_allowed_token_ids_restrict_the_output(client):
    allowed = [100, 200, 300, 400, 500]
    ids, _ = completion_ids(client, PROMPT, max_tokens=24, temperature=1.0, seed=5,
                            extra={"allowed_token_ids": allowed})
    assert len(ids) == 24 and set(ids) <= set(allowed) and len(set(ids)) > 1


def test_responses_api_matches_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                          temperature=0.0)
    kwargs = dict(model="tiny", instructions="Answer.", input=PROMPT, max_output_tokens=16,
                  temperature=0.0)
    response = client.responses.create(**kwargs)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == response.output_text == events[-1].response.output_text
    assert events[-1].type == "response.completed"


def test_previous_response_id_is_the_same_as_sending_the_history(client):
    first = client.responses.create(model="tiny", input="Say something.", max_output_tokens=8,
                                    temperature=0.0)
    follow = client.responses.create(model="tiny", input="Again.", max_output_tokens=8,
                                     temperature=0.0, previous_response_id=first.id)
    explicit = client.responses.create(model="tiny", max_output_tokens=8, temperature=0.0,
                                       input=[{"role": "user", "content": "Say something."},
                                              {"role": "assistant", "content": first.output_text},
                                              {"role": "user", "content": "Again."}])
    assert follow.output_text == explicit.output_text
    assert follow.usage.input_tokens == explicit.usage.input_tokens
    assert client.responses.retrieve(follow.id).output_text == follow.output_text


def test_server_routes_and_http_metrics(cluster, client):
    base = cluster.url[:-3]
    assert httpx.get(f"{base}/ping").status_code == 200
    assert httpx.post(f"{base}/ping").status_code == 200
    assert httpx.get(f"{base}/load").json() == {"server_load": 0}
    assert client.models.retrieve("tiny").model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    client.responses.create(model="tiny", input="x", max_output_tokens=2)
    metrics = cluster.scrape()
    key = ("http_requests_total", frozenset({"handler": "/v1/responses", "method": "POST",
                                             "status": "2xx"}.items()))
    assert metrics[key] >= 1
    assert any(name == "http_request_duration_seconds_bucket"
               and dict(labels).get("handler") == "/v1/completions" for name, labels in metrics)

"""gpt-oss chats in the harmony format, end to end: the offline `LLM.chat` and a real
`pagoda serve` (vLLM's gpt-oss recipe: `--reasoning-parser gpt_oss --tool-call-parser
openai --enable-auto-tool-choice`, asked through the official `openai` client) run the
prompt ids `pagoda.tokenizer.harmony` renders, stop at <|return|>/<|call|>, and their
answers, streamed or not, go through both parsers.

The checkpoint is the tiny random gpt-oss of test_gpt_oss.py with SmolLM2's tokenizer
plus the harmony control tokens (`save_gpt_oss_chat`). Its answers are random text, so
the parsers mostly see header-less text (all content); the harmony parsing itself is
tested on written harmony text (tests/reasoning, tests/services/gateway)."""

from __future__ import annotations

import json
import sys

import httpx
import openai
import pytest
from serve_cluster import ServeProcess
from shared_clusters import PLAIN_TINY_FLAGS
from test_gpt_oss import save_gpt_oss_chat

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.services.cli.main import main
from pagoda.tokenizer.harmony import encode_harmony, harmony_segments
from pagoda.tokenizer.loader import load_tokenizer

DATE = "2025-06-28"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# A tool-call round trip whose call carries its reasoning: the renderer keeps that
# analysis (no final answer after it), so the prompt also proves `reasoning` travels.
ROUND_TRIP = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning": "Need get_weather.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true}'},
]


def expected_ids(tokenizer, messages, tools=None, effort=None) -> list[int]:
    return encode_harmony(tokenizer, harmony_segments(messages, tools, effort,
                                                      current_date=DATE))


def test_offline_chat_renders_harmony_and_stops_at_return(tmp_path, smollm2_tokenizer,
                                                         monkeypatch):
    monkeypatch.setenv("PAGODA_SYSTEM_START_DATE", DATE)
    path = save_gpt_oss_chat(tmp_path, smollm2_tokenizer)
    tokenizer = load_tokenizer(path)
    llm = LLM(model=path, dtype="float32", block_size=16, num_gpu_blocks_override=64)
    out = llm.chat(ROUND_TRIP, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False,
                   tools=[WEATHER], chat_template_kwargs={"reasoning_effort": "low"})[0]
    assert out.prompt_token_ids == expected_ids(tokenizer, ROUND_TRIP, [WEATHER], "low")
    # <|return|> is a stop token of every gpt-oss chat (vLLM adds it): forced, it ends
    # the answer at once
    ret = tokenizer.convert_tokens_to_ids("<|return|>")
    forced = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={ret: 100.0})
    out = llm.chat([{"role": "user", "content": "Hi"}], forced, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([ret], "stop", ret)


def test_run_batch_renders_harmony_as_the_served_route(tmp_path, smollm2_tokenizer,
                                                       monkeypatch):
    """`pagoda run-batch` on gpt-oss: the same harmony prompt and stop tokens; a tool
    result without its call is that line's 400."""
    monkeypatch.setenv("PAGODA_SYSTEM_START_DATE", DATE)
    path = save_gpt_oss_chat(tmp_path / "model", smollm2_tokenizer)
    tokenizer = load_tokenizer(path)
    ret = tokenizer.convert_tokens_to_ids("<|return|>")
    body = dict(model="tiny", messages=ROUND_TRIP, tools=[WEATHER], reasoning_effort="low",
                max_tokens=5, temperature=0, logit_bias={str(ret): 100})
    orphan = {**body, "messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions", "body": b}
             for name, b in (("ok", body), ("orphan", orphan))]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"),
                 "--model", path, "--dtype", "float32", "--block-size", "16",
                 "--max-model-len", "1024", "--served-model-name", "tiny"]) == 0
    ok, bad = [json.loads(line) for line in open(tmp_path / "out", encoding="utf-8")]
    answer = ok["response"]["body"]
    want = expected_ids(tokenizer, ROUND_TRIP, [WEATHER], "low")
    assert answer["usage"] == {"prompt_tokens": len(want), "completion_tokens": 1,
                               "total_tokens": len(want) + 1}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert bad["response"]["status_code"] == 400
    assert "tool_call_id 'x'" in bad["error"]["message"]


@pytest.mark.slow
@pytest.mark.extended  # a cluster start (about a minute here)
def test_served_chat_renders_harmony_and_parses(tmp_path, smollm2_tokenizer, shared_redis):
    path = save_gpt_oss_chat(tmp_path, smollm2_tokenizer)
    tokenizer = load_tokenizer(path)
    serve = ServeProcess([path, *PLAIN_TINY_FLAGS, "--redis-url", shared_redis.url,
                          "--reasoning-parser", "gpt_oss", "--tool-call-parser", "openai",
                          "--enable-auto-tool-choice"],
                         env={"PAGODA_SYSTEM_START_DATE": DATE})
    try:
        client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0,
                               timeout=120)
        ask = dict(model="tiny", messages=ROUND_TRIP, tools=[WEATHER], reasoning_effort="low",
                   max_tokens=8, temperature=0.0)
        answer = client.chat.completions.create(**ask, extra_body={"prompt_logprobs": 0})
        want = expected_ids(tokenizer, ROUND_TRIP, [WEATHER], "low")
        assert served_prompt_ids(answer, want[0]) == want
        assert answer.usage.prompt_tokens == len(want)
        message = answer.choices[0].message
        streamed = stream(client, ask)
        assert streamed == (message.content or "", getattr(message, "reasoning", None) or "",
                            [c.function.name for c in message.tool_calls or []])

        # tool_choice "none": the tools are still in the prompt (vLLM's default)
        none = client.chat.completions.create(**{**ask, "tool_choice": "none"},
                                              extra_body={"prompt_logprobs": 0})
        assert served_prompt_ids(none, want[0]) == want
        # vLLM's stop tokens: a forced <|return|> ends the answer at once
        ret = tokenizer.convert_tokens_to_ids("<|return|>")
        forced = client.chat.completions.create(**{**ask, "logit_bias": {str(ret): 100}})
        assert (forced.choices[0].finish_reason, forced.usage.completion_tokens) == ("stop", 1)

        # a tool result that answers no call: the OpenAI error JSON (400), and the
        # server keeps serving
        orphan = [{"role": "user", "content": "Hi"},
                  {"role": "tool", "tool_call_id": "call_9", "content": "20"}]
        reply = httpx.post(f"{serve.url}/chat/completions", timeout=60,
                           json={**ask, "messages": orphan})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == 400 and "tool_call_id 'call_9'" in error["message"], error
        # a constraint waits for the final channel's header, which the random model never
        # writes: the answer is the unconstrained one (vLLM's gpt-oss rule)
        constrained = httpx.post(f"{serve.url}/chat/completions", timeout=60, json={
            **ask, "response_format": {"type": "json_object"}})
        assert constrained.status_code == 200, constrained.text
        assert constrained.json()["choices"][0]["message"]["content"] == message.content
        assert client.chat.completions.create(**ask).choices[0].finish_reason
    except BaseException:
        print("".join(serve.log[-80:]), file=sys.stderr)  # the cluster's account
        raise
    finally:
        code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]


def served_prompt_ids(answer, first: int) -> list[int]:
    """The prompt ids the server ran, from vLLM's `prompt_logprobs` (0: each prompt
    token's own entry; the first token has none)."""
    entries = answer.model_extra["prompt_logprobs"]
    assert entries[0] is None
    return [first] + [int(next(iter(e))) for e in entries[1:]]


def stream(client, ask) -> tuple[str, str, list[str]]:
    """(content, reasoning, called function names) of the streamed answer."""
    content, reasoning, names = [], [], []
    for chunk in client.chat.completions.create(**ask, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning") or "")
        names += [c.function.name for c in delta.tool_calls or [] if c.function.name]
    return "".join(content), "".join(reasoning), names


def test_structured_output_applies_to_the_final_message(tmp_path, smollm2_tokenizer):
    """`--reasoning-parser gpt_oss` with a constraint (vLLM's gpt-oss recipe): the grammar
    waits for the final channel's header. The random model is led through its last token
    by a logit bias (the prompt ends `<|channel|>final`): the body after `<|message|>`
    is one of the choices and ends with <|return|> (a stop token of the request, which
    the grammar allows once the body is complete). Without the header, the answer is the
    unconstrained one, token for token."""
    path = save_gpt_oss_chat(tmp_path, smollm2_tokenizer)
    tokenizer = load_tokenizer(path)
    llm = LLM(model=path, dtype="float32", block_size=16, num_gpu_blocks_override=64,
              reasoning_parser="gpt_oss")
    chat = expected_ids(tokenizer, [{"role": "user", "content": "Yes or no?"}])
    message, ret = tokenizer.convert_tokens_to_ids(["<|message|>", "<|return|>"])
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[ret],
                            logit_bias={message: 100.0, ret: 50.0}, structured_outputs=choice)
    header = chat + tokenizer.encode("<|channel|>final", add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": header}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == message and out.token_ids[-1] == ret
    assert tokenizer.decode(out.token_ids[1:-1]) in ("yes", "no")
    assert out.finish_reason == "stop"

    free = SamplingParams(max_tokens=8, temperature=0.0)
    unconstrained = llm.generate({"prompt_token_ids": chat}, free,
                                 use_tqdm=False)[0].outputs[0].token_ids
    gated = llm.generate({"prompt_token_ids": chat}, SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=choice),
        use_tqdm=False)[0].outputs[0].token_ids
    assert "<|channel|>final" not in tokenizer.decode(unconstrained, skip_special_tokens=False)
    assert gated == unconstrained

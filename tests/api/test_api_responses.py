"""/v1/responses through the official openai client, against the gateway over fakes.

The fake scheduler answers every request with SCRIPT's tokens, so each test knows the
text a response must hold; what reaches the scheduler shows the conversation the
Responses API built (instructions, the stored turns, the new input)."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_fakes import MODEL, SCRIPT



def script_text(tokenizer, n: int) -> str:
    return tokenizer.decode(tokenizer.encode(SCRIPT, add_special_tokens=False)[:n])


def prompt_text(tokenizer, last_request) -> str:
    return tokenizer.decode(list(last_request().prompt_token_ids))


def test_text_input_with_instructions(client, last_request, smollm2_tokenizer):
    r = client.responses.create(model=MODEL, input="Hi there", instructions="Be brief.",
                                max_output_tokens=5)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == script_text(smollm2_tokenizer, 5)
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    prompt = prompt_text(smollm2_tokenizer, last_request)
    assert prompt.index("Be brief.") < prompt.index("Hi there")  # instructions: the system turn
    assert r.usage.input_tokens == len(last_request().prompt_token_ids)
    assert r.usage.output_tokens == 5 and r.usage.total_tokens == r.usage.input_tokens + 5
    assert r.instructions == "Be brief." and r.max_output_tokens == 5


def test_message_input_with_text_parts(client, last_request, smollm2_tokenizer):
    r = client.responses.create(model=MODEL, max_output_tokens=3, input=[
        {"role": "developer", "content": "System words."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "first part"},
                     {"type": "input_text", "text": "second part"}]}])
    prompt = prompt_text(smollm2_tokenizer, last_request)
    assert "System words." in prompt and "first part\nsecond part" in prompt
    assert r.output_text == script_text(smollm2_tokenizer, 3)


def test_sampling_fields_reach_the_scheduler(client, last_request):
    client.responses.create(model=MODEL, input="x", max_output_tokens=4, temperature=0.25,
                            top_p=0.5)
    params = last_request().sampling_params
    assert (params.max_tokens, params.temperature, params.top_p) == (4, 0.25, 0.5)


def test_max_output_tokens_is_clamped_to_the_context(client, last_request):
    client.responses.create(model=MODEL, input="x", max_output_tokens=10**6)
    req = last_request()
    assert req.sampling_params.max_tokens == 256 - len(req.prompt_token_ids)  # MAX_MODEL_LEN


def test_streamed_events_follow_openais_sequence(client, smollm2_tokenizer):
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=6,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == script_text(smollm2_tokenizer, 6) == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 6
    assert events[0].response.status == "in_progress" and final.id == events[0].response.id
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))


def test_previous_response_id_continues_the_conversation(client, last_request,
                                                          smollm2_tokenizer):
    first = client.responses.create(model=MODEL, input="Remember 42.", instructions="OLD-SYS",
                                    max_output_tokens=4)
    second = client.responses.create(model=MODEL, input="What was it?",
                                     previous_response_id=first.id, max_output_tokens=4)
    prompt = prompt_text(smollm2_tokenizer, last_request)
    answer = prompt.index(first.output_text)
    assert prompt.index("Remember 42.") < answer < prompt.index("What was it?")
    assert "OLD-SYS" not in prompt  # instructions are not carried over (OpenAI's rule)
    assert second.previous_response_id == first.id
    third = client.responses.create(model=MODEL, input="And then?",
                                    previous_response_id=second.id, max_output_tokens=2)
    assert prompt_text(smollm2_tokenizer, last_request).count(first.output_text) == 2
    assert client.responses.retrieve(third.id).output_text == third.output_text


def test_unknown_or_unstored_previous_responses_are_404(client):
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    for rid in ("resp_nope", unstored.id):
        with pytest.raises(openai.NotFoundError, match="not found"):
            client.responses.create(model=MODEL, input="y", previous_response_id=rid)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)


def test_what_is_not_served_is_a_400_naming_the_field(gateway):
    cases = [({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools"),
             ({"background": True}, "background"),
             ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]},
              "input"),  # answers no function call of the conversation
             ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                       "image_url": "x"}]}]}, "input")]
    for extra, param in cases:
        body = {"model": MODEL, "input": "x", **extra}
        reply = httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=30)
        assert reply.status_code == 400, (extra, reply.text)
        assert reply.json()["error"]["param"] == param
    reply = httpx.get(f"{gateway.url}/v1/responses/chatcmpl-1", timeout=30)
    assert reply.status_code == 400 and "begins with 'resp'" in reply.json()["error"]["message"]


def test_vllm_extras_reach_the_engine_as_on_chat(client, last_request, smollm2_tokenizer):
    """vLLM's ResponsesRequest extras (seed, stop, repetition_penalty, ignore_eos,
    logit_bias, include_stop_str_in_output, structured_outputs, vllm_xargs) are served as
    chat serves them, never dropped."""
    full = client.responses.create(model=MODEL, input="x", max_output_tokens=12).output_text
    word = full.split()[2]
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=12, extra_body={
        "seed": 7, "stop": [word], "repetition_penalty": 1.25, "ignore_eos": True,
        "logit_bias": {"42": 1.5}, "vllm_xargs": {"k": 3}})
    assert r.output_text == full[:full.index(word)]
    params = last_request().sampling_params
    assert (params.seed, params.repetition_penalty, params.ignore_eos) == (7, 1.25, True)
    assert dict(params.logit_bias) == {42: 1.5}
    kept = client.responses.create(model=MODEL, input="x", max_output_tokens=12, extra_body={
        "stop": [word], "include_stop_str_in_output": True})
    assert kept.output_text == full[:full.index(word) + len(word)]
    client.responses.create(model=MODEL, input="x", max_output_tokens=2, extra_body={
        "structured_outputs": {"choice": ["yes", "no"]}})
    assert list(last_request().sampling_params.structured_outputs.choice.values) == ["yes", "no"]


@pytest.mark.parametrize("field,value", [
    ("request_id", "abc"), ("kv_transfer_params", {"do_remote_decode": True}),
    ("mm_processor_kwargs", {"fps": 1}), ("enable_response_messages", True),
    ("previous_input_messages", [{"role": "user", "content": "hi"}]),
    ("previous_response", {"id": "resp_1"}), ("truncation_side", "right")])
def test_vllm_fields_not_served_are_a_400_naming_them(gateway, field, value):
    body = {"model": MODEL, "input": "x", "max_output_tokens": 1, field: value}
    reply = httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field
    assert "does not support" in reply.json()["error"]["message"]
    body[field] = None
    assert httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=30).status_code == 200


def test_truncation_auto_keeps_the_conversations_end(client, last_request, smollm2_tokenizer):
    """vLLM's reading of truncation "auto": a conversation longer than the context keeps
    its last tokens, leaving room for max_output_tokens; "disabled" (the default) is a
    400."""
    long_input = "word " * 400 + "the last question"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=long_input, max_output_tokens=2)
    r = client.responses.create(model=MODEL, input=long_input, max_output_tokens=2,
                                truncation="auto")
    prompt = list(last_request().prompt_token_ids)
    assert r.usage.input_tokens == len(prompt) == 256 - 2  # api_fakes.MAX_MODEL_LEN
    assert "the last question" in smollm2_tokenizer.decode(prompt)

"""apply_chat_template: OpenAI-style messages in, the model's prompt token ids out."""

from __future__ import annotations

import pytest

from pagoda.tokenizer.chat import apply_chat_template, render_chat_template

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_text_parts_are_joined_like_a_string(smollm2_tokenizer):
    tok = smollm2_tokenizer
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hi\nthere"}]
    ids = apply_chat_template(tok, parts)
    assert ids == apply_chat_template(tok, plain)
    assert tok.decode(ids, skip_special_tokens=False) == (
        SYSTEM + "<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    )


def test_continue_final_message(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1, 2,"}]
    prompt = render_chat_template(tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt == SYSTEM + "<|im_start|>user\nCount to 3<|im_end|>\n<|im_start|>assistant\n1, 2,"
    ids = apply_chat_template(tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert ids == tok.encode(prompt, add_special_tokens=False)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        apply_chat_template(tok, messages, add_generation_prompt=True, continue_final_message=True)


def test_no_second_bos(sp_tokenizer):
    tok = sp_tokenizer  # its template writes the BOS, and its encode() adds one too
    bos = tok.convert_tokens_to_ids("<s>")
    assert tok.encode("Hello")[0] == bos
    ids = apply_chat_template(tok, [{"role": "user", "content": "Hello"}])
    assert ids.count(bos) == 1 and ids[0] == bos


def test_tools_and_template_kwargs_reach_the_template(sp_tokenizer):
    messages = [{"role": "user", "content": "Hello"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    prompt = render_chat_template(sp_tokenizer, messages, chat_template_kwargs={"greeting": "HI!"}, tools=tools)
    assert prompt == "<s>[tools: 1]HI!<user>Hello</s><assistant>"
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render_chat_template(sp_tokenizer, messages, chat_template_kwargs={"add_generation_prompt": False})


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\.role must be one of"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content is required"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content is required"),
        ([{"role": "user", "content": 42}], "string or a list of content parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
         r"messages\[0\]\.content\[0\]: content part type 'image_url' is not supported"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
         r"content\[1\]: content part type 'input_audio'"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text must be a string"),
    ],
)
def test_invalid_messages_raise_clear_errors(smollm2_tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        apply_chat_template(smollm2_tokenizer, messages)


def test_template_failures_become_value_errors(smollm2_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template could not render"):
        apply_chat_template(smollm2_tokenizer, messages, chat_template_kwargs={
            "chat_template": "{{ raise_exception('no tools here') }}"})


def test_a_tool_call_only_assistant_turn_renders(smollm2_tokenizer):
    # SmolLM2's template concatenates message['content']: the turn's content is "" (as
    # vLLM makes it), so the template renders it and the tool's answer after it.
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "21 C"},
    ]
    text = smollm2_tokenizer.decode(apply_chat_template(smollm2_tokenizer, messages))
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n21 C<|im_end|>" in text


# A tool-use template in the style of Qwen3-Coder's and transformers' own: it reads a
# call's arguments as an object (`| items`, `| tojson`).
TOOL_ARGS_TEMPLATE = (
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<call {{ c.function.name }}>{% for k, v in c.function.arguments | items %}"
    "[{{ k }}={{ v }}]{% endfor %}{{ c.function.arguments | tojson }}</call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}")


def test_tool_call_arguments_reach_the_template_as_objects(smollm2_tokenizer):
    """OpenAI sends arguments as a JSON string; the template gets the object (vLLM's rule),
    so `| tojson` encodes it once and `| items` iterates it."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [
                    {"id": "1", "type": "function",
                     "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
                    {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}}]}]
    prompt = render_chat_template(smollm2_tokenizer, messages, add_generation_prompt=False,
                                  chat_template_kwargs={"chat_template": TOOL_ARGS_TEMPLATE})
    assert prompt == 'hi<call f>[city=Paris]{"city": "Paris"}</call><call g>{}</call>'
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_tool_call_arguments_that_are_not_json_are_an_error_naming_them(smollm2_tokenizer):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments "
                                         r"is not valid JSON"):
        apply_chat_template(smollm2_tokenizer, messages)

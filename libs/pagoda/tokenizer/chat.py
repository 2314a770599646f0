"""OpenAI-style chat messages -> the model's chat template -> prompt token ids."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from pagoda.multimodal.chat_parts import PLACEHOLDER_TYPES
from pagoda.tokenizer.chat_render import render_chat

# OpenAI's roles ("developer" is the newer name of "system" for reasoning models;
# "function" is the deprecated predecessor of "tool").
VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Part types this text-only engine understands; OpenAI's assistant messages may carry a
# "refusal" part, which is text too.
TEXT_PART_TYPES = frozenset({"text", "input_text", "refusal"})
# Arguments apply_chat_template sets itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "tools", "return_dict", "return_tensors"}
)


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Render `messages` with the tokenizer's chat template and tokenize the result.

    The template writes its own BOS / control tokens, so the rendered text is encoded with
    ``add_special_tokens=False`` (as vLLM does): never a second BOS. Raises ValueError with
    a message naming the offending field for invalid input.
    """
    prompt = render_chat_template(
        tokenizer, messages, add_generation_prompt, continue_final_message,
        chat_template_kwargs, tools,
    )
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def render_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text `apply_chat_template` tokenizes (same arguments, same errors).
    `documents` (vLLM's, for retrieval-augmented templates) reach the template as its
    `documents` variable, unless chat_template_kwargs sets one (vLLM's precedence)."""
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true: the first "
            "continues the last message, the second starts a new assistant message."
        )
    conversation = normalize_messages(messages)
    if continue_final_message and conversation[-1].get("content") is None:
        raise ValueError("continue_final_message is set but the final message has no content.")
    extra = dict(chat_template_kwargs or {})
    if documents is not None:
        extra.setdefault("documents", documents)
    overridden = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if overridden:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(overridden)}.")
    if getattr(tokenizer, "chat_template", None) is None and "chat_template" not in extra:
        raise ValueError(
            "The model's tokenizer has no chat template; use the completions API or pass "
            "a chat template."
        )
    try:  # transformers' rendering, sandboxed and bounded in time and size
        return render_chat(tokenizer, conversation, tools, add_generation_prompt,
                           continue_final_message, extra)
    except jinja2.TemplateError as exc:
        # A template may reject a conversation (wrong role order, a missing field it
        # reads); that is the request's fault, so it becomes a ValueError (HTTP 400).
        raise ValueError(f"The chat template could not render these messages: {exc}") from exc


def normalize_messages(messages: Sequence[Mapping[str, Any]],
                       parse_arguments: bool = True) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and flatten each content to one string.

    A content given as a list of parts becomes the parts' texts joined with newlines (vLLM's
    "string" content format). An assistant turn's `tool_calls[].function.arguments`, a JSON
    string in OpenAI's format, reaches the template as the object it encodes (as vLLM and
    transformers' tool-use templates expect: `| tojson` would otherwise encode it twice,
    and `| items` fails on a string). Other keys (name, tool_call_id, ...) pass through
    unchanged.

    `parse_arguments=False` leaves the arguments as they came: a hop that only forwards
    the messages (the gateway, to the tokenizer, which renders) does not parse what
    the renderer parses anyway, so each request's arguments are parsed once.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of chat messages.")
    return [_normalize_message(message, i, parse_arguments)
            for i, message in enumerate(messages)]


def _normalize_message(message: Any, index: int, parse_arguments: bool) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}.")
    role = message.get("role")
    if role not in VALID_ROLES:
        raise ValueError(
            f"{where}.role must be one of {', '.join(sorted(VALID_ROLES))}; got {role!r}."
        )
    normalized = dict(message)
    if parse_arguments and role == "assistant" and isinstance(message.get("tool_calls"), list):
        normalized["tool_calls"] = [_parsed_tool_call(call, f"{where}.tool_calls[{j}]")
                                    for j, call in enumerate(message["tool_calls"])]
    if "content" not in message or message["content"] is None:
        # OpenAI allows an assistant turn that only calls tools; its content is "" (vLLM's
        # string content format), so templates that concatenate content still render it.
        if role == "assistant" and message.get("tool_calls"):
            normalized["content"] = ""
            return normalized
        raise ValueError(f"{where}.content is required for role {role!r}.")
    normalized["content"] = _flatten_content(message["content"], f"{where}.content")
    return normalized


def _parsed_tool_call(call: Any, where: str) -> Any:
    """A copy of `call` whose function arguments are an object, not a JSON string (empty
    or missing arguments: {}). A call that is not an object is left to the template."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {exc}") from None
    return {**call, "function": function}


def _flatten_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A string; or, for a content that `pagoda.multimodal.chat_parts.extract_media`
    already turned into text parts and media placeholders ({"type": "image"}), that list
    as it is (multimodal templates iterate over it and write the model's placeholder)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise ValueError(f"{where} must be a string or a list of content parts.")
    if any(isinstance(p, Mapping) and p.get("type") in PLACEHOLDER_TYPES for p in content):
        return [dict(p) for p in content]
    texts = []
    for j, part in enumerate(content):
        part_where = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise ValueError(f"{part_where} must be an object with a 'type'.")
        part_type = part.get("type")
        if part_type not in TEXT_PART_TYPES:
            raise ValueError(
                f"{part_where}: content part type {part_type!r} is not supported; "
                "this model accepts text only ('text' parts)."
            )
        key = "refusal" if part_type == "refusal" else "text"
        text = part.get(key)
        if not isinstance(text, str):
            raise ValueError(f"{part_where}.{key} must be a string.")
        texts.append(text)
    return "\n".join(texts)

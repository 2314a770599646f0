"""The OpenAI request body as the endpoint picker reads it.

Invariant: `parse_body` either returns what routing needs (the model name and the
tokenizer request for the first prompt) or raises `BadBody` naming the field, with
OpenAI's error JSON; it never routes on a body it did not understand. The tokenizer
request is the one Pagoda's gateway sends for the same body (completions: the text with
special tokens; chat: the messages through the chat template; token ids: hashed only),
so the block hashes the router looks up are the ones the replica will store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.common.protocol.tokenizer import chat_input_to_proto
from pagoda.multimodal.chat_parts import extract_media
from pagoda.services.common.protocol.tokenizer import media_inputs
from pagoda.tokenizer.chat import normalize_messages


class BadBody(ValueError):
    """A body the picker refuses: a 400 with OpenAI's error JSON naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ParsedBody:
    model: str                     # "" when the body named none
    tokenize: tpb.TokenizeRequest  # the first prompt, for its tokens and block hashes
    num_prompts: int               # prompts in the body (a completions list): load
    cache_salt: str = ""
    user: str | None = None        # the session key of --router session


def parse_body(raw: bytes) -> ParsedBody:
    """An OpenAI completions or chat completions body (the `messages` key tells them
    apart). Raises BadBody."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadBody(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody("The request body must be a JSON object.")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadBody("`model` must be a string.", "model")
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str):
        raise BadBody("`cache_salt` must be a string.", "cache_salt")
    user = body.get("user") if isinstance(body.get("user"), str) else None
    if "messages" in body:
        return ParsedBody(model, _chat(body), 1, salt, user)
    if "prompt" in body:
        tokenize, count = _completion(body["prompt"])
        return ParsedBody(model, tokenize, count, salt, user)
    raise BadBody("The request needs `prompt` (completions) or `messages` (chat).", "prompt")


def _chat(body: dict) -> tpb.TokenizeRequest:
    try:
        # Image parts travel to the tokenizer as the gateway sends them: the routing
        # hashes then include the images' identifiers (the tokenizer loads them).
        with_media = extract_media(body["messages"])
        messages = normalize_messages(with_media.messages, parse_arguments=False)
        chat = chat_input_to_proto(messages, bool(body.get("add_generation_prompt", True)),
                                   bool(body.get("continue_final_message", False)),
                                   body.get("chat_template_kwargs"), body.get("tools"),
                                   body.get("documents"), media_inputs(with_media.media),
                                   body.get("mm_processor_kwargs"))
    except (ValueError, TypeError) as exc:
        raise BadBody(str(exc), "messages") from None
    # vLLM's chat `add_special_tokens` is off by default: the template writes them.
    return tpb.TokenizeRequest(chat=chat, add_special_tokens=bool(
        body.get("add_special_tokens", False)))


def _completion(prompt) -> tuple[tpb.TokenizeRequest, int]:
    """(the first prompt's tokenizer request, the number of prompts)."""
    if isinstance(prompt, str):
        return tpb.TokenizeRequest(prompt=prompt, add_special_tokens=True), 1
    if isinstance(prompt, list) and prompt:
        if all(_is_token(t) for t in prompt):
            return tpb.TokenizeRequest(token_ids=tpb.TokenIds(token_ids=prompt)), 1
        first = prompt[0]
        if all(isinstance(p, str) for p in prompt):
            return tpb.TokenizeRequest(prompt=first, add_special_tokens=True), len(prompt)
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return tpb.TokenizeRequest(token_ids=tpb.TokenIds(token_ids=first)), len(prompt)
    raise BadBody("`prompt` must be a string, a list of strings, a list of token ids or a "
                  "list of lists of token ids, not empty.", "prompt")


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31

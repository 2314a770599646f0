"""Gateway <-> tokenizer messages: chat input as typed messages.

The gateway validates chat messages and tools here, where the HTTP body becomes
a message (`chat_input_to_proto` raises ValueError naming the bad field), and the
tokenizer turns the message back into the dicts a chat template reads
(`chat_input_from_proto`). The known keys of OpenAI's messages and tools travel
as typed fields; only genuinely free-form JSON (a tool's parameter schema, the
template's extra variables) travels as a `JsonObject`, which keeps key order (a
template renders a schema as text). Keys outside the typed fields are not sent. (Decode options are built with the other sampling
fields, in `sampling_params`.)
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda import envs
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services.common.protocol.common import json_object_from_proto, json_object_to_proto


def chat_input_to_proto(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                        continue_final_message: bool,
                        chat_template_kwargs: Mapping[str, Any] | None = None,
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        documents: Sequence[Mapping[str, Any]] | None = None,
                        media: Sequence[pb.MediaInput] = (),
                        mm_processor_kwargs: Mapping[str, Any] | None = None) -> pb.ChatInput:
    """`messages` are normalized (content a string, None, or for a message with media
    its text parts and placeholders; see tokenizer.chat and multimodal.chat_parts);
    `media` are the items the placeholders stand for, in prompt order.
    Raises ValueError naming the field for a value of the wrong type."""
    msg = pb.ChatInput(add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message)
    msg.media.extend(media)
    if mm_processor_kwargs:
        _json(mm_processor_kwargs, msg.mm_processor_kwargs, "mm_processor_kwargs")
    if chat_template_kwargs:
        _json(chat_template_kwargs, msg.chat_template_kwargs, "chat_template_kwargs")
    for i, m in enumerate(messages):
        _unicode(_add_message, msg.messages.add(), m, f"messages[{i}]")
    for i, tool in enumerate(tools or ()):
        _unicode(_add_tool, msg.tools.add(), tool, f"tools[{i}]")
    for i, document in enumerate(documents or ()):
        where = f"documents[{i}]"
        _json(_object(document, where), msg.documents.add(), where)
    return msg


def chat_input_from_proto(msg: pb.ChatInput) -> dict[str, Any]:
    """Keyword arguments for `pagoda.tokenizer.chat.render_chat_template`; each
    message has the keys the sender gave (unset optional fields are left out)."""
    return {
        "messages": [_message_dict(m) for m in msg.messages],
        "add_generation_prompt": msg.add_generation_prompt,
        "continue_final_message": msg.continue_final_message,
        "chat_template_kwargs": (json_object_from_proto(msg.chat_template_kwargs)
                                 if msg.HasField("chat_template_kwargs") else None),
        "tools": [_tool_dict(t) for t in msg.tools] or None,
        "documents": [json_object_from_proto(d) for d in msg.documents] or None,
    }


# ---------------------------------------------------------------- to the wire
def media_inputs(refs: Sequence[Any]) -> list[pb.MediaInput]:
    """`pagoda.multimodal.chat_parts.MediaRef`s -> the tokenizer's MediaInputs: a URL as
    it is, image_embeds base64-decoded (size-capped). ValueError naming the part."""
    out = []
    for ref in refs:
        if ref.source == "url":
            out.append(pb.MediaInput(modality=ref.modality, url=ref.value))
            continue
        if isinstance(ref.value, Mapping):  # Qwen2-VL's rows with their grid
            out.append(pb.MediaInput(
                modality=ref.modality,
                embeds=_embeds_bytes(ref.value["image_embeds"], f"{ref.where}.image_embeds"),
                image_grid_thw=_embeds_bytes(ref.value["image_grid_thw"],
                                             f"{ref.where}.image_embeds.image_grid_thw")))
            continue
        out.append(pb.MediaInput(modality=ref.modality,
                                 embeds=_embeds_bytes(ref.value, f"{ref.where}.image_embeds")))
    return out


def _embeds_bytes(text: str, where: str) -> bytes:
    """A base64 tensor of an image_embeds part, decoded; ValueError naming `where`."""
    max_bytes = envs.get("PAGODA_MEDIA_MAX_BYTES")
    if len(text) * 3 // 4 > max_bytes + 3:
        raise ValueError(f"{where} is larger than the limit of {max_bytes} bytes.")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where} is not valid base64.") from None


def _add_message(item: pb.ChatMessage, m: Mapping[str, Any], where: str) -> None:
    item.role = m["role"]
    content = m.get("content")
    if isinstance(content, list):  # text parts and media placeholders, in order
        for part in content:
            if part.get("type") == "text":
                item.parts.add(text=_string(part.get("text"), f"{where}.content"))
            else:
                item.parts.add(media=part["type"])
    elif content is not None:
        item.content = content
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            setattr(item, key, _string(m[key], f"{where}.{key}"))
    reasoning = m.get("reasoning") or m.get("reasoning_content")  # vLLM's name, its old one
    if reasoning is not None:
        item.reasoning = _string(reasoning, f"{where}.reasoning")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list of tool calls.")
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        call = _object(call, at)
        function = _object(call.get("function"), f"{at}.function")
        item.tool_calls.add(
            id=_string(call.get("id", ""), f"{at}.id"),
            type=_string(call.get("type", "function"), f"{at}.type"),
            function=pb.FunctionCall(
                name=_string(function.get("name"), f"{at}.function.name"),
                arguments=_arguments(function.get("arguments", ""), f"{at}.function.arguments")))


def _arguments(value: Any, where: str) -> str:
    """A call's arguments travel as OpenAI's JSON string; an object (what
    `normalize_messages` hands templates) is encoded back to one."""
    if isinstance(value, Mapping):
        return json.dumps(value, ensure_ascii=False)
    return _string(value, where)


def _add_tool(item: pb.Tool, tool: Any, where: str) -> None:
    tool = _object(tool, where)
    function = _object(tool.get("function"), f"{where}.function")
    item.type = _string(tool.get("type", "function"), f"{where}.type")
    item.function.name = _string(function.get("name"), f"{where}.function.name")
    if function.get("description") is not None:
        item.function.description = _string(function["description"],
                                            f"{where}.function.description")
    if function.get("parameters") is not None:
        where = f"{where}.function.parameters"
        _json(_object(function["parameters"], where), item.function.parameters, where)


def _unicode(add, item, value: Any, where: str) -> None:
    """`add(item, value, where)`; a proto string must be UTF-8, so a lone surrogate
    (which JSON lets through) is the request's error, not a crash."""
    try:
        add(item, value, where)
    except UnicodeEncodeError:
        raise ValueError(f"{where} is not valid Unicode (an unpaired surrogate).") from None


def _json(value: Mapping[str, Any], out, where: str) -> None:
    out.SetInParent()  # set even when empty: {} is not "none"
    try:
        json_object_to_proto(value, out)
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"{where} must be a JSON object: {exc}") from None


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object.")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string.")
    return value


# ---------------------------------------------------------------- from the wire
def _message_dict(m: pb.ChatMessage) -> dict[str, Any]:
    item: dict[str, Any] = {"role": m.role,
                            "content": m.content if m.HasField("content") else None}
    if m.parts:
        item["content"] = [{"type": "text", "text": p.text} if p.WhichOneof("part") == "text"
                           else {"type": p.media} for p in m.parts]
    for key in ("name", "tool_call_id", "reasoning"):
        if m.HasField(key):
            item[key] = getattr(m, key)
    if m.tool_calls:
        item["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls]
    return item


def _tool_dict(tool: pb.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.HasField("description"):
        function["description"] = tool.function.description
    if tool.function.HasField("parameters"):
        function["parameters"] = json_object_from_proto(tool.function.parameters)
    return {"type": tool.type, "function": function}

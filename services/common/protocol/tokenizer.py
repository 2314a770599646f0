"""Gateway <-> tokenizer messages: chat messages and decode options."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.sampling_params import SamplingParams


def chat_input_to_proto(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                        continue_final_message: bool,
                        chat_template_kwargs: Mapping[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None) -> pb.ChatInput:
    """`messages` are normalized (content a string or None; see tokenizer.chat)."""
    msg = pb.ChatInput(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs_json=json.dumps(chat_template_kwargs) if chat_template_kwargs else "",
        tools_json=json.dumps(tools) if tools else "",
    )
    for m in messages:
        fields = {k: v for k, v in m.items() if k not in ("role", "content")}
        item = msg.messages.add(role=m["role"], fields_json=json.dumps(fields) if fields else "")
        if m.get("content") is not None:
            item.content = m["content"]
    return msg


def chat_input_from_proto(msg: pb.ChatInput) -> dict[str, Any]:
    """Keyword arguments for `pagoda.tokenizer.chat.render_chat_template`."""
    messages = []
    for m in msg.messages:
        item: dict[str, Any] = {"role": m.role}
        item["content"] = m.content if m.HasField("content") else None
        if m.fields_json:
            item.update(json.loads(m.fields_json))
        messages.append(item)
    return {
        "messages": messages,
        "add_generation_prompt": msg.add_generation_prompt,
        "continue_final_message": msg.continue_final_message,
        "chat_template_kwargs": (json.loads(msg.chat_template_kwargs_json)
                                 if msg.chat_template_kwargs_json else None),
        "tools": json.loads(msg.tools_json) if msg.tools_json else None,
    }


def decode_options_to_proto(prompt_token_ids: Sequence[int], params: SamplingParams
                            ) -> pb.DecodeOptions:
    return pb.DecodeOptions(
        prompt_token_ids=prompt_token_ids,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        stop=params.stop or [],
        include_stop_str_in_output=params.include_stop_str_in_output,
    )

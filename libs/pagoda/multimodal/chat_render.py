"""Render a chat whose messages carry media placeholders: one function for the served
path (the tokenizer service) and the offline `LLM.chat`, so both write the same prompt.

A template that reads content parts (vLLM's "openai" content format: it loops over a
message's content) gets the parts and writes the model's placeholder itself; any other
("string" format) gets each message flattened with the placeholder text written before
its text, one per line, as vLLM does (`chat_parts.flatten_placeholders`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.multimodal.chat_parts import flatten_placeholders, template_reads_parts
from pagoda.tokenizer.chat import render_chat_template


def placeholder_texts(processor: Any) -> dict[str, str]:
    """Modality -> the text a string-format prompt names an item with: the processor's
    `prompt_placeholders` where the family writes more than its placeholder token (vLLM's
    Qwen2-VL: "<|vision_start|><|image_pad|><|vision_end|>"), else the placeholder
    token's text ("<image>"); {} without a processor."""
    if processor is None:
        return {}
    own = getattr(processor, "prompt_placeholders", None) or {}
    return {modality: own.get(modality) or processor.tokenizer.convert_ids_to_tokens(token_id)
            for modality, token_id in processor.placeholder_token_ids.items()}


def render_media_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                      placeholders: Mapping[str, str], **template_args: Any) -> str:
    """The prompt text for `messages` (as `chat_parts.extract_media` returns them);
    `template_args` are `render_chat_template`'s."""
    kwargs = template_args.get("chat_template_kwargs") or {}
    template = kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if not template_reads_parts(template):
        messages = flatten_placeholders(list(messages), placeholders)
    return render_chat_template(tokenizer, messages, **template_args)

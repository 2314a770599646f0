"""OpenAI chat content parts -> the conversation a chat template renders + the media.

vLLM's part types, by modality:

    image_url     {"type": "image_url", "image_url": "URL" | {"url": "URL", "detail": ...}}
    image_embeds  {"type": "image_embeds", "image_embeds": "<base64 of torch.save(tensor)>"}
    image_pil     {"type": "image_pil", "image_pil": PIL.Image}      (offline LLM.chat only)
    text          {"type": "text", "text": "..."} (and OpenAI's input_text, refusal)

A message whose content holds media keeps its content as a list, the form HF's
multimodal templates iterate over: each text part becomes {"type": "text", "text": ...}
and each media part {"type": "image"} (the template writes the model's placeholder,
e.g. LLaVA's "<image>", which the processor then expands). Messages without media are
left as they are (`pagoda.tokenizer.chat.normalize_messages` flattens them as before).

`MediaRef`s come back in prompt order: the n-th placeholder the template writes is the
n-th ref of its modality. Nothing is fetched or decoded here: this runs in the gateway
(cheap checks, early 400s) and again where the media are loaded (the tokenizer service,
the offline LLM).

Other modalities (`input_audio`, `audio_url`, `video_url`) are refused by name: adding
one means a part type here (its placeholder is {"type": "audio" | "video"}), a loader
in `media.py` (audio: a decoder and resampler; video: frame sampling) and a processor
and encoder for a model family; the MediaRef / placeholder / feature shapes stay.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IMAGE = "image"
# Part type -> (modality, how the item is given).
MEDIA_PART_TYPES = {"image_url": (IMAGE, "url"), "image_embeds": (IMAGE, "embeds"),
                    "image_pil": (IMAGE, "pil")}
# Part types vLLM takes that Pagoda does not yet: refused by name.
NOT_YET_PART_TYPES = {"input_audio": "audio", "audio_url": "audio", "video_url": "video",
                      "image_embeds_list": IMAGE}
TEXT_PART_TYPES = frozenset({"text", "input_text", "refusal"})
# The placeholders a normalized conversation carries (what templates read).
PLACEHOLDER_TYPES = frozenset({IMAGE, "audio", "video"})


@dataclass(frozen=True)
class MediaRef:
    """One media item a chat names, not loaded yet.

    `source` is "url" (value: the URL string), "embeds" (value: the base64 string of a
    `torch.save`d tensor, or for Qwen2-VL a dict of two: `image_embeds` and
    `image_grid_thw`) or "pil" (value: a PIL image; offline only). `where` names the
    part for error messages ("messages[0].content[1]")."""

    modality: str
    source: str
    value: Any
    where: str


@dataclass
class ChatWithMedia:
    """`messages` for the chat template (media parts replaced by placeholders) and the
    media in prompt order. `media` is empty for a text-only chat."""

    messages: list[dict[str, Any]]
    media: list[MediaRef]

    def count(self, modality: str) -> int:
        return sum(ref.modality == modality for ref in self.media)


def extract_media(messages: Sequence[Mapping[str, Any]],
                  limit_mm_per_prompt: Mapping[str, int] | None = None,
                  allow_pil: bool = False) -> ChatWithMedia:
    """Split `messages` into the template's conversation and the media refs.

    Raises ValueError naming the part for: an unknown or not-yet-supported part type, a
    malformed media part, `image_pil` where `allow_pil` is False (served API), and more
    items of a modality than `limit_mm_per_prompt` allows (vLLM's --limit-mm-per-prompt;
    a modality absent from the mapping is unlimited, 0 refuses it). Anything else about
    the messages (roles, text types) is left to `normalize_messages`."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a non-empty list of chat messages.")
    out_messages: list[dict[str, Any]] = []
    media: list[MediaRef] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not _has_media(content):
            out_messages.append(message)  # type: ignore[arg-type]
            continue
        parts = [_part(part, f"messages[{i}].content[{j}]", media, allow_pil)
                 for j, part in enumerate(content)]
        out_messages.append({**message, "content": parts})
    check_limits(Counter(ref.modality for ref in media), limit_mm_per_prompt)
    return ChatWithMedia(out_messages, media)


def check_limits(counts: Mapping[str, int], limit_mm_per_prompt: Mapping[str, int] | None
                 ) -> None:
    """vLLM's rule and message: at most `limit[modality]` items of each modality."""
    for modality, count in counts.items():
        limit = (limit_mm_per_prompt or {}).get(modality)
        if limit is not None and count > limit:
            raise ValueError(f"At most {limit} {modality}(s) may be provided in one prompt; "
                             f"got {count} (--limit-mm-per-prompt).")


def _has_media(content: Any) -> bool:
    """Whether a content list holds any non-text part (which then goes through `_part`,
    so an unknown type is refused here by name)."""
    if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
        return False
    return any(isinstance(p, Mapping) and p.get("type") not in TEXT_PART_TYPES
               for p in content)


def _part(part: Any, where: str, media: list[MediaRef], allow_pil: bool) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        raise ValueError(f"{where} must be an object with a 'type'.")
    kind = part.get("type")
    if kind in TEXT_PART_TYPES:
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise ValueError(f"{where}.{key} must be a string.")
        return {"type": "text", "text": part[key]}
    if kind in NOT_YET_PART_TYPES:
        raise ValueError(f"{where}: content part type {kind!r} is not supported yet; "
                         "Pagoda accepts image_url, image_embeds and text parts.")
    if kind not in MEDIA_PART_TYPES:
        raise ValueError(f"{where}: content part type {kind!r} is not supported; use "
                         "text, image_url or image_embeds parts.")
    modality, source = MEDIA_PART_TYPES[kind]
    value = part.get(kind)
    if source == "url":
        value = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}.image_url.url must be a non-empty string.")
    elif source == "embeds":
        if isinstance(value, Mapping):  # vLLM's form for Qwen2-VL: the rows and their grid
            extra = set(value) - {"image_embeds", "image_grid_thw"}
            if extra or not all(isinstance(value.get(k), str) and value.get(k)
                                for k in ("image_embeds", "image_grid_thw")):
                raise ValueError(f"{where}.image_embeds as an object takes 'image_embeds' and "
                                 "'image_grid_thw', each a base64 string of a tensor saved "
                                 "with torch.save.")
            value = dict(value)
        elif not isinstance(value, str) or not value:
            raise ValueError(f"{where}.image_embeds must be a base64 string of a tensor "
                             "saved with torch.save (or, for Qwen2-VL, an object of "
                             "'image_embeds' and 'image_grid_thw').")
    elif not allow_pil:
        raise ValueError(f"{where}: image_pil parts are for the offline LLM.chat only; "
                         "send image_url parts to the server.")
    elif not hasattr(value, "size") or not hasattr(value, "convert"):
        raise ValueError(f"{where}.image_pil must be a PIL image.")
    media.append(MediaRef(modality, source, value, where))
    return {"type": modality}


# A template that reads a message's content as a list of parts ("openai" content format,
# vLLM's detection): it loops over the content or tests a part's type.
_ITERATES_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+(message|msg|m)(\[['\"]content['\"]\]|\.content)|"
    r"\[['\"]type['\"]\]\s*==|\.type\s*==")


def template_reads_parts(template: str | None) -> bool:
    """Whether a chat template renders content parts itself (else: "string" format)."""
    return bool(template) and bool(_ITERATES_CONTENT.search(template))


def flatten_placeholders(messages: list[dict[str, Any]], placeholders: Mapping[str, str]
                         ) -> list[dict[str, Any]]:
    """For a template that reads content as a string (vLLM's "string" content format):
    each message's placeholders become the model's placeholder text, one per line before
    the text (`<image>\\n<image>\\nquestion`), as vLLM writes them."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        marks = [placeholders[p["type"]] for p in content if p.get("type") in placeholders]
        texts = [p["text"] for p in content if p.get("type") == "text"]
        out.append({**message, "content": "\n".join(marks + ["\n".join(texts)])})
    return out

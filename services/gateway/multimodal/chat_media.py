"""A chat's media parts, checked cheaply before the tokenizer service loads them.

The gateway splits image parts from the messages (`pagoda.multimodal.chat_parts`),
enforces --limit-mm-per-prompt, and base64-decodes image_embeds parts (their size
capped) into the typed `MediaInput`s the tokenizer takes. It fetches nothing and
decodes no image: the tokenizer service is the cluster's processor (allow-lists,
size and pixel caps, the HF processor). Features coming back are checked again
here (`check_features`), never trusted because they came from inside.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.multimodal.chat_parts import ChatWithMedia, extract_media
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.common.protocol.multimodal import features_from_proto
from pagoda.services.common.protocol.tokenizer import media_inputs
from pagoda.services.gateway.errors import APIError


def split_media(messages: Sequence[Mapping[str, Any]],
                limit_mm_per_prompt: Mapping[str, int] | None
                ) -> tuple[ChatWithMedia, list[tpb.MediaInput]]:
    """(messages with placeholders + refs, the tokenizer's MediaInputs); ValueError
    naming the part for bad input."""
    chat = extract_media(messages, limit_mm_per_prompt)
    return chat, media_inputs(chat.media)


def received_features(reply: tpb.TokenizeResponse) -> list[MultiModalFeature]:
    """The tokenizer's features, checked; tensors kept as protos (no torch here)."""
    try:
        return features_from_proto(reply.mm_features, len(reply.token_ids), as_torch=False)
    except ValueError as exc:
        raise APIError(f"the tokenizer service sent invalid media features: {exc}",
                       status=502) from None

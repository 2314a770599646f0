"""A chat's media parts, checked cheaply before the tokenizer service loads them.

The gateway splits image parts from the messages (`pagoda.multimodal.chat_parts`),
enforces --limit-mm-per-prompt, and base64-decodes image_embeds parts (their size
capped) into the typed `MediaInput`s the tokenizer takes. It fetches nothing and
decodes no image: the tokenizer service is the cluster's processor (allow-lists,
size and pixel caps, the HF processor). Features coming back are checked again
here (`check_features`), never trusted because they came from inside.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda import envs
from pagoda.multimodal.chat_parts import ChatWithMedia, extract_media
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.common.protocol.multimodal import features_from_proto
from pagoda.services.gateway.errors import APIError

PD_REFUSAL = ("Image inputs are not supported with prefill/decode disaggregation yet: the "
              "decode replica would need the prefill side's encoder output. Serve "
              "multimodal models without --prefill-replicas/--decode-replicas.")


def split_media(messages: Sequence[Mapping[str, Any]],
                limit_mm_per_prompt: Mapping[str, int] | None
                ) -> tuple[ChatWithMedia, list[tpb.MediaInput]]:
    """(messages with placeholders + refs, the tokenizer's MediaInputs); ValueError
    naming the part for bad input."""
    chat = extract_media(messages, limit_mm_per_prompt)
    return chat, [_media_input(ref) for ref in chat.media]


def _media_input(ref) -> tpb.MediaInput:
    if ref.source == "url":
        return tpb.MediaInput(modality=ref.modality, url=ref.value)
    max_bytes = envs.get("PAGODA_MEDIA_MAX_BYTES")
    if len(ref.value) * 3 // 4 > max_bytes + 3:
        raise ValueError(f"{ref.where}.image_embeds is larger than the limit of {max_bytes} "
                         "bytes.")
    try:
        data = base64.b64decode(ref.value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{ref.where}.image_embeds is not valid base64.") from None
    return tpb.MediaInput(modality=ref.modality, embeds=data)


def received_features(reply: tpb.TokenizeResponse) -> list[MultiModalFeature]:
    """The tokenizer's features, checked; tensors kept as protos (no torch here)."""
    try:
        return features_from_proto(reply.mm_features, len(reply.token_ids), as_torch=False)
    except ValueError as exc:
        raise APIError(f"the tokenizer service sent invalid media features: {exc}",
                       status=502) from None

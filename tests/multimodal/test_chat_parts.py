"""pagoda.multimodal.chat_parts: OpenAI content parts -> template conversation + media."""

from __future__ import annotations

import pytest
from PIL import Image

from pagoda.multimodal.chat_parts import MediaRef, extract_media
from pagoda.tokenizer.chat import normalize_messages

URL = "http://127.0.0.1:1/cat.png"


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_image_parts_become_placeholders_and_refs_in_prompt_order():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [
                    {"type": "text", "text": "compare"},
                    {"type": "image_url", "image_url": {"url": URL, "detail": "low"}},
                    {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
                    {"type": "image_embeds", "image_embeds": "ZW1iZWRz"}]}]
    chat = extract_media(messages)
    assert chat.messages[0] == messages[0]  # text-only messages are untouched
    assert chat.messages[1]["content"] == [{"type": "text", "text": "compare"},
                                           {"type": "image"}, {"type": "image"},
                                           {"type": "image"}]
    assert chat.media == [
        MediaRef("image", "url", URL, "messages[1].content[1]"),
        MediaRef("image", "url", "data:image/png;base64,AAAA", "messages[1].content[2]"),
        MediaRef("image", "embeds", "ZW1iZWRz", "messages[1].content[3]")]
    # The conversation survives the text path's normalization with its placeholders.
    assert normalize_messages(chat.messages)[1]["content"][1] == {"type": "image"}


def test_a_text_only_chat_has_no_media():
    chat = extract_media(user({"type": "text", "text": "hi"}))
    assert chat.media == [] and normalize_messages(chat.messages)[0]["content"] == "hi"


def test_the_limit_per_prompt_is_enforced():
    two = user({"type": "image_url", "image_url": {"url": URL}},
               {"type": "image_url", "image_url": {"url": URL}})
    assert extract_media(two, {"image": 2}).count("image") == 2
    with pytest.raises(ValueError, match="At most 1 image"):
        extract_media(two, {"image": 1})
    with pytest.raises(ValueError, match="At most 0 image"):
        extract_media(two, {"image": 0})


@pytest.mark.parametrize("part,match", [
    ({"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
     "'input_audio' is not supported yet"),
    ({"type": "video_url", "video_url": {"url": URL}}, "'video_url' is not supported yet"),
    ({"type": "image", "image": "x"}, "'image' is not supported"),
    ({"type": "image_url", "image_url": {"detail": "low"}}, r"content\[0\].image_url.url"),
    ({"type": "image_embeds", "image_embeds": 3}, "image_embeds must be a base64"),
    ({"type": "image_pil", "image_pil": Image.new("RGB", (2, 2))}, "offline LLM.chat only"),
])
def test_bad_parts_are_refused_by_name(part, match):
    with pytest.raises(ValueError, match=match):
        extract_media(user(part))


def test_pil_images_are_taken_offline():
    image = Image.new("RGB", (3, 3))
    chat = extract_media(user({"type": "image_pil", "image_pil": image}), allow_pil=True)
    assert chat.media[0].value is image and chat.media[0].source == "pil"

"""Done-when for images through the cluster: `pagoda serve` on a tiny random LLaVA, the
official openai client sends an image (a data: URL, then a loopback http URL) with a
question, and the answer equals the offline engine's and HF transformers' greedy
tokens on the same weights (float32). The same image again is a prefix-cache hit that
/metrics shows, and the worker's encoder cache counts its lookups."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from llava_cases import pattern_image
from llava_parity import hf_reference
from media_server import MediaServer
from serve_cluster import ServeProcess

from pagoda import LLM, SamplingParams
from pagoda.multimodal.chat_parts import extract_media
from pagoda.multimodal.chat_render import placeholder_texts, render_media_chat
from pagoda.multimodal.processing import load_mm_processor
from pagoda.services.common.redis_server import PrivateRedis

pytestmark = pytest.mark.slow
MAX_TOKENS = 6
QUESTION = "What is in the picture?"


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def served(llava_clip_dir):
    with MediaServer() as media, PrivateRedis() as redis:
        media.images["/picture.png"] = png(pattern_image(40, 52, 1))
        serve = ServeProcess([llava_clip_dir, "--served-model-name", "llava", "--dtype",
                              "float32", "--max-model-len", "256", "--block-size", "16",
                              "--allowed-media-domains", "127.0.0.1",
                              "--limit-mm-per-prompt", '{"image": 2}',
                              "--redis-url", redis.url])
        try:
            yield serve, media
        finally:
            assert serve.stop() == 0, serve.stderr_text()[-3000:]


def messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def ask(serve, url: str) -> str:
    client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="llava", messages=messages(url),
                                           max_tokens=MAX_TOKENS, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    return reply.choices[0].message.content


def offline_reference(path: str):
    """(offline text, offline token ids, HF token ids) for the question on the picture,
    with the prompt rendered by the library function the tokenizer service uses."""
    processor = load_mm_processor(path)
    chat = extract_media(messages("data:,"))
    prompt = render_media_chat(processor.tokenizer, chat.messages, placeholder_texts(processor),
                               add_generation_prompt=True)
    image = pattern_image(40, 52, 1)
    llm = LLM(model=path, dtype="float32", max_model_len=256)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    pixels = processor.process_image(image, {})["pixel_values"][None]
    hf_tokens, _, _ = hf_reference(path, out.prompt_token_ids, pixels, MAX_TOKENS)
    return out.outputs[0].text, list(out.outputs[0].token_ids), hf_tokens


def test_a_served_image_answers_as_offline_and_hf(served, llava_clip_dir):
    serve, media = served
    text, tokens, hf_tokens = offline_reference(llava_clip_dir)
    assert tokens == hf_tokens
    data_url = "data:image/png;base64," + base64.b64encode(media.images["/picture.png"]).decode()
    assert ask(serve, data_url) == text
    assert ask(serve, media.url("/picture.png")) == text


def test_the_same_image_again_is_a_prefix_hit_on_metrics(served):
    serve, media = served
    media.images["/again.png"] = png(pattern_image(33, 47, 7))

    def hits() -> float:
        return sum(v for (name, _), v in serve.scrape().items()
                   if name == "vllm:prefix_cache_hits_total")

    first = ask(serve, media.url("/again.png"))
    before = hits()
    assert ask(serve, media.url("/again.png")) == first
    # The run's blocks are keyed by the image's identifier: the repeat reuses them.
    assert hits() - before >= 16
    # Same text, another image: the first block already overlaps the image's run, so
    # nothing is shared (equal placeholder tokens never stand for different pixels).
    media.images["/another.png"] = png(pattern_image(33, 47, 8))
    before = hits()
    ask(serve, media.url("/another.png"))
    assert hits() == before

"""Done-when for images through the cluster: `pagoda serve` on a tiny random LLaVA, the
official openai client sends an image (a data: URL, then a loopback http URL) with a
question, and the answer equals offline `LLM.chat`'s and HF transformers' greedy
tokens on the same weights (float32). The same image again is a prefix-cache hit that
/metrics shows (its pixels then never reach the worker's encoder); a bad image is a 400
and the cluster serves on; the dashboards' multimodal panels answer from a real
Prometheus scraping this cluster (the conftest's `prometheus` fixture)."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import openai
import pytest
from media_server import MediaServer
from obs_harness import panel_queries, panel_query_failures
from serve_cluster import ServeProcess, wait_until

from pagoda import LLM, SamplingParams
from pagoda.multimodal.processing import load_mm_processor
from pagoda.services.common.redis_server import PrivateRedis

# The tiny LLaVA builder and the HF reference live with the engine's multimodal tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multimodal"))
from llava_cases import pattern_image, save_tiny_llava  # noqa: E402
from llava_parity import hf_reference  # noqa: E402

pytestmark = pytest.mark.slow
MAX_TOKENS = 6
QUESTION = "What is in the picture?"


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_llava(tmp_path_factory.mktemp("llava_served"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def media():
    with MediaServer() as server:
        server.images["/picture.png"] = png(pattern_image(40, 52, 1))
        yield server


@pytest.fixture(scope="module")
def cluster(llava_dir, media):
    with PrivateRedis() as redis:
        serve = ServeProcess([llava_dir, "--served-model-name", "llava", "--dtype",
                              "float32", "--max-model-len", "256", "--block-size", "16",
                              "--allowed-media-domains", "127.0.0.1",
                              "--limit-mm-per-prompt", '{"image": 2}',
                              "--redis-url", redis.url])
        try:
            yield serve
        finally:
            assert serve.stop() == 0, serve.stderr_text()[-3000:]


def messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=120)


def ask(serve, url: str) -> str:
    reply = client(serve).chat.completions.create(
        model="llava", messages=messages(url), max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True})
    return reply.choices[0].message.content


def offline_reference(path: str, data_url: str):
    """(offline LLM.chat text, its token ids, HF generate's token ids) for the question on
    the picture, HF given the prompt ids LLM.chat built and the processor's pixels."""
    llm = LLM(model=path, dtype="float32", max_model_len=256)
    out = llm.chat(messages(data_url), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True), use_tqdm=False)[0]
    pixels = load_mm_processor(path).process_image(pattern_image(40, 52, 1),
                                                   {})["pixel_values"][None]
    hf_tokens, _, _ = hf_reference(path, out.prompt_token_ids, pixels, MAX_TOKENS)
    return out.outputs[0].text, list(out.outputs[0].token_ids), hf_tokens


def test_a_served_image_answers_as_offline_and_hf(cluster, media, llava_dir):
    data_url = "data:image/png;base64," + base64.b64encode(media.images["/picture.png"]).decode()
    text, tokens, hf_tokens = offline_reference(llava_dir, data_url)
    assert tokens == hf_tokens
    assert ask(cluster, data_url) == text
    assert ask(cluster, media.url("/picture.png")) == text


def metric(serve, name: str) -> float:
    return sum(v for (n, _), v in serve.scrape().items() if n == name)


def test_the_same_image_again_is_a_prefix_hit_and_is_not_encoded_again(cluster, media):
    media.images["/again.png"] = png(pattern_image(33, 47, 7))
    first = ask(cluster, media.url("/again.png"))
    hits = metric(cluster, "vllm:prefix_cache_hits_total")
    lookups = metric(cluster, "pagoda_encoder_cache_queries_total")
    assert ask(cluster, media.url("/again.png")) == first
    # The run's blocks are keyed by the image's identifier: the repeat reuses them, and
    # its image run is all cached, so the worker neither gets its pixels nor looks it up.
    assert metric(cluster, "vllm:prefix_cache_hits_total") - hits >= 16
    assert metric(cluster, "pagoda_encoder_cache_queries_total") == lookups
    # Same text, another image: the first block already overlaps the image's run, so
    # nothing is shared (equal placeholder tokens never stand for different pixels).
    media.images["/another.png"] = png(pattern_image(33, 47, 8))
    hits = metric(cluster, "vllm:prefix_cache_hits_total")
    ask(cluster, media.url("/another.png"))
    assert metric(cluster, "vllm:prefix_cache_hits_total") == hits
    assert metric(cluster, "pagoda_encoder_cache_queries_total") == lookups + 1


def test_a_bad_image_is_a_400_and_the_cluster_serves_on(cluster, media):
    for url, match in ((media.url("/garbage.png"), "cannot be decoded"),
                       (media.url("/missing"), "HTTP 404"),
                       (media.url("/ok.png", host="localhost"), "allowed-media-domains")):
        with pytest.raises(openai.BadRequestError, match=match):
            ask(cluster, url)
    assert metric(cluster, "pagoda_tokenizer_media_fetch_failures_total") >= 2
    assert ask(cluster, media.url("/ok.png"))


def test_the_multimodal_dashboard_panels_answer(cluster, media, prometheus):
    queries = panel_queries("multimodal")
    assert len(queries) == 5
    assert wait_until(lambda: prometheus.values("up") == [1.0], 30, 0.5)
    failures: list[str] = []
    seeds = iter(range(100, 200))

    def answered() -> bool:
        # A new picture each round, fetched over http: fetches, processor-cache and
        # encoder-cache lookups move while Prometheus scrapes.
        seed = next(seeds)
        media.images[f"/p{seed}.png"] = png(pattern_image(30, 30, seed))
        ask(cluster, media.url(f"/p{seed}.png"))
        failures[:] = panel_query_failures(prometheus, queries, "llava")
        return not failures
    assert wait_until(answered, 60, 1.0), failures


@pytest.mark.extended
def test_a_served_qwen2_vl_image_answers_as_offline(tmp_path, smollm2_tokenizer, media):
    """Another family through the same path: Qwen2-VL's dynamic-resolution pixels and
    int64 image grid travel typed, and M-RoPE positions come out as offline."""
    from qwen2_vl_cases import save_tiny_qwen2_vl
    path = save_tiny_qwen2_vl(tmp_path / "qwen2_vl", smollm2_tokenizer)
    url = "data:image/png;base64," + base64.b64encode(png(pattern_image(50, 37, 4))).decode()
    llm = LLM(model=path, dtype="float32", max_model_len=512)
    want = llm.chat(messages(url), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True), use_tqdm=False)[0]
    del llm
    with PrivateRedis() as redis:
        serve = ServeProcess([path, "--served-model-name", "llava", "--dtype", "float32",
                              "--max-model-len", "512", "--redis-url", redis.url])
        try:
            assert ask(serve, url) == want.outputs[0].text
        finally:
            assert serve.stop() == 0, serve.stderr_text()[-3000:]

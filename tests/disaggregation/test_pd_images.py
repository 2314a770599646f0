"""Images through prefill/decode disaggregation: `pagoda serve --prefill-replicas 1
--decode-replicas 1` on a tiny random LLaVA. The openai client's answer to an image and
a question equals offline `LLM.chat`'s (float32, greedy); the prefill replica encodes
the image, the decode replica imports the prompt's KV (its blocks keyed by the image's
identifier, as on the prefill side) and never encodes: its worker never looks an image
up in its encoder cache, and its scheduler got the item without pixels."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import openai
import pytest
from media_server import MediaServer
from pd_cluster import PREFILL_HEADER, metric, role_address, role_process
from serve_cluster import ServeProcess, flag_value, scheduler_load, wait_until

from pagoda import LLM, SamplingParams
from pagoda.services.common.redis_server import PrivateRedis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multimodal"))
from llava_cases import pattern_image, save_tiny_llava  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.extended]
MAX_TOKENS = 6
# Long enough that the image's run ends in a full block the prefill replica leases
# (a run reaching the prompt's partial last block is sent with its pixels).
QUESTION = ("What is in the picture? Describe its colours, its shapes and where they lie, "
            "in a few plain words please.")


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_llava(tmp_path_factory.mktemp("llava_pd"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def media():
    with MediaServer() as server:
        server.images["/picture.png"] = png(pattern_image(40, 52, 1))
        yield server


def start(llava_dir, redis_url: str, *extra: str) -> ServeProcess:
    return ServeProcess([llava_dir, "--served-model-name", "llava", "--dtype", "float32",
                         "--max-model-len", "256", "--block-size", "16",
                         "--allowed-media-domains", "127.0.0.1", "--redis-url", redis_url,
                         "--prefill-replicas", "1", "--decode-replicas", "1", *extra])


@pytest.fixture(scope="module")
def pd(llava_dir, media):
    with PrivateRedis() as redis:
        serve = start(llava_dir, redis.url)
        try:
            yield serve
        finally:
            assert serve.stop() == 0, serve.stderr_text()[-3000:]


@pytest.fixture(scope="module")
def offline(llava_dir, media) -> str:
    """Offline LLM.chat's answer (greedy, float32) to the question on the picture."""
    llm = LLM(model=llava_dir, dtype="float32", max_model_len=256)
    out = llm.chat(messages(data_url(media)), SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    return out.outputs[0].text


def data_url(media) -> str:
    return "data:image/png;base64," + base64.b64encode(media.images["/picture.png"]).decode()


def messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def ask(serve, url: str):
    client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.with_raw_response.create(
        model="llava", messages=messages(url), max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True})


def test_an_image_through_prefill_and_decode_answers_as_offline(pd, media, offline):
    decode = role_address(pd, "scheduler", "kv_consumer")
    pulled = metric(pd, "pagoda_kv_transfer_blocks_total")
    for url in (data_url(media), media.url("/picture.png")):
        raw = ask(pd, url)
        assert PREFILL_HEADER in raw.headers  # prefilled on the prefill replica
        assert raw.parse().choices[0].message.content == offline
    # The decode replica imported the prompt's blocks (image run included) ...
    assert metric(pd, "pagoda_kv_transfer_blocks_total") > pulled
    # ... and never encoded: its worker looked no image up; the prefill side's did.
    assert wait_until(lambda: replica_metric(pd, "kv_producer",
                                             "pagoda_encoder_cache_queries_total") >= 1, 10)
    assert replica_metric(pd, "kv_consumer", "pagoda_encoder_cache_queries_total") == 0
    # The prefill replica got the pixels (both times); the decode replica none.
    assert replica_metric(pd, "kv_producer", "pagoda_mm_input_bytes_total") > 0
    assert replica_metric(pd, "kv_consumer", "pagoda_mm_input_bytes_total") == 0
    assert scheduler_load(decode).num_running == 0


def replica_metric(pd, role: str, name: str) -> float:
    """`name` of the scheduler in `role` (the gateway's merged /metrics label each peer's
    series with its metrics address)."""
    port = flag_value(role_process(pd, "scheduler", role).cmdline(), "--metrics-port")
    return sum(v for (n, ls), v in pd.scrape().items()
               if n == name and dict(ls).get("instance", "").endswith(f":{port}"))


def test_a_decode_side_whose_pull_fails_gets_the_pixels_and_answers_the_same(llava_dir, media,
                                                                            offline):
    """Every pull times out: the decode replica lacks the image's KV, refuses to compute
    its run without pixels, and the gateway sends it the request again with them."""
    with PrivateRedis() as redis:
        serve = start(llava_dir, redis.url, "--kv-transfer-timeout", "0.000001",
                      "--kv-lease-timeout", "60")
        try:
            raw = ask(serve, data_url(media))
            assert PREFILL_HEADER in raw.headers
            assert raw.parse().choices[0].message.content == offline
            assert metric(serve, "pagoda_kv_transfer_failures_total", reason="timeout") >= 1
            assert metric(serve, "pagoda_gateway_disagg_fallbacks_total",
                          kind="media_recompute") == 1
            assert replica_metric(serve, "kv_consumer", "pagoda_mm_input_bytes_total") > 0
        finally:
            assert serve.stop() == 0, serve.stderr_text()[-3000:]

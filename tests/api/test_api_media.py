"""Images through the real gateway and the real tokenizer service (the cluster's
processor) with the official openai client; a scripted scheduler stands in for the
model. Each bad input is a 400 in OpenAI's error JSON naming what is wrong, and the
gateway still serves afterwards. A good image reaches the scheduler as typed features
(the tiny LLaVA's processor output) with its placeholder run expanded."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import openai
import pytest
from api_fakes import Gateway, Peers
from media_server import MediaServer, png_bytes

# The tiny LLaVA checkpoint builder lives with the engine's multimodal tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multimodal"))
from llava_cases import save_tiny_llava  # noqa: E402

from pagoda.multimodal.media import MediaLimits
from pagoda.multimodal.processing import load_mm_processor
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.common.protocol.multimodal import features_from_proto
from pagoda.services.tokenizer.media_prompt import MediaPreprocessor

LIMITS = dict(timeout=0.5, max_retries=0, cache_dir=None, max_bytes=100_000, max_pixels=5_000)


@pytest.fixture(scope="module")
def media_server():
    with MediaServer(slow_seconds=2.0) as server:
        yield server


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_llava(tmp_path_factory.mktemp("llava"), smollm2_tokenizer)


def _client(peers):
    gateway = Gateway(peers)
    return gateway, openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused",
                                  max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def llava(llava_dir, tmp_path_factory):
    from pagoda.tokenizer.loader import load_tokenizer
    tokenizer = load_tokenizer(llava_dir)
    allowed = tmp_path_factory.mktemp("allowed")
    (allowed / "cat.png").write_bytes(png_bytes((40, 30)))
    limits = MediaLimits(allowed_media_domains=frozenset({"127.0.0.1"}),
                         allowed_local_media_path=str(allowed), **LIMITS)
    media = MediaPreprocessor(load_mm_processor(llava_dir, tokenizer),
                              "LlavaForConditionalGeneration", llava_dir, limits, {"image": 2})
    peers = Peers(tokenizer, llava_dir, media)
    gateway, client = _client(peers)
    yield client, peers, allowed
    gateway.stop()
    peers.stop()


def ask(client, *images, text="What is in the image?"):
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return client.chat.completions.create(model="fake-model", max_tokens=3,
                                          messages=[{"role": "user", "content": parts}])


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_an_image_reaches_the_scheduler_as_typed_features(llava, media_server):
    client, peers, _ = llava
    for url in (data_url(png_bytes((40, 30))), media_server.url("/ok.png")):
        assert ask(client, url).choices[0].message.content
        request = peers.scheduler.requests[-1]
        features = features_from_proto(request.mm_features, len(request.prompt_token_ids))
        assert len(features) == 1
        f = features[0]
        assert f.data["pixel_values"].shape == (3, 30, 30)  # the tower's crop
        image_id = peers.tokenizer.tokenizer.convert_tokens_to_ids("<image>")
        run = request.prompt_token_ids[f.offset:f.end]
        assert run == [image_id] * f.length and f.length >= 24  # 5x5 patches
    # The same picture twice has the same identifier; another picture another one.
    ask(client, data_url(png_bytes((40, 30))))
    again = peers.scheduler.requests[-1].mm_features[0].identifier
    assert again == peers.scheduler.requests[-3].mm_features[0].identifier
    assert again != peers.scheduler.requests[-2].mm_features[0].identifier


def bad_request(client, *urls) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, *urls)
    body = info.value.body
    assert info.value.status_code == 400 and body["type"] == "BadRequestError", body
    assert body["param"] == "messages", body
    return body


@pytest.mark.parametrize("what,url,match", [
    ("undecodable", "/garbage.png", "cannot be decoded"),
    ("too many bytes", "/big.bin", "larger than the limit of 100000 bytes"),
    ("outside the allowed domains", "localhost:/ok.png", "not in --allowed-media-domains"),
    ("a timeout", "/slow.png", "timed out after 0.5 s"),
    ("a redirect to a disallowed host", "redirect", "redirected to a host that is not allowed"),
])
def test_bad_media_urls_are_400s(llava, media_server, what, url, match):
    client, _, _ = llava
    if url.startswith("localhost:"):
        url = media_server.url(url.split(":", 1)[1], host="localhost")
    elif url == "redirect":
        url = media_server.url(f"/redirect?to={media_server.url('/ok.png', host='localhost')}")
    else:
        url = media_server.url(url)
    assert match in bad_request(client, url)["message"], what


def test_too_many_pixels_is_a_400(llava):
    client, _, _ = llava
    assert "pixels" in bad_request(client, data_url(png_bytes((100, 100))))["message"]


def test_too_many_images_is_a_400(llava, media_server):
    client, _, _ = llava
    url = media_server.url("/ok.png")
    assert "At most 2 image(s)" in bad_request(client, url, url, url)["message"]


def test_file_urls_only_under_the_allowed_path(llava, tmp_path):
    client, _, allowed = llava
    assert ask(client, f"file://{allowed}/cat.png").choices[0].message.content
    (tmp_path / "secret.png").write_bytes(png_bytes())
    assert "outside --allowed-local-media-path" in bad_request(
        client, f"file://{tmp_path}/secret.png")["message"]


def test_other_modalities_are_refused_by_name(llava):
    client, _, _ = llava
    with pytest.raises(openai.BadRequestError, match="'input_audio' is not supported yet"):
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])


def test_the_gateway_still_serves_after_the_bad_inputs(llava, media_server):
    client, _, _ = llava
    assert ask(client, media_server.url("/other.png")).choices[0].message.content


def test_an_image_to_a_text_only_model_is_a_400(smollm2_tokenizer, media_server):
    media = MediaPreprocessor(None, "LlamaForCausalLM", "smollm2",
                              MediaLimits(allowed_media_domains=frozenset({"127.0.0.1"})))
    peers = Peers(smollm2_tokenizer, "smollm2", media)
    gateway, client = _client(peers)
    try:
        before = sum(media_server.hits.values())
        message = bad_request(client, media_server.url("/ok.png"))["message"]
        assert "text-only model" in message and "LlamaForCausalLM" in message
        assert sum(media_server.hits.values()) == before  # refused before fetching
        plain = client.chat.completions.create(model="fake-model", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}])
        assert plain.choices[0].message.content
    finally:
        gateway.stop()
        peers.stop()


def test_routing_hashes_key_the_image_blocks_by_the_image(llava):
    """The tokenizer's block hashes (what KV-aware routing and the prefix index compare)
    are the schedulers' function of the expanded ids and the images' identifiers: the
    same text with another image differs from the first block the image touches on."""
    import grpc

    from pagoda.config import DEFAULT_PREFIX_HASH_SEED
    from pagoda.core.block_hash import hash_request_tokens
    from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
    from pagoda.services.common.protocol.tokenizer import chat_input_to_proto
    from pagoda.tokenizer.chat import normalize_messages

    _, peers, _ = llava

    def tokenize(color):
        chat = user_with_image(data_url(png_bytes((40, 30), color)))
        request = tpb.TokenizeRequest(block_size=4, chat=chat)
        with grpc.insecure_channel(peers.tokenizer_addr) as channel:
            return tpb_grpc.TokenizerServiceStub(channel).Tokenize(request, timeout=30)

    def user_with_image(url):
        from pagoda.services.gateway.multimodal.chat_media import split_media
        with_media, media = split_media([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is it?"}]}], None)
        return chat_input_to_proto(normalize_messages(with_media.messages), True, False,
                                   media=media)

    red, green = tokenize((200, 0, 0)), tokenize((0, 200, 0))
    assert list(red.token_ids) == list(green.token_ids)  # same text, same run length
    features = features_from_proto(red.mm_features, len(red.token_ids))
    assert list(red.block_hashes) == hash_request_tokens(
        list(red.token_ids), 4, DEFAULT_PREFIX_HASH_SEED, mm_features=features)
    first_image_block = features[0].offset // 4
    assert red.block_hashes[:first_image_block] == green.block_hashes[:first_image_block]
    assert all(a != b for a, b in zip(red.block_hashes[first_image_block:],
                                      green.block_hashes[first_image_block:]))


@pytest.mark.slow
def test_an_image_to_the_real_text_only_cluster_is_a_400(plain_tiny_cluster, media_server):
    """The shared tiny Llama cluster (all five services): refused by name, nothing
    fetched, and the cluster answers the next request."""
    client = openai.OpenAI(base_url=plain_tiny_cluster.url, api_key="unused", max_retries=0,
                           timeout=60)
    before = sum(media_server.hits.values())
    with pytest.raises(openai.BadRequestError, match="text-only model") as info:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": media_server.url("/ok.png")}},
                {"type": "text", "text": "hi"}]}])
    assert info.value.body["param"] == "messages"
    assert sum(media_server.hits.values()) == before
    reply = client.chat.completions.create(model="tiny", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason in ("length", "stop")

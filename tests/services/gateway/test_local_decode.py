"""The gateway's in-process detokenizer (generation/local_decode.py): the same results as
the tokenizer service's DecodeStream, message for message, and used only when the
service offers a tokenizer this process can load (and PAGODA_GATEWAY_LOCAL_DETOKENIZE
is not 0). Real tokenizer servicers; the service side on loopback gRPC."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.gateway.generation import local_decode
from pagoda.services.gateway.generation.decode_mux import DecodeMux, DecodeStreamBroken
from pagoda.services.gateway.generation.local_decode import LocalDecodeMux, load_local_mux
from pagoda.services.gateway.routing.peers import TokenizerPeer
from pagoda.services.tokenizer.servicer import TokenizerServicer
from pagoda.tokenizer.fingerprint import tokenizer_fingerprint

STORY = " Once upon a time, in a land of copper and glass, there lived a very patient dragon."


def inputs(tokenizer) -> list[tpb.DecodeInput]:
    """Two interleaved completions: one stopped by a stop string, one finishing by
    length with logprob token strings asked for; then a released one and an input of a
    completion that no longer exists."""
    prompt = tokenizer.encode("Tell me a story:", add_special_tokens=False)
    story = tokenizer.encode(STORY, add_special_tokens=False)
    stopped = tpb.DecodeOptions(prompt_token_ids=prompt, skip_special_tokens=True,
                                stop=["patient"])
    plain = tpb.DecodeOptions(prompt_token_ids=prompt, skip_special_tokens=True)
    out = []
    for i, token in enumerate(story):
        last = i == len(story) - 1
        for rid, options in (("a", stopped), ("b", plain)):
            item = tpb.DecodeInput(request_id=rid, token_ids=[token],
                                   finished=last and rid == "b")
            if i == 0:
                item.options.CopyFrom(options)
            if rid == "b":
                item.decode_token_ids.append(token)
            out.append(item)
    out.append(tpb.DecodeInput(request_id="c", token_ids=story[:3], options=plain))
    out.append(tpb.DecodeInput(request_id="c", release=True))
    out.append(tpb.DecodeInput(request_id="c", token_ids=story[3:4]))  # released: no result
    return out


def service_results(tokenizer, items) -> list[tpb.DecodeResult | None]:
    """What the service's DecodeStream answers, one input per message (None: no result)."""
    servicer = TokenizerServicer(tokenizer, "smollm2", [2])
    responses = servicer.DecodeStream(iter(tpb.DecodeStreamRequest(inputs=[i]) for i in items),
                                      None)
    return [r.results[0] if r.results else None for r in responses]


def test_results_equal_the_services_message_for_message(smollm2_tokenizer):
    items = inputs(smollm2_tokenizer)
    expected = service_results(smollm2_tokenizer, items)
    mux = LocalDecodeMux(smollm2_tokenizer)

    async def run() -> list[tpb.DecodeResult | None]:
        got = []
        for item in items:
            if item.release:
                mux.release(item.request_id)
                got.append(None)
                continue
            try:
                got.append(await mux.decode(item))
            except DecodeStreamBroken as exc:
                assert not exc.stream_lost  # an unknown completion, not a dead stream
                got.append(None)
        return got

    got = asyncio.run(run())
    assert got == expected
    texts = [r.complete.text if r.HasField("complete") else r.chunk.text
             for r, i in zip(got, items) if r is not None and i.request_id == "a"]
    assert "".join(texts).endswith(" a very ")  # cut before the stop string
    assert any(r.complete.stop_string == "patient" for r in got if r is not None)


def _info(path: str, vocab_size: int, fingerprint: str) -> tpb.GetTokenizerInfoResponse:
    return tpb.GetTokenizerInfoResponse(model="smollm2", vocab_size=vocab_size,
                                        eos_token_ids=[2], tokenizer_path=path,
                                        tokenizer_fingerprint=fingerprint)


def test_loaded_only_when_offered_readable_the_same_and_enabled(
        smollm2_gguf_path, smollm2_tokenizer, monkeypatch, tmp_path):
    size, mark = len(smollm2_tokenizer), tokenizer_fingerprint(smollm2_tokenizer)
    assert isinstance(load_local_mux(_info(smollm2_gguf_path, size, mark)), LocalDecodeMux)
    assert load_local_mux(_info("", size, mark)) is None  # not offered
    assert load_local_mux(_info(str(tmp_path / "elsewhere.gguf"), size, mark)) is None  # not here
    assert load_local_mux(_info(smollm2_gguf_path, size + 1, mark)) is None  # another size
    # The same size, another tokenizer behind the same path (another pod's copy, a model
    # updated in place); and an older service that sends no fingerprint.
    assert load_local_mux(_info(smollm2_gguf_path, size, "0" * 64)) is None
    assert load_local_mux(_info(smollm2_gguf_path, size, "")) is None
    monkeypatch.setenv(local_decode.ENV, "0")
    assert load_local_mux(_info(smollm2_gguf_path, size, mark)) is None


@pytest.mark.parametrize("env, offered, local", [("1", True, True), ("0", True, False),
                                                 ("1", False, False)])
def test_the_gateway_switches_once_the_tokenizer_loads(
        env, offered, local, smollm2_tokenizer, smollm2_gguf_path, grpc_server_factory,
        monkeypatch):
    monkeypatch.setenv(local_decode.ENV, env)
    servicer = TokenizerServicer(smollm2_tokenizer, "smollm2", [2])
    if offered:
        servicer.tokenizer_path = smollm2_gguf_path
    served = grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server, servicer)

    async def run() -> type:
        peer = TokenizerPeer(served.address)
        await peer.refresh()
        assert peer.info.tokenizer_path == (smollm2_gguf_path if offered else "")
        if peer._local_load is not None:
            await asyncio.wait_for(peer._local_load, 60)
        kind = type(peer.mux)
        await peer.close()
        await peer.channel.close()
        return kind

    assert asyncio.run(run()) is (LocalDecodeMux if local else DecodeMux)


def test_the_tokenizer_service_offers_the_path_it_loaded(smollm2_gguf_path):
    from pagoda.services.tokenizer.server import build_servicer

    servicer = build_servicer(smollm2_gguf_path)
    info = servicer.GetTokenizerInfo(tpb.GetTokenizerInfoRequest(), None)
    assert info.tokenizer_path == smollm2_gguf_path
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(servicer.tokenizer)


def test_the_fingerprint_tells_tokenizers_of_one_size_apart(smollm2_tokenizer):
    """A tokenizer whose decode differs (one token's string swapped for another's, the
    size unchanged) has another fingerprint; another load of the same files the same."""
    import copy
    import json

    from tokenizers import Tokenizer

    mark = tokenizer_fingerprint(smollm2_tokenizer)
    assert tokenizer_fingerprint(copy.deepcopy(smollm2_tokenizer)) == mark
    backend = json.loads(smollm2_tokenizer.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    other = copy.deepcopy(smollm2_tokenizer)
    other._tokenizer = Tokenizer.from_str(json.dumps(backend))
    assert len(other) == len(smollm2_tokenizer)
    assert other.decode([vocab[a]]) != smollm2_tokenizer.decode([vocab[a]])
    assert tokenizer_fingerprint(other) != mark

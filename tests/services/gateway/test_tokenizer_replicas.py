"""The gateway's tokenizer channel over several replicas: round-robin, an idempotent call
retried on another replica when one dies, and a completion's streaming decode resumed
on another replica with the same text. Real tokenizer servicers on loopback."""

from __future__ import annotations

import asyncio
import collections

import pytest

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.gateway.generation.decode_resume import ResumableDecode
from pagoda.services.gateway.routing.peers import TokenizerPeer
from pagoda.services.gateway.routing.tokenizer_channel import tokenizer_target
from pagoda.services.tokenizer.servicer import TokenizerServicer

TEXT = " Once upon a time, in a land of copper and glass, there lived a very patient dragon."


class CountingTokenizer(TokenizerServicer):
    """A real servicer that counts the calls it answered, by method."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, "smollm2", [2])
        self.calls = collections.Counter()

    def Tokenize(self, request, context):
        self.calls["Tokenize"] += 1
        return super().Tokenize(request, context)

    def DecodeStream(self, request_iterator, context):
        self.calls["DecodeStream"] += 1
        yield from super().DecodeStream(request_iterator, context)


@pytest.fixture
def replicas(smollm2_tokenizer, grpc_server_factory):
    servicers = [CountingTokenizer(smollm2_tokenizer) for _ in range(2)]
    served = [grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server, s)
              for s in servicers]
    return servicers, served


def test_a_list_becomes_one_round_robin_target():
    assert tokenizer_target("127.0.0.1:1") == "127.0.0.1:1"
    assert tokenizer_target("tokenizer:50051") == "tokenizer:50051"
    assert tokenizer_target("dns:///tok:50051") == "dns:///tok:50051"
    assert tokenizer_target("127.0.0.1:1, 127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert tokenizer_target("[::1]:1,[::1]:2") == "ipv6:[::1]:1,[::1]:2"
    with pytest.raises(ValueError, match="dns:///"):
        tokenizer_target("tok-0:1,tok-1:1")


def _tokenize(peer: TokenizerPeer, text: str):
    return peer.stub.Tokenize(tpb.TokenizeRequest(prompt=text), timeout=10)


def test_calls_spread_over_the_replicas_and_survive_one_dying(replicas):
    servicers, served = replicas

    async def run() -> None:
        peer = TokenizerPeer(",".join(s.address for s in served))
        expected = (await _tokenize(peer, TEXT)).token_ids
        for _ in range(20):
            assert (await _tokenize(peer, TEXT)).token_ids == expected
        assert all(s.calls["Tokenize"] >= 5 for s in servicers), [s.calls for s in servicers]
        served[0].server.stop(None)  # dies: its connections drop
        for _ in range(20):  # each answered, by the survivor
            assert (await _tokenize(peer, TEXT)).token_ids == expected
        await peer.channel.close()

    asyncio.run(run())


def test_a_decode_stream_resumes_on_another_replica_with_the_same_text(
        replicas, smollm2_tokenizer):
    servicers, served = replicas
    token_ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = smollm2_tokenizer.encode("Tell me a story:", add_special_tokens=False)

    async def run() -> str:
        peer = TokenizerPeer(",".join(s.address for s in served))
        decoding = ResumableDecode(peer.mux, tpb.DecodeOptions(prompt_token_ids=prompt,
                                                               skip_special_tokens=True))
        text = []
        for i, token in enumerate(token_ids):
            last = i == len(token_ids) - 1
            item = tpb.DecodeInput(request_id="r1", token_ids=[token], finished=last)
            if i == 0:
                item.options.CopyFrom(decoding.options)
            if i == len(token_ids) // 2:  # the replica decoding it dies mid-answer
                holder = next(k for k, s in enumerate(servicers) if s.calls["DecodeStream"])
                served[holder].server.stop(None)
                await asyncio.sleep(0.5)  # the stream is seen to end before the next write
            # The list the item was made from, as stream_choice passes it (what the
            # resume replays); a hang fails.
            result = await asyncio.wait_for(decoding.decode(item, [token]), 10)
            part = result.chunk.text if result.HasField("chunk") else result.complete.text
            decoding.shown(part)
            text.append(part)
        await peer.mux.close()
        await peer.channel.close()
        return "".join(text)

    assert asyncio.run(run()) == smollm2_tokenizer.decode(token_ids)
    assert all(s.calls["DecodeStream"] == 1 for s in servicers)  # it moved once

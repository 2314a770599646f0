"""The tokenizer service: encode, chat template, and multiplexed streaming decode."""

from __future__ import annotations

import random

import grpc
import pytest

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.services.common.protocol.tokenizer import chat_input_to_proto
from pagoda.services.tokenizer.decode_stream import CompletionDecoder
from pagoda.services.tokenizer.servicer import TokenizerServicer

TEXT = "The quick brown fox jumps over the lazy dog. Then it stops: END of story, héllo 🦊!"


@pytest.fixture(scope="module")
def stub(smollm2_tokenizer, grpc_server_factory_module):
    servicer = TokenizerServicer(smollm2_tokenizer, "smollm2", [2])
    served = grpc_server_factory_module(pb_grpc.add_TokenizerServiceServicer_to_server, servicer)
    return pb_grpc.TokenizerServiceStub(served.channel)


def stream_decode(decoder: CompletionDecoder, token_ids: list[int], rng: random.Random):
    """Feed tokens in random-sized batches; return (text, stop_string, tokens used)."""
    parts, used, i = [], 0, 0
    while i < len(token_ids):
        batch = token_ids[i:i + rng.randint(1, 4)]
        step = decoder.update(batch)
        parts.append(step.text)
        used += step.num_tokens_used
        i += len(batch)
        if step.complete:
            return "".join(parts), step.stop_string, used
    final = decoder.finish()
    return "".join(parts) + final.text, final.stop_string, used


@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_equals_one_shot_decode(smollm2_tokenizer, seed):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    decoder = CompletionDecoder(smollm2_tokenizer, [1, 2, 3], True, True, [], False)
    text, stop, used = stream_decode(decoder, ids, random.Random(seed))
    assert text == smollm2_tokenizer.decode(ids) and stop is None and used == len(ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_stop_string_cuts_text_and_counts_tokens_to_the_match(smollm2_tokenizer, include, seed):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    decoder = CompletionDecoder(smollm2_tokenizer, [], True, True, ["END", "zzz"], include)
    text, stop, used = stream_decode(decoder, ids, random.Random(seed))
    cut = TEXT.index("END") + (3 if include else 0)
    assert stop == "END" and text == TEXT[:cut]
    # The token that completed "END" is the last one used.
    assert "END" in smollm2_tokenizer.decode(ids[:used])
    assert "END" not in smollm2_tokenizer.decode(ids[:used - 1])


def test_partial_stop_string_is_held_back_until_it_cannot_match(smollm2_tokenizer):
    decoder = CompletionDecoder(smollm2_tokenizer, [], True, True, ["fox!"], False)
    seen = ""
    for token_id in smollm2_tokenizer.encode("The fox jumps", add_special_tokens=False):
        seen += decoder.update([token_id]).text
        assert "fox" not in seen or "fox " in seen  # never a bare "fox" that may be a stop
    assert seen + decoder.finish().text == "The fox jumps"


def test_tokenize_prompt_and_chat(stub, smollm2_tokenizer):
    reply = stub.Tokenize(pb.TokenizeRequest(prompt="Hello world", return_token_strs=True))
    assert list(reply.token_ids) == smollm2_tokenizer.encode("Hello world")
    assert len(reply.token_strs) == len(reply.token_ids)
    chat = chat_input_to_proto([{"role": "user", "content": "Hi"}], True, False)
    reply = stub.Tokenize(pb.TokenizeRequest(chat=chat))
    assert "Hi" in reply.prompt and reply.prompt.rstrip().endswith("assistant")
    assert list(reply.token_ids) == smollm2_tokenizer.encode(reply.prompt, add_special_tokens=False)


def test_bad_chat_and_bad_ids_are_invalid_argument(stub):
    chat = chat_input_to_proto([{"role": "user", "content": "Hi"}], True, True)  # both set
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(chat=chat))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 10**7]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_decode_stream_multiplexes_completions(stub, smollm2_tokenizer):
    texts = {"a": "One two three four.", "b": "Alpha beta STOP gamma delta."}
    ids = {k: smollm2_tokenizer.encode(v, add_special_tokens=False) for k, v in texts.items()}
    opts = {"a": pb.DecodeOptions(skip_special_tokens=True),
            "b": pb.DecodeOptions(skip_special_tokens=True, stop=["STOP"])}

    def requests():
        for i in range(max(map(len, ids.values())) + 1):
            inputs = []
            for k, toks in ids.items():
                if i <= len(toks):
                    item = pb.DecodeInput(request_id=k, token_ids=toks[i:i + 1],
                                          finished=i == len(toks))
                    if i == 0:
                        item.options.CopyFrom(opts[k])
                    inputs.append(item)
            yield pb.DecodeStreamRequest(inputs=inputs)

    out = {"a": "", "b": ""}
    stops = {}
    for response in stub.DecodeStream(requests()):
        for r in response.results:
            kind = r.WhichOneof("result")
            out[r.request_id] += getattr(r, kind).text
            if kind == "complete":
                stops[r.request_id] = r.complete.stop_string
    assert out == {"a": texts["a"], "b": "Alpha beta "}
    assert stops == {"a": "", "b": "STOP"}


def test_tokenizer_info(stub):
    info = stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest())
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2] and info.has_chat_template

"""The tokenizer service: encode, chat template, and multiplexed streaming decode.

The decoding itself is the library's StopAwareDecoder (tests/tokenizer); here: that the
stream carries every option it needs and keeps completions apart."""

from __future__ import annotations

import grpc
import pytest

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.services.common.protocol.tokenizer import chat_input_to_proto
from pagoda.services.tokenizer.servicer import TokenizerServicer

@pytest.fixture(scope="module")
def stub(smollm2_tokenizer, grpc_server_factory_module):
    servicer = TokenizerServicer(smollm2_tokenizer, "smollm2", [2])
    served = grpc_server_factory_module(pb_grpc.add_TokenizerServiceServicer_to_server, servicer)
    return pb_grpc.TokenizerServiceStub(served.channel)


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


def decode_over_stream(stub, ids, opts, last=None):
    """Stream each completion's tokens one per input, all completions in the same
    messages, the last input marked `finished` plus the fields in `last[k]`. Returns
    {id: (text, stop_string, num_tokens_used of the final result)}."""
    last = last or {}

    def requests():
        for i in range(max(map(len, ids.values()))):
            inputs = []
            for k, toks in ids.items():
                if i < len(toks):
                    item = pb.DecodeInput(request_id=k, token_ids=toks[i:i + 1],
                                          finished=i == len(toks) - 1)
                    if i == 0:
                        item.options.CopyFrom(opts[k])
                    if item.finished:
                        for field, value in last.get(k, {}).items():
                            setattr(item, field, value)
                    inputs.append(item)
            yield pb.DecodeStreamRequest(inputs=inputs)

    out = {k: ["", None, None] for k in ids}
    for response in stub.DecodeStream(requests()):
        for r in response.results:
            kind = r.WhichOneof("result")
            out[r.request_id][0] += getattr(r, kind).text
            if kind == "complete":
                out[r.request_id][1:] = [r.complete.stop_string, r.complete.num_tokens_used]
    return {k: tuple(v) for k, v in out.items()}


def test_decode_stream_multiplexes_completions(stub, smollm2_tokenizer):
    texts = {"a": "One two three four.", "b": "Alpha beta STOP gamma delta."}
    ids = {k: smollm2_tokenizer.encode(v, add_special_tokens=False) for k, v in texts.items()}
    opts = {"a": pb.DecodeOptions(skip_special_tokens=True),
            "b": pb.DecodeOptions(skip_special_tokens=True, stop=["STOP"])}
    assert decode_over_stream(stub, ids, opts) == {"a": (texts["a"], "", 1),
                                                    "b": ("Alpha beta ", "STOP", 1)}


def test_decode_stream_honours_min_tokens_and_the_stop_token(stub, smollm2_tokenizer):
    """min_tokens and stop_terminated reach the decoder: a stop string inside the first
    min_tokens tokens is ignored, and the text of the token that ended the completion is
    left out unless include_stop_str_in_output."""
    tok = smollm2_tokenizer
    text = "Alpha STOP beta STOP gamma."
    ids = tok.encode(text, add_special_tokens=False)
    num_first = len(tok.encode("Alpha STOP", add_special_tokens=False))
    opts = {"min": pb.DecodeOptions(skip_special_tokens=True, stop=["STOP"], min_tokens=num_first),
            "eos": pb.DecodeOptions(skip_special_tokens=True),
            "eos_kept": pb.DecodeOptions(skip_special_tokens=True, include_stop_str_in_output=True)}
    out = decode_over_stream(stub, {k: ids for k in opts}, opts,
                             last={"eos": {"stop_terminated": True},
                                   "eos_kept": {"stop_terminated": True}})
    assert out == {"min": ("Alpha STOP beta ", "STOP", 1), "eos": (text[:-1], "", 1),
                   "eos_kept": (text, "", 1)}


def test_tokenizer_info(stub):
    info = stub.GetTokenizerInfo(pb.GetTokenizerInfoRequest())
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2] and info.has_chat_template

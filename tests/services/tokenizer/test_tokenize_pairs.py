"""`Tokenize` for pooling models: a text pair encodes as the tokenizer encodes pairs, with
its token types, and `max_length` truncates as the tokenizer truncates."""

from __future__ import annotations

import pytest
from pooling_cases import build_bert

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.services.tokenizer.servicer import TokenizerServicer
from pagoda.tokenizer.loader import load_tokenizer

LONG = " ".join(["the cat sat on the mat"] * 5)


@pytest.fixture(scope="module")
def bert_tokenizer(tmp_path_factory):
    return load_tokenizer(str(build_bert(tmp_path_factory.mktemp("bert"))))


@pytest.fixture(scope="module")
def stub(bert_tokenizer, grpc_server_factory_module):
    served = grpc_server_factory_module(pb_grpc.add_TokenizerServiceServicer_to_server,
                                        TokenizerServicer(bert_tokenizer, "bert", []))
    return pb_grpc.TokenizerServiceStub(served.channel)


def test_a_text_pair_comes_with_its_token_types(stub, bert_tokenizer):
    reply = stub.Tokenize(pb.TokenizeRequest(prompt="what is the capital of france?",
                                             text_pair="paris", add_special_tokens=True))
    expected = bert_tokenizer("what is the capital of france?", "paris")
    assert list(reply.token_ids) == expected["input_ids"]
    assert list(reply.token_type_ids) == expected["token_type_ids"]
    assert 1 in reply.token_type_ids
    single = stub.Tokenize(pb.TokenizeRequest(prompt="paris", add_special_tokens=True))
    assert list(single.token_type_ids) == []  # only pairs carry types


def test_max_length_truncates_keeping_special_tokens(stub, bert_tokenizer):
    reply = stub.Tokenize(pb.TokenizeRequest(prompt=LONG, add_special_tokens=True, max_length=8))
    assert list(reply.token_ids) == bert_tokenizer(LONG, truncation=True, max_length=8)["input_ids"]
    assert len(reply.token_ids) == 8 and reply.token_ids[-1] == bert_tokenizer.sep_token_id
    pair = stub.Tokenize(pb.TokenizeRequest(prompt="paris", text_pair=LONG,
                                            add_special_tokens=True, max_length=10))
    assert len(pair.token_ids) == 10 and list(pair.token_type_ids).count(0) == 3

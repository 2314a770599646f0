"""vLLM's chat request fields at the tokenizer: `documents` reach the template, and
`add_special_tokens` adds the tokenizer's special tokens on top of the template's."""

from __future__ import annotations

import copy

import pytest
from tokenizers.processors import TemplateProcessing

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services.common.protocol.tokenizer import chat_input_from_proto, chat_input_to_proto
from pagoda.services.tokenizer.servicer import TokenizerServicer

MESSAGES = [{"role": "user", "content": "Which city?"}]
DOCS_TEMPLATE = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                 "{{ messages[0]['content'] }}")


class _Context:
    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def tokenize(servicer, **chat_kwargs) -> pb.TokenizeResponse:
    add_special_tokens = chat_kwargs.pop("add_special_tokens", False)
    chat = chat_input_to_proto(MESSAGES, True, False, **chat_kwargs)
    return servicer.Tokenize(pb.TokenizeRequest(chat=chat, add_special_tokens=add_special_tokens),
                             _Context())


def test_documents_reach_the_template(smollm2_tokenizer):
    docs = [{"title": "Paris", "text": "capital of France"}, {"title": "Rome", "text": "Italy"}]
    chat = chat_input_to_proto(MESSAGES, True, False, documents=docs)
    assert chat_input_from_proto(chat)["documents"] == docs  # the wire keeps them as sent
    servicer = TokenizerServicer(smollm2_tokenizer, "smollm2", [2])
    reply = tokenize(servicer, chat_template_kwargs={"chat_template": DOCS_TEMPLATE},
                     documents=docs)
    assert reply.prompt == "[Paris: capital of France][Rome: Italy]Which city?"
    # chat_template_kwargs' own `documents` wins (vLLM's precedence).
    reply = tokenize(servicer, chat_template_kwargs={"chat_template": DOCS_TEMPLATE,
                                                     "documents": [{"title": "X", "text": "y"}]},
                     documents=docs)
    assert reply.prompt == "[X: y]Which city?"
    with pytest.raises(ValueError, match=r"documents\[0\] must be an object"):
        chat_input_to_proto(MESSAGES, True, False, documents=["not an object"])


def test_chat_add_special_tokens_adds_them_on_top_of_the_template(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)  # a tokenizer that puts a BOS (id 0) first
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    servicer = TokenizerServicer(tok, "smollm2-bos", [2])
    plain = list(tokenize(servicer).token_ids)
    with_bos = list(tokenize(servicer, add_special_tokens=True).token_ids)
    assert plain[0] != 0 and with_bos == [0] + plain

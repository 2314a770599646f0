"""Cohere's /v2/embed through the real services in one process (pooling_harness.py):
the embeddings equal /v1/embeddings' for the same (prefixed, truncated) tokens, every
embedding type decodes back to them, and bad requests are 400s naming the field."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import pytest
from pooling_cases import SENTENCES, add_sentence_transformers, build_bert
from pooling_harness import PoolingReplica
from transformers import AutoTokenizer

PROMPTS = {"search_query": "what is ", "search_document": "the "}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = add_sentence_transformers(build_bert(tmp_path_factory.mktemp("cohere"), seed=5),
                                     "mean", True)
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    return path


@pytest.fixture(scope="module")
def replica(model_dir):
    replica = PoolingReplica(model_dir)
    yield replica
    replica.close()


def post(replica, path, body):
    return httpx.post(f"{replica.url}{path}", json=body, timeout=60)


def openai_embeddings(replica, inputs):
    data = post(replica, "/v1/embeddings", {"input": inputs}).json()["data"]
    return [d["embedding"] for d in data]


def close(rows, want_rows) -> bool:
    return len(rows) == len(want_rows) and all(
        got == pytest.approx(want, abs=1e-6) for got, want in zip(rows, want_rows))


def test_float_embeddings_with_input_type_prefix(replica):
    body = {"model": "tiny", "texts": SENTENCES[:3], "input_type": "search_query"}
    got = post(replica, "/v2/embed", body).json()
    want = openai_embeddings(replica, [PROMPTS["search_query"] + t for t in SENTENCES[:3]])
    unprefixed = openai_embeddings(replica, SENTENCES[:3])
    assert close(got["embeddings"]["float"], want)
    assert not close(got["embeddings"]["float"][:1], unprefixed[:1])
    assert got["texts"] == SENTENCES[:3] and got["id"].startswith("embd-")
    assert got["meta"]["api_version"] == {"version": "2"}
    prompt_tokens = post(replica, "/v1/embeddings", {"input": [PROMPTS["search_query"] + t for t in
                                                               SENTENCES[:3]]}).json()["usage"]
    assert got["meta"]["tokens"]["input_tokens"] == prompt_tokens["prompt_tokens"]


def test_every_embedding_type_encodes_the_floats(replica):
    body = {"texts": ["paris", "a dog swims"],
            "embedding_types": ["float", "binary", "ubinary", "base64"]}
    emb = post(replica, "/v2/embed", body).json()["embeddings"]
    for i, floats in enumerate(emb["float"]):
        bits = [1 if v >= 0 else 0 for v in floats]  # 32 dims -> 4 bytes, high bit first
        ubytes = [int("".join(map(str, bits[k:k + 8])), 2) for k in range(0, len(bits), 8)]
        assert emb["ubinary"][i] == ubytes
        assert emb["binary"][i] == [b - 128 for b in ubytes]
        raw = base64.b64decode(emb["base64"][i])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-7)
    assert set(post(replica, "/v2/embed", {"texts": ["paris"]}).json()["embeddings"]) == {"float"}


def test_truncate_end_start_and_none(replica, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "the cat sat on the mat and a dog swims in the sea"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    for truncate, kept in (("END", ids[:4]), ("START", ids[-4:])):
        got = post(replica, "/v2/embed", {"texts": [text], "truncate": truncate,
                                          "max_tokens": 6}).json()
        assert "meta" in got, got
        assert got["meta"]["tokens"]["input_tokens"] == 6
        want = openai_embeddings(replica, [[cls] + kept + [sep]])
        assert close(got["embeddings"]["float"], want), truncate
    refused = post(replica, "/v2/embed", {"texts": [text], "truncate": "NONE", "max_tokens": 6})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    whole = post(replica, "/v2/embed", {"texts": [text], "truncate": "NONE"}).json()
    assert whole["meta"]["tokens"]["input_tokens"] == len(ids) + 2


@pytest.mark.parametrize("body, param, message", [
    ({}, "texts", "One of texts, images, or inputs must be provided"),
    ({"texts": []}, "texts", "cannot be empty"),
    ({"texts": ["paris"], "input_type": "clustering"}, "input_type",
     "Supported values: search_document, search_query"),
    ({"texts": ["paris"], "embedding_types": ["int8"]}, "embedding_types", "embedding_types"),
    ({"texts": ["paris"], "truncate": "MIDDLE"}, "truncate", "truncate"),
    ({"texts": ["paris"], "max_tokens": 65}, "max_tokens", "greater than max_model_len"),
    ({"images": ["data:image/png;base64,AAAA"]}, "images", "embeds text"),
    ({"texts": ["paris"], "output_dimension": 8}, None, "matryoshka"),
])
def test_bad_requests_are_400s_naming_the_field(replica, body, param, message):
    response = post(replica, "/v2/embed", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error.get("param") == param
    assert post(replica, "/v2/embed", {"texts": ["paris"]}).status_code == 200


def test_input_type_on_a_model_without_prefixes(tmp_path):
    replica = PoolingReplica(add_sentence_transformers(build_bert(tmp_path / "m"), "cls", True))
    try:
        response = post(replica, "/v2/embed", {"texts": ["paris"], "input_type": "search_query"})
        assert response.status_code == 400
        assert "does not define any input_type prompt prefixes" in response.json()["error"]["message"]
    finally:
        replica.close()

"""The pooling endpoints through the real services in one process (pooling_harness.py):
OpenAI's embeddings (the official client, floats and base64), /pooling, /classify,
/score and /rerank against transformers and the offline engine, and the 400s."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
from pooling_cases import (SENTENCES, add_sentence_transformers, build_bert,
                           hf_cross_encoder_logits)
from pooling_harness import PoolingReplica

from pagoda import LLM, PoolingParams

QUERY = "what is the capital of france?"
DOCUMENTS = ["paris", "berlin 42", "the cat sat on the mat", "a dog swims", "fish"]


@pytest.fixture(scope="module")
def st_bert(tmp_path_factory):
    return add_sentence_transformers(build_bert(tmp_path_factory.mktemp("st")), "mean", True)


@pytest.fixture(scope="module")
def embedder(st_bert):
    replica = PoolingReplica(st_bert)
    yield replica
    replica.close()


@pytest.fixture(scope="module")
def offline(st_bert):
    return LLM(str(st_bert), dtype="float32")


@pytest.fixture(scope="module")
def client(embedder):
    return openai.OpenAI(base_url=f"{embedder.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = build_bert(tmp_path_factory.mktemp("ce"), classifier=True, num_labels=1, seed=3)
    replica = PoolingReplica(path)
    yield path, replica
    replica.close()


def post(replica, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{replica.url}{path}", json=body, timeout=60)


def test_openai_client_embeddings_equal_the_offline_engine(client, offline):
    expected = offline.embed(SENTENCES, use_tqdm=False)
    # Without encoding_format the client asks for base64 and decodes it itself.
    for extra in ({"encoding_format": "float"}, {}):
        response = client.embeddings.create(model="tiny", input=SENTENCES, **extra)
        assert [d.index for d in response.data] == list(range(len(SENTENCES)))
        for got, want in zip(response.data, expected):
            assert got.embedding == pytest.approx(want.outputs.embedding, abs=1e-6)
        assert response.usage.prompt_tokens == response.usage.total_tokens \
            == sum(len(e.prompt_token_ids) for e in expected)
        assert response.model == "tiny" and response.object == "list"


def test_base64_is_little_endian_float32(embedder):
    floats = post(embedder, "/v1/embeddings", {"input": "paris"}).json()["data"][0]["embedding"]
    encoded = post(embedder, "/v1/embeddings", {"input": "paris", "encoding_format": "base64"})
    raw = base64.b64decode(encoded.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats
    # vLLM's embed_dtype/endianness spelled as what this is: served, the same bytes
    same = post(embedder, "/v1/embeddings", {"input": "paris", "encoding_format": "base64",
                                             "embed_dtype": "float32", "endianness": "little"})
    assert same.status_code == 200 and same.json()["data"] == encoded.json()["data"]


def test_token_id_inputs_and_truncation(embedder, offline):
    ids = offline.embed("the cat sat on the mat", use_tqdm=False)[0]
    for body_input in (ids.prompt_token_ids, [ids.prompt_token_ids]):
        data = post(embedder, "/v1/embeddings", {"input": body_input}).json()["data"]
        assert data[0]["embedding"] == pytest.approx(ids.outputs.embedding, abs=1e-6)
    long_text = " ".join(["the cat sat on the mat"] * 20)
    cut = post(embedder, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 10})
    expected = offline.embed(long_text, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert cut.json()["usage"]["prompt_tokens"] == 10
    assert cut.json()["data"][0]["embedding"] == pytest.approx(expected.outputs.embedding,
                                                               abs=1e-6)


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "The input cannot be empty."),
    ({"input": [[]]}, "input", "The prompt cannot be empty."),
    ({"input": "paris", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"input": " ".join(["the cat sat on the mat"] * 20)}, None,
     "maximum context length is 64 tokens"),
    ({"input": "paris", "dimensions": 8}, None, "does not support matryoshka"),
    ({"input": "paris", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens",
     "greater than max_model_len (64)"),
    ({"input": [999999]}, "input", "out of vocabulary"),
    # vLLM's fields this server does not serve: named, never ignored
    ({"input": "paris", "embed_dtype": "float16"}, "embed_dtype", "does not support"),
    ({"input": "paris", "endianness": "big"}, "endianness", "does not support"),
    ({"input": "paris", "messages": [{"role": "user", "content": "x"}]}, "messages",
     "does not support"),
    ({"input": "paris", "request_id": "r1"}, "request_id", "does not support"),
    ({"input": "paris", "truncation_side": "left"}, "truncation_side", "does not support"),
])
def test_bad_input_is_a_400_with_openai_error_json(embedder, body, param, message):
    response = post(embedder, "/v1/embeddings", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert error["type"] == "BadRequestError" and error["code"] == 400


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": ["paris"] * 1025}),
    ("/v1/score", {"text_1": "paris", "text_2": [f"city {i}" for i in range(1025)]}),
])
def test_more_inputs_than_the_limit_are_a_400_before_any_work(embedder, path, body):
    """--max-prompts-per-request (1024 by default) bounds a pooling request's inputs too."""
    response = post(embedder, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "--max-prompts-per-request" in error["message"] and error["param"] == "input"


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka"):
        client.embeddings.create(model="tiny", input="paris", dimensions=8)


def test_pooling_endpoint_returns_the_models_vector(embedder, offline):
    response = post(embedder, "/pooling", {"input": ["paris", "fish"]}).json()
    assert [d["object"] for d in response["data"]] == ["pooling", "pooling"]
    assert response["data"][1]["data"] == pytest.approx(
        offline.embed("fish", use_tqdm=False)[0].outputs.embedding, abs=1e-6)


def test_embedding_model_scores_by_cosine(embedder, offline):
    body = post(embedder, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    expected = offline.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [o.outputs.score for o in expected], abs=1e-6)


def test_cross_encoder_score_and_rerank_equal_transformers(cross_encoder):
    path, replica = cross_encoder
    expected = torch.sigmoid(hf_cross_encoder_logits(path, [(QUERY, d) for d in DOCUMENTS]))[:, 0]
    body = post(replica, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert [d["score"] for d in body["data"]] == pytest.approx(expected.tolist(), abs=1e-5)
    order = expected.argsort(descending=True).tolist()
    for route in ("/rerank", "/v1/rerank"):
        rerank = post(replica, route, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
        assert [r["index"] for r in rerank["results"]] == order[:3]
        assert [r["document"]["text"] for r in rerank["results"]] == [DOCUMENTS[i] for i in order[:3]]
        assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx(
            expected[order[:3]].tolist(), abs=1e-5)
        assert rerank["usage"]["total_tokens"] > 0
    pairwise = post(replica, "/score", {"text_1": [QUERY, "fish"], "text_2": ["paris", "fish"]})
    assert pairwise.json()["data"][0]["score"] == pytest.approx(float(expected[0]), abs=1e-5)
    mismatch = post(replica, "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert mismatch.status_code == 400 and "1 -> N or N -> N" in mismatch.json()["error"]["message"]


def test_classify_reports_labels_and_probabilities(tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification

    path = build_bert(tmp_path, classifier=True, num_labels=2, id2label={0: "neg", 1: "pos"})
    replica = PoolingReplica(path)
    try:
        body = post(replica, "/classify", {"input": SENTENCES[:3]}).json()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = BertForSequenceClassification.from_pretrained(path).eval()
        for text, item in zip(SENTENCES, body["data"]):
            with torch.no_grad():
                probs = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits[0], -1)
            assert item["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
            assert item["label"] == ("neg", "pos")[int(probs.argmax())] and item["num_classes"] == 2
        embeddings = post(replica, "/v1/embeddings", {"input": "paris"})
        assert embeddings.status_code == 400
        assert "does not support Embeddings API" in embeddings.json()["error"]["message"]
        completion = post(replica, "/v1/completions", {"prompt": "paris", "max_tokens": 2})
        assert completion.status_code == 400 and "pooling model" in completion.text
    finally:
        replica.close()


def test_a_generative_model_refuses_the_pooling_endpoints(gateway):
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/classify", {"input": "hi"}),
                       ("/rerank", {"query": "q", "documents": ["d"]})):
        response = httpx.post(f"{gateway.url}{path}", json=body, timeout=30)
        assert response.status_code == 400, path
        assert "it generates text" in response.json()["error"]["message"]


def test_pooling_token_classify_serves_a_reward_model_like_llm_reward(tmp_path):
    """vLLM's `POST /pooling` with `"task": "token_classify"` on a classifier: `data` is
    one row of label probabilities per prompt token, equal to the offline `LLM.reward`."""
    path = build_bert(tmp_path, classifier=True, num_labels=3, seed=5)
    offline_rm = LLM(str(path), dtype="float32")
    expected = offline_rm.reward(SENTENCES[:2], use_tqdm=False)
    replica = PoolingReplica(path)
    try:
        response = post(replica, "/pooling", {"input": SENTENCES[:2], "task": "token_classify"})
        assert response.status_code == 200, response.text
        body = response.json()
        for item, want in zip(body["data"], expected):
            assert item["object"] == "pooling"
            assert len(item["data"]) == len(want.prompt_token_ids) and len(item["data"][0]) == 3
            torch.testing.assert_close(torch.tensor(item["data"]), want.outputs.data,
                                       atol=1e-6, rtol=0)
        assert body["usage"]["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in expected)
        raw = post(replica, "/pooling", {"input": SENTENCES[0], "task": "token_classify",
                                          "use_activation": False}).json()["data"][0]["data"]
        logits = offline_rm.reward(
            SENTENCES[0], use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
        torch.testing.assert_close(torch.tensor(raw), logits[0].outputs.data, atol=1e-6, rtol=0)
        # Without a task the classifier's own task runs: one row of probabilities.
        own = post(replica, "/pooling", {"input": SENTENCES[0]}).json()["data"][0]["data"]
        assert len(own) == 3 and not isinstance(own[0], list)
    finally:
        replica.close()


@pytest.mark.parametrize("task, message", [
    ("token_classify", "Task token_classify is not supported by this model"),
    ("classify", "Task classify is not supported by this model"),
    ("reward", "task"),
])
def test_pooling_task_the_model_cannot_run_is_a_400_naming_task(embedder, task, message):
    response = post(embedder, "/pooling", {"input": "paris", "task": task})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "task"


def test_pooling_use_activation_on_an_embedding_model_is_a_400(embedder):
    response = post(embedder, "/pooling", {"input": "paris", "use_activation": False})
    assert response.status_code == 400, response.text
    assert "use_activation" in response.json()["error"]["message"]


def test_pooling_reads_normalize_and_dimensions_as_embeddings_do(embedder):
    """vLLM's /pooling fields for an embedding model: normalize false gives the raw vector
    (not of unit length here), and dimensions on a model without matryoshka is a 400."""
    import math

    unit = post(embedder, "/pooling", {"input": "paris"}).json()["data"][0]["data"]
    raw = post(embedder, "/pooling", {"input": "paris", "normalize": False}).json()
    raw = raw["data"][0]["data"]
    assert math.isclose(math.hypot(*unit), 1.0, rel_tol=1e-5)
    assert not math.isclose(math.hypot(*raw), 1.0, rel_tol=1e-3)
    assert [x / math.hypot(*raw) for x in raw] == pytest.approx(unit, abs=1e-5)
    response = post(embedder, "/pooling", {"input": "paris", "dimensions": 8})
    assert response.status_code == 400, response.text
    assert "matryoshka" in response.json()["error"]["message"]

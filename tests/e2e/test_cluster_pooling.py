"""`pagoda serve MODEL --runner pooling`: the tiny random Llama served as an embedding
model by all five services, through the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from pooling_cases import cosine_distance
from serve_cluster import ServeProcess

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is Paris.", "Embeddings come from the same cluster.", "x"]


@pytest.fixture(scope="module")
def embedding_cluster(tiny_llama_dir, redis_server):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny-embed", "--dtype",
                          "float32", "--max-model-len", "128", "--runner", "pooling",
                          "--redis-url", redis_server.url])
    yield serve
    code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]


def test_openai_embeddings_equal_transformers_last_token(embedding_cluster, tiny_llama_dir):
    from transformers import AutoTokenizer, LlamaModel

    client = openai.OpenAI(base_url=embedding_cluster.url, api_key="unused", max_retries=0,
                           timeout=120)
    response = client.embeddings.create(model="tiny-embed", input=TEXTS)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = LlamaModel.from_pretrained(tiny_llama_dir).eval()
    total = 0
    for text, item in zip(TEXTS, response.data):
        ids = tokenizer(text)["input_ids"]
        total += len(ids)
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        assert cosine_distance(item.embedding, F.normalize(last, dim=0)) < 1e-4
    assert response.usage.prompt_tokens == total
    with pytest.raises(openai.BadRequestError, match="input cannot be empty"):
        client.embeddings.create(model="tiny-embed", input=[])
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model="tiny-embed", prompt="Hello", max_tokens=2)


def test_score_and_rerank_by_embedding_similarity(embedding_cluster):
    base = embedding_cluster.url[:-3]
    score = httpx.post(f"{base}/score", json={"text_1": TEXTS[0], "text_2": TEXTS},
                       timeout=60).json()
    assert score["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)  # a text with itself
    rerank = httpx.post(f"{base}/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS,
                                                   "top_n": 2}, timeout=60).json()
    assert rerank["results"][0]["index"] == 0 and len(rerank["results"]) == 2

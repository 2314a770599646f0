"""`pagoda serve MODEL --runner pooling`: the tiny random Llama served as an embedding
model by all five services, through the official openai client; and a tiny random BERT
sentence-transformers folder (an encoder: no KV cache, so no KV layout, prefix caching,
KV events or P/D), equal to offline `LLM(...).embed` on the same folder."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from pooling_cases import SENTENCES, add_sentence_transformers, build_bert, cosine_distance
from serve_cluster import CLI_MODULE, ServeProcess

from pagoda import LLM

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is Paris.", "Embeddings come from the same cluster.", "x"]
MAX_COSINE_DISTANCE = 1e-4


def serve_pooling(model: str, name: str, redis_url: str, *flags: str):
    """A served pooling model (fp32), stopped cleanly after the module's tests."""
    serve = ServeProcess([model, "--served-model-name", name, "--dtype", "float32",
                          "--runner", "pooling", "--redis-url", redis_url, *flags])
    yield serve
    code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]


@pytest.fixture(scope="module")
def embedding_cluster(tiny_llama_dir, redis_server):
    yield from serve_pooling(tiny_llama_dir, "tiny-embed", redis_server.url,
                             "--max-model-len", "128")


@pytest.fixture(scope="module")
def st_bert(tmp_path_factory) -> str:
    """Mean pooling, then Normalize, as all-MiniLM-L6-v2's folder says."""
    return str(add_sentence_transformers(build_bert(tmp_path_factory.mktemp("st")), "mean",
                                         True))


@pytest.fixture(scope="module")
def encoder_cluster(st_bert, redis_server):
    yield from serve_pooling(st_bert, "tiny-minilm", redis_server.url)


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


@pytest.mark.extended  # make test-extended: a second cluster (the encoder)
def test_served_encoder_embeddings_equal_offline(encoder_cluster, st_bert):
    client = openai.OpenAI(base_url=encoder_cluster.url, api_key="unused", max_retries=0,
                           timeout=120)
    response = client.embeddings.create(model="tiny-minilm", input=SENTENCES)
    offline = LLM(st_bert, dtype="float32", runner="pooling").embed(SENTENCES, use_tqdm=False)
    assert len(response.data) == len(SENTENCES)
    for item, expected in zip(response.data, offline):
        assert len(item.embedding) == 32
        assert cosine_distance(item.embedding, expected.outputs.embedding) < MAX_COSINE_DISTANCE
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)


@pytest.mark.extended  # make test-extended: the refusal comes after the gpu-worker's crash loop
def test_encoder_refuses_disaggregation_flags(st_bert):
    """An encoder keeps no KV to hand over: a P/D role is a clear start-up error."""
    done = subprocess.run(
        [sys.executable, "-m", CLI_MODULE, "serve", st_bert, "--dtype", "float32",
         "--kv-transfer-config", '{"kv_connector": "PagodaConnector", "kv_role": "kv_producer"}'],
        capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "keeps no KV cache" in done.stdout + done.stderr, done.stderr[-3000:]

"""`pagoda serve FOLDER --runner pooling` on a tiny random BERT sentence-transformers
folder (an encoder: no KV cache, so no KV layout, prefix caching, KV events or P/D),
queried through the official openai client, equal to offline `LLM(...).embed`."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from pooling_cases import SENTENCES, add_sentence_transformers, build_bert, cosine_distance
from serve_cluster import CLI_MODULE, ServeProcess

from pagoda import LLM

pytestmark = pytest.mark.slow
MAX_COSINE_DISTANCE = 1e-4


@pytest.fixture(scope="module")
def st_bert(tmp_path_factory) -> str:
    """Mean pooling, then Normalize, as all-MiniLM-L6-v2's folder says."""
    return str(add_sentence_transformers(build_bert(tmp_path_factory.mktemp("st")), "mean",
                                         True))


@pytest.fixture(scope="module")
def encoder_cluster(st_bert, redis_server):
    serve = ServeProcess([st_bert, "--served-model-name", "tiny-minilm", "--dtype", "float32",
                          "--runner", "pooling", "--redis-url", redis_server.url])
    yield serve
    code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]


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


def test_encoder_refuses_disaggregation_flags(st_bert):
    """An encoder keeps no KV to hand over: a P/D role is a clear start-up error."""
    done = subprocess.run(
        [sys.executable, "-m", CLI_MODULE, "serve", st_bert, "--dtype", "float32",
         "--kv-transfer-config", '{"kv_connector": "PagodaConnector", "kv_role": "kv_producer"}'],
        capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "keeps no KV cache" in done.stdout + done.stderr, done.stderr[-3000:]

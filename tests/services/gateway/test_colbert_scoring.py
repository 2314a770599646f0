"""ColBERT late-interaction scoring on a tiny random `HF_ColBERT` checkpoint: LLM.score()
and the gateway's /score and /rerank give the MaxSim computed here by hand from
transformers' BERT hidden states and the checkpoint's projection."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from pooling_cases import build_bert, hf_bert_hidden
from pooling_harness import PoolingReplica
from safetensors.torch import load_file, save_file

from pagoda import LLM

DIM = 8
QUERY = "what is the capital of france?"
DOCUMENTS = ["paris", "the cat sat on the mat", "berlin 42", "a dog swims"]


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory):
    """A BERT checkpoint turned into Stanford's ColBERT layout: `bert.*` tensors, a
    bias-free `linear.weight` [dim, hidden], `architectures: ["HF_ColBERT"]`, `dim`."""
    path = build_bert(tmp_path_factory.mktemp("colbert"), seed=11)
    weights = load_file(path / "model.safetensors")
    weights = {f"bert.{k}": v for k, v in weights.items()}
    weights["linear.weight"] = torch.randn(DIM, 32, generator=torch.Generator().manual_seed(2))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["HF_ColBERT"], dim=DIM)
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference_scores(model_dir, query: str, documents: list[str]) -> list[float]:
    """MaxSim by hand: each token's projected, L2-normalised embedding; for each query
    token the best cosine over the document's tokens; summed over the query tokens."""
    linear = load_file(model_dir / "model.safetensors")["linear.weight"]
    hidden = hf_bert_hidden(model_dir, [query] + documents)
    tokens = [torch.nn.functional.normalize(h @ linear.T, dim=-1).double() for h in hidden]
    scores = []
    for doc in tokens[1:]:
        total = 0.0
        for q in tokens[0]:
            total += max(float(q @ d) for d in doc)
        scores.append(total)
    return scores


def test_llm_score_is_maxsim(colbert_dir):
    want = reference_scores(colbert_dir, QUERY, DOCUMENTS)
    llm = LLM(str(colbert_dir), dtype="float32")
    assert llm.llm_engine.config.pooler_config.task == "token_embed"
    got = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-4)
    # Not a cosine of pooled vectors: the MaxSim sums over the query's tokens.
    assert max(got) > 1.5
    tokens = llm.encode([QUERY], use_tqdm=False)[0]
    data = tokens.outputs.data
    assert tuple(data.shape) == (len(tokens.prompt_token_ids), DIM)
    assert torch.linalg.norm(data, dim=-1).tolist() == pytest.approx([1.0] * len(data), abs=1e-5)


def test_score_and_rerank_routes_are_maxsim(colbert_dir):
    want = reference_scores(colbert_dir, QUERY, DOCUMENTS)
    replica = PoolingReplica(colbert_dir)
    try:
        url = replica.url
        score = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS},
                           timeout=60).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-4)
        rerank = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                      "top_n": 2}, timeout=60).json()
        order = sorted(range(len(want)), key=lambda i: want[i], reverse=True)[:2]
        assert [r["index"] for r in rerank["results"]] == order
        assert [r["relevance_score"] for r in rerank["results"]] == \
            pytest.approx([want[i] for i in order], abs=1e-4)
        pooled = httpx.post(f"{url}/pooling", json={"input": [QUERY, "paris"]},
                            timeout=60).json()["data"]
        assert [len(p["data"][0]) for p in pooled] == [DIM, DIM]
        assert len(pooled[0]["data"]) > len(pooled[1]["data"])  # one row per token
        refused = httpx.post(f"{url}/v1/embeddings", json={"input": "paris"}, timeout=60)
        assert refused.status_code == 400 and "token_embed" in refused.json()["error"]["message"]
    finally:
        replica.close()

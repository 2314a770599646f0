"""`pagoda run-batch` with a pooling model: /v1/embeddings lines, as `vllm run-batch`.

Embeddings equal `LLM(model, runner="pooling").embed`'s; a bad line (or a chat line,
which a pooling model cannot answer) gets an error line in its place.
"""

from __future__ import annotations

import base64
import struct

import pytest

from pagoda import LLM
from test_run_batch import chat, completion, read_lines, request, run_batch, write_lines

TEXTS = ["Hello there, general Kenobi", "The capital of France is Paris"]


def embed(custom_id, **body):
    return request(custom_id, "/v1/embeddings", {"model": "tiny", **body})


@pytest.fixture(scope="module")
def pooling_llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=4, max_model_len=256,
               runner="pooling")


def test_embeddings_lines_equal_llm_embed(tmp_path, tiny_llama_dir, pooling_llm):
    lines_in = [
        embed("one", input=TEXTS[0]),
        embed("many", input=TEXTS),
        embed("ids", input=[1, 2, 3, 4, 5]),
        embed("b64", input=TEXTS[1], encoding_format="base64"),
        embed("empty", input=[]),
        embed("bad-format", input="x", encoding_format="int8"),
        embed("dims", input="x", dimensions=8),  # the tiny model is not matryoshka
        embed("oov", input=[10**6]),
        chat("chat", max_tokens=2),
        completion("cmpl", "a b", max_tokens=2),
        embed("short", input=TEXTS[0], truncate_prompt_tokens=3),
    ]
    out = tmp_path / "out.jsonl"
    assert run_batch(tiny_llama_dir, write_lines(tmp_path / "in.jsonl", lines_in), out,
                     "--runner", "pooling") == 0
    lines = {line["custom_id"]: line for line in read_lines(out)}
    assert list(lines) == [x["custom_id"] for x in lines_in]
    status = {k: v["response"]["status_code"] for k, v in lines.items()}
    assert status == {"one": 200, "many": 200, "ids": 200, "b64": 200, "empty": 400,
                      "bad-format": 400, "dims": 400, "oov": 400, "chat": 400, "cmpl": 400,
                      "short": 200}

    def vectors(custom_id):
        body = lines[custom_id]["response"]["body"]
        assert body["object"] == "list" and body["model"] == "tiny"
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        assert all(d["object"] == "embedding" for d in body["data"])
        return [d["embedding"] for d in body["data"]], body["usage"]

    def check(custom_id, prompts, **kwargs):
        got, usage = vectors(custom_id)
        expected = pooling_llm.embed(prompts, use_tqdm=False, **kwargs)
        assert len(got) == len(expected)
        for vector, output in zip(got, expected):
            assert vector == pytest.approx(output.outputs.embedding, abs=1e-5)
        tokens = sum(len(o.prompt_token_ids) for o in expected)
        assert usage == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}

    check("one", [TEXTS[0]])
    check("many", TEXTS)
    check("ids", [[1, 2, 3, 4, 5]])
    check("short", [TEXTS[0]], truncate_prompt_tokens=3)
    assert vectors("short")[1]["prompt_tokens"] == 3

    encoded = lines["b64"]["response"]["body"]["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    expected = pooling_llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding
    assert decoded == pytest.approx(expected, abs=1e-5)

    errors = {k: v["error"] for k, v in lines.items()}
    assert all(lines[k]["response"]["body"] is None for k in errors if errors[k])
    assert errors["empty"]["param"] == "input"
    assert errors["bad-format"]["param"] == "encoding_format"
    assert "dimensions" in errors["dims"]["message"] or "matryoshka" in errors["dims"]["message"]
    assert "vocab" in errors["oov"]["message"]
    for key in ("chat", "cmpl"):
        assert "pooling model" in errors[key]["message"]


def test_generation_model_refuses_embeddings_lines(tmp_path, tiny_llama_dir):
    out = tmp_path / "out.jsonl"
    lines_in = [embed("emb", input="hi"), completion("cmpl", "a b", max_tokens=2, temperature=0)]
    assert run_batch(tiny_llama_dir, write_lines(tmp_path / "in.jsonl", lines_in), out) == 0
    emb, cmpl = read_lines(out)
    assert emb["response"]["status_code"] == 400 and emb["response"]["body"] is None
    assert "Embeddings API" in emb["error"]["message"]
    assert "--runner pooling" in emb["error"]["message"]
    assert cmpl["response"]["status_code"] == 200

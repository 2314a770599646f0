"""`LLM` with pooling models against transformers: embeddings (an encoder with
sentence-transformers mean pooling, a decoder with last-token pooling), a
cross-encoder's scores, a classifier's probabilities; vLLM's output types; batch and
single agree; what a pooling model refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pooling_cases import (SENTENCES, add_sentence_transformers, build_bert, cosine_distance,
                           hf_bert_hidden, hf_cross_encoder_logits)

from pagoda import (LLM, ClassificationRequestOutput, EmbeddingRequestOutput, PoolingParams,
                    PoolingRequestOutput, SamplingParams, ScoringRequestOutput)

MAX_COSINE_DISTANCE = 1e-4
QUERY = "what is the capital of france?"
DOCUMENTS = ["paris", "berlin 42", "the cat sat on the mat", "a dog swims"]


@pytest.fixture(scope="module")
def st_bert(tmp_path_factory):
    """A BERT sentence-transformers folder: mean pooling, then Normalize."""
    return add_sentence_transformers(build_bert(tmp_path_factory.mktemp("st")), "mean", True)


@pytest.fixture(scope="module")
def st_llm(st_bert):
    return LLM(str(st_bert), dtype="float32")


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = build_bert(tmp_path_factory.mktemp("ce"), classifier=True, num_labels=1, seed=3)
    return path, LLM(str(path), dtype="float32")


def test_encoder_embeddings_equal_transformers_with_the_pooling_config(st_bert, st_llm):
    outputs = st_llm.embed(SENTENCES, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outputs)
    for output, hidden in zip(outputs, hf_bert_hidden(st_bert, SENTENCES)):
        expected = F.normalize(hidden.mean(dim=0), dim=0)
        assert output.outputs.hidden_size == 32
        assert cosine_distance(output.outputs.embedding, expected) < MAX_COSINE_DISTANCE
        assert torch.linalg.norm(torch.tensor(output.outputs.embedding)) == pytest.approx(1, abs=1e-5)


def test_batch_and_single_agree(st_llm):
    batch = st_llm.embed(SENTENCES, use_tqdm=False)
    for text, together in zip(SENTENCES, batch):
        alone = st_llm.embed(text, use_tqdm=False)[0]
        assert alone.prompt_token_ids == together.prompt_token_ids
        assert cosine_distance(alone.outputs.embedding, together.outputs.embedding) < 1e-6


@pytest.mark.parametrize("how", [dict(runner="pooling"), dict(task="embed")])
def test_decoder_as_embedding_model_pools_the_last_token(tiny_llama_dir, how):
    """`task="embed"` is vLLM's older spelling of runner="pooling": the same engine."""
    from transformers import LlamaModel

    llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, **how)
    texts = ["Hello there, general Kenobi", "The capital of France is Paris, " * 3, "x"]
    base = LlamaModel.from_pretrained(tiny_llama_dir).eval()
    first = llm.embed(texts, use_tqdm=False)
    for output in first:
        with torch.no_grad():
            last = base(torch.tensor([output.prompt_token_ids])).last_hidden_state[0, -1]
        assert cosine_distance(output.outputs.embedding, F.normalize(last, dim=0)) \
            < MAX_COSINE_DISTANCE
    # Asked again, the long prompts come from the prefix cache: same embeddings.
    again = llm.embed(texts, use_tqdm=False)
    assert again[1].num_cached_tokens > 0
    for a, b in zip(first, again):
        assert cosine_distance(a.outputs.embedding, b.outputs.embedding) < 1e-6
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_cross_encoder_scores_equal_transformers(cross_encoder):
    path, llm = cross_encoder
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert all(isinstance(o, ScoringRequestOutput) for o in outputs)
    expected = torch.sigmoid(hf_cross_encoder_logits(path, [(QUERY, d) for d in DOCUMENTS]))[:, 0]
    scores = [o.outputs.score for o in outputs]
    assert scores == pytest.approx(expected.tolist(), abs=1e-5)
    assert sorted(range(4), key=scores.__getitem__) == expected.argsort().tolist()
    raw = llm.score(QUERY, DOCUMENTS[:1], use_tqdm=False,
                    pooling_params=PoolingParams(use_activation=False))
    assert torch.sigmoid(torch.tensor(raw[0].outputs.score)) == pytest.approx(scores[0], abs=1e-5)


def test_embedding_model_scores_by_cosine_similarity(st_llm):
    scores = st_llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    embedded = st_llm.embed([QUERY, *DOCUMENTS], use_tqdm=False)
    query = torch.tensor(embedded[0].outputs.embedding)
    for score, doc in zip(scores, embedded[1:]):
        expected = F.cosine_similarity(query, torch.tensor(doc.outputs.embedding), dim=0)
        assert score.outputs.score == pytest.approx(float(expected), abs=1e-6)


def test_classifier_probabilities_equal_transformers(tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification

    path = build_bert(tmp_path, classifier=True, num_labels=3)
    llm = LLM(str(path), dtype="float32")
    outputs = llm.classify(SENTENCES[:3], use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path).eval()
    for text, output in zip(SENTENCES, outputs):
        assert isinstance(output, ClassificationRequestOutput) and output.outputs.num_classes == 3
        with torch.no_grad():
            expected = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits[0], -1)
        assert output.outputs.probs == pytest.approx(expected.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="does not support the 'score'"):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False)  # three labels: not a cross-encoder


def test_encode_returns_the_pooled_tensor(st_llm):
    [output] = st_llm.encode("the cat sat on the mat", use_tqdm=False)
    assert type(output) is PoolingRequestOutput and output.outputs.data.dtype == torch.float32
    embedded = st_llm.embed("the cat sat on the mat", use_tqdm=False)[0]
    assert output.outputs.data.tolist() == embedded.outputs.embedding


def test_truncation_and_limits(st_llm):
    long_text = " ".join(["the cat sat on the mat"] * 20)  # 121 tokens; the context is 64
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        st_llm.embed(long_text, use_tqdm=False)
    [cut] = st_llm.embed(long_text, truncate_prompt_tokens=10, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 10 and cut.prompt_token_ids[-1] == 3  # [SEP] kept
    [ids] = st_llm.embed({"prompt_token_ids": list(range(5, 20))}, truncate_prompt_tokens=4,
                         use_tqdm=False)
    assert ids.prompt_token_ids == [16, 17, 18, 19]
    with pytest.raises(ValueError, match="does not support matryoshka"):
        st_llm.embed("paris", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="does not support the 'classify'"):
        st_llm.classify("paris", use_tqdm=False)
    unnormalised = st_llm.embed("paris", pooling_params=PoolingParams(normalize=False),
                                use_tqdm=False)[0]
    assert torch.linalg.norm(torch.tensor(unnormalised.outputs.embedding)) != pytest.approx(1)


def test_matryoshka_dimensions(tmp_path):
    path = add_sentence_transformers(build_bert(tmp_path, is_matryoshka=True), "cls", True)
    llm = LLM(str(path), dtype="float32")
    full = llm.embed("paris", use_tqdm=False, pooling_params=PoolingParams(normalize=False))[0]
    short = llm.embed("paris", use_tqdm=False, pooling_params=PoolingParams(dimensions=8))[0]
    assert short.outputs.hidden_size == 8
    expected = F.normalize(torch.tensor(full.outputs.embedding[:8]), dim=0)
    assert short.outputs.embedding == pytest.approx(expected.tolist(), abs=1e-6)


def test_pooling_methods_need_a_pooling_model(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32")
    with pytest.raises(ValueError, match=r"LLM.embed\(\) is only supported for pooling models"):
        llm.embed("hello", use_tqdm=False)

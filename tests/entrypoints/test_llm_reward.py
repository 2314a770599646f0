"""`LLM.reward` (vLLM's token_classify task) on a tiny random BERT classifier against
transformers: the classification head's probabilities at every prompt token."""

from __future__ import annotations

import pytest
import torch
from pooling_cases import SENTENCES, build_bert

from pagoda import LLM, PoolingParams, PoolingRequestOutput


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    path = build_bert(tmp_path_factory.mktemp("rm"), classifier=True, num_labels=3, seed=5)
    return path, LLM(str(path), dtype="float32")


def hf_token_logits(model_dir, texts):
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [model.classifier(model.bert(**tokenizer(t, return_tensors="pt"))
                                 .last_hidden_state[0]) for t in texts]


def test_reward_is_the_head_on_every_token(reward_model):
    path, llm = reward_model
    outputs = llm.reward(SENTENCES, use_tqdm=False)
    assert all(isinstance(o, PoolingRequestOutput) and o.finished for o in outputs)
    for output, logits in zip(outputs, hf_token_logits(path, SENTENCES)):
        data = output.outputs.data
        assert data.shape == (len(output.prompt_token_ids), 3) == logits.shape
        torch.testing.assert_close(data, torch.softmax(logits, dim=-1), atol=1e-5, rtol=1e-4)
        # Not the sequence classifier's answer (BERT's pooler is not applied per token).
    sequence = llm.classify(SENTENCES[0], use_tqdm=False)[0].outputs.probs
    assert not torch.allclose(outputs[0].outputs.data[0], torch.tensor(sequence), atol=1e-3)


def test_reward_without_activation_returns_logits(reward_model):
    path, llm = reward_model
    raw = llm.reward(SENTENCES[1], use_tqdm=False,
                     pooling_params=PoolingParams(use_activation=False))[0]
    torch.testing.assert_close(raw.outputs.data, hf_token_logits(path, SENTENCES[1:2])[0],
                               atol=1e-5, rtol=1e-4)


def test_reward_refuses_embedding_fields_and_generative_models(reward_model, tiny_llama_dir):
    _, llm = reward_model
    with pytest.raises(ValueError, match="normalize"):
        llm.reward("the cat", use_tqdm=False, pooling_params=PoolingParams(normalize=True))
    generator = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="pooling models"):
        generator.reward("the cat", use_tqdm=False)

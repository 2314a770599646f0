"""The pooler on hand-made hidden states: which rows each pooling type reads, matryoshka
truncation and normalisation, and the classifier's activation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.config import PoolerConfig
from pagoda.model.pooler import Pooler
from pagoda.pooling_params import PoolingParams

# Two requests in one step: rows 0..2 and 3..4.
HIDDEN = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0],
                       [4.0, 4.0, 0.0], [0.0, 0.0, 5.0]])
SPANS = [(0, 3, True), (3, 5, True)]


def embed(pooling_type: str, **params) -> list[torch.Tensor]:
    pooler = Pooler(PoolerConfig(pooling_type=pooling_type, hidden_size=3), nn.Module())
    verified = []
    for _ in SPANS:
        p = PoolingParams(**params)
        p.verify("embed", PoolerConfig(hidden_size=3, is_matryoshka=True))
        verified.append(p)
    return pooler(HIDDEN, SPANS, verified)


def test_pooling_types_read_their_rows():
    last, cls, mean = (embed(t, normalize=False) for t in ("LAST", "CLS", "MEAN"))
    assert [v.tolist() for v in last] == [[0.0, 0.0, 3.0], [0.0, 0.0, 5.0]]
    assert [v.tolist() for v in cls] == [[1.0, 0.0, 0.0], [4.0, 4.0, 0.0]]
    torch.testing.assert_close(mean[0], torch.tensor([1 / 3, 2 / 3, 1.0]))
    torch.testing.assert_close(mean[1], torch.tensor([2.0, 2.0, 2.5]))


def test_normalised_and_truncated_embeddings():
    unit = embed("CLS")
    torch.testing.assert_close(unit[1], torch.tensor([2 ** -0.5, 2 ** -0.5, 0.0]))
    short = embed("MEAN", dimensions=2)
    assert short[1].shape == (2,)
    torch.testing.assert_close(short[1], torch.tensor([2 ** -0.5, 2 ** -0.5]))


def test_mean_pooling_needs_the_whole_prompt():
    pooler = Pooler(PoolerConfig(pooling_type="MEAN", hidden_size=3), nn.Module())
    with pytest.raises(ValueError, match="whole in one step"):
        pooler(HIDDEN, [(0, 3, False)], [PoolingParams(task="embed", normalize=False)])


class Head(nn.Module):
    """A classifier whose logits are the pooled row itself (3 labels)."""

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled


def classify(params: PoolingParams, labels=("a", "b", "c")) -> list[torch.Tensor]:
    config = PoolerConfig(pooling_type="LAST", task="classify", labels=labels)
    params.verify(params.task or "classify", config)
    return Pooler(config, Head())(HIDDEN, SPANS, [params, params.clone()])


def test_classifier_softmax_or_raw_logits():
    probs = classify(PoolingParams())
    torch.testing.assert_close(probs[0], torch.softmax(torch.tensor([0.0, 0.0, 3.0]), dim=0))
    assert classify(PoolingParams(use_activation=False))[1].tolist() == [0.0, 0.0, 5.0]


def test_a_one_label_head_scores_with_a_sigmoid():
    class OneLabel(nn.Module):
        def classify(self, pooled):
            return pooled[:, 2:]

    config = PoolerConfig(pooling_type="CLS", task="classify", labels=("LABEL_0",))
    params = PoolingParams(task="score")
    params.verify("score", config)
    scores = Pooler(config, OneLabel())(HIDDEN, [(2, 3, True)], [params])
    torch.testing.assert_close(scores[0], torch.sigmoid(torch.tensor([3.0])))


def test_a_classifier_config_needs_a_head():
    with pytest.raises(ValueError, match="no classification head"):
        Pooler(PoolerConfig(task="classify", labels=("a",)), nn.Module())

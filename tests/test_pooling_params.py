"""PoolingParams (vLLM's rules for filling and checking a pooling request) and the
scoring helpers the offline and served paths share."""

from __future__ import annotations

import pytest

from pagoda import PoolingParams
from pagoda.config import PoolerConfig
from pagoda.pooling_params import PoolingParams as FromModule
from pagoda.score_utils import cosine_similarity, score_pairs, token_type_split

EMBED = PoolerConfig(task="embed", hidden_size=8)
MATRYOSHKA = PoolerConfig(task="embed", hidden_size=8, is_matryoshka=True)
MATRYOSHKA_SIZES = PoolerConfig(task="embed", hidden_size=8, is_matryoshka=True,
                                matryoshka_dimensions=(2, 4))
CROSS_ENCODER = PoolerConfig(pooling_type="CLS", task="classify", labels=("LABEL_0",))
CLASSIFIER = PoolerConfig(pooling_type="CLS", task="classify", labels=("neg", "pos"))


def test_importable_from_vllm_paths():
    assert PoolingParams is FromModule


def test_verify_fills_the_models_defaults():
    params = PoolingParams()
    params.verify("embed", EMBED)
    assert (params.task, params.normalize, params.dimensions) == ("embed", True, None)
    unnormalized = PoolingParams()
    unnormalized.verify("embed", PoolerConfig(task="embed", normalize=False))
    assert unnormalized.normalize is False
    scored = PoolingParams()
    scored.verify("score", CROSS_ENCODER)
    assert scored.use_activation is True


def test_a_request_keeps_its_own_choice():
    params = PoolingParams(normalize=False)
    params.verify("embed", EMBED)
    assert params.normalize is False


@pytest.mark.parametrize("params, task, config, message", [
    (PoolingParams(task="embed"), "classify", CLASSIFIER, "cannot overwrite"),
    (PoolingParams(), "classify", EMBED, "does not support the 'classify'"),
    (PoolingParams(), "score", CLASSIFIER, "does not support the 'score'"),
    (PoolingParams(use_activation=True), "embed", EMBED, "does not support ['use_activation']"),
    (PoolingParams(dimensions=4), "classify", CLASSIFIER, "does not support ['dimensions']"),
    (PoolingParams(dimensions=4), "embed", EMBED, "does not support matryoshka"),
    (PoolingParams(dimensions=3), "embed", MATRYOSHKA_SIZES, "only supports [2, 4]"),
    (PoolingParams(dimensions=9), "embed", MATRYOSHKA, "at most the model's embedding size 8"),
])
def test_verify_refuses_what_the_model_cannot_do(params, task, config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        params.verify(task, config, "m")


def test_matryoshka_dimensions_are_accepted():
    for config, size in ((MATRYOSHKA, 3), (MATRYOSHKA_SIZES, 4)):
        params = PoolingParams(dimensions=size)
        params.verify("embed", config)
        assert params.dimensions == size


@pytest.mark.parametrize("kwargs, field", [({"dimensions": 0}, "dimensions"),
                                           ({"truncate_prompt_tokens": -2}, "truncate"),
                                           ({"truncate_prompt_tokens": 0}, "truncate"),
                                           ({"task": "generate"}, "task")])
def test_construction_checks_ranges(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PoolingParams(**kwargs)


def test_score_pairs_follow_vllms_pairing():
    assert score_pairs("q", ["a", "b"]) == (["q", "q"], ["a", "b"])
    assert score_pairs(["x", "y"], ["a", "b"]) == (["x", "y"], ["a", "b"])
    with pytest.raises(ValueError, match="1 -> N or N -> N"):
        score_pairs(["x", "y"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="at least one"):
        score_pairs([], ["a"])


def test_token_type_split_is_the_first_type_one():
    assert token_type_split([0, 0, 0, 1, 1]) == 3
    assert token_type_split([0, 0]) is None
    assert token_type_split(None) is None
    with pytest.raises(ValueError, match="zeros followed by"):
        token_type_split([0, 1, 0])


def test_cosine_similarity():
    assert cosine_similarity([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert cosine_similarity([1.0, 0.0], [0.0, 3.0]) == pytest.approx(0.0)
    assert cosine_similarity([1.0, 1.0], [-1.0, -1.0]) == pytest.approx(-1.0)
    assert cosine_similarity([0.0, 0.0], [1.0, 1.0]) == 0.0

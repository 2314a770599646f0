"""Which runner a model gets and how its pooler is configured: the architecture's
default, sentence-transformers' modules, --pooler-config; and what is refused."""

from __future__ import annotations

import json

import pytest
from pooling_cases import add_sentence_transformers, build_bert

from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.loader import load_arch_config
from pagoda.model.pooler_config import read_sentence_transformers_config, resolve_pooling


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert"))


def resolve(path, **kwargs):
    return resolve_pooling(str(path), load_arch_config(str(path)), **kwargs)


def test_an_encoder_pools_by_default_with_cls(bert_dir):
    setup = resolve(bert_dir)
    assert setup.runner == "pooling" and setup.is_encoder
    pooler = setup.pooler_config
    assert (pooler.pooling_type, pooler.normalize, pooler.task) == ("CLS", True, "embed")
    assert pooler.supported_tasks == ("embed",) and not setup.allows_prefix_caching


def test_a_decoder_generates_unless_asked_to_pool(tiny_llama_dir):
    assert resolve(tiny_llama_dir).runner == "generate"
    setup = resolve(tiny_llama_dir, runner="pooling")
    assert (setup.pooler_config.pooling_type, setup.is_encoder) == ("LAST", False)
    assert setup.allows_prefix_caching  # the last token is always computed
    assert resolve(tiny_llama_dir, convert="embed").runner == "pooling"
    mean = resolve(tiny_llama_dir, runner="pooling", overrides='{"pooling_type": "mean"}')
    assert mean.pooler_config.pooling_type == "MEAN" and not mean.allows_prefix_caching


def test_sentence_transformers_config_picks_pooling_and_normalisation(tmp_path):
    model = build_bert(tmp_path / "st")
    add_sentence_transformers(model, "mean", normalize=False, max_seq_length=32)
    setup = resolve(model)
    assert (setup.pooler_config.pooling_type, setup.pooler_config.normalize) == ("MEAN", False)
    assert setup.max_seq_length == 32
    override = resolve(model, overrides={"normalize": True, "pooling_type": "CLS"})
    assert (override.pooler_config.pooling_type, override.pooler_config.normalize) == ("CLS", True)
    config = EngineArgs(model=str(model), dtype="float32", device="cpu").create_engine_config()
    # The input limit is sentence-transformers'; a pooling prompt runs whole in one step.
    assert config.scheduler.max_model_len == 32 and not config.scheduler.enable_chunked_prefill
    assert config.runner == "pooling" and not config.cache.enable_prefix_caching


def test_newer_pooling_mode_key(tmp_path):
    add_sentence_transformers(build_bert(tmp_path), "cls", normalize=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": 32, "pooling_mode": "lasttoken"}))
    assert read_sentence_transformers_config(str(tmp_path)).pooling_type == "LAST"


@pytest.mark.parametrize("edit, message", [
    (lambda d: _add_module(d, "sentence_transformers.models.Dense"), "Dense"),
    (lambda d: (d / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_max_tokens": True})), "pooling_mode_max_tokens"),
])
def test_modules_pagoda_cannot_reproduce_are_refused(tmp_path, edit, message):
    model = add_sentence_transformers(build_bert(tmp_path), "mean", normalize=True)
    edit(model)
    with pytest.raises(ValueError, match=message):
        resolve(model)


def _add_module(model_dir, kind: str) -> None:
    modules = json.loads((model_dir / "modules.json").read_text())
    modules.append({"idx": len(modules), "name": "x", "path": "2_Dense", "type": kind})
    (model_dir / "modules.json").write_text(json.dumps(modules))


def test_a_classifier_knows_its_labels_and_matryoshka_is_read(tmp_path):
    classifier = build_bert(tmp_path / "cls", classifier=True, num_labels=2,
                            id2label={0: "negative", 1: "positive"})
    pooler = resolve(classifier).pooler_config
    assert pooler.task == "classify" and pooler.labels == ("negative", "positive")
    assert pooler.supported_tasks == ("classify", "token_classify")
    matryoshka = build_bert(tmp_path / "m", matryoshka_dimensions=[8, 16])
    pooler = resolve(matryoshka).pooler_config
    assert pooler.is_matryoshka and pooler.matryoshka_dimensions == (8, 16)


@pytest.mark.parametrize("kwargs, message", [
    (dict(runner="generate"), "is a pooling model"),
    (dict(overrides='{"pooling_type": "MAX"}'), "Unsupported pooling_type 'MAX'"),
    (dict(overrides='{"pool": 1}'), "unknown key"),
    (dict(overrides="{not json"), "not valid JSON"),
])
def test_bad_runner_choices_are_refused(bert_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve(bert_dir, **kwargs)

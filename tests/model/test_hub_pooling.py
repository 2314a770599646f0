"""A sentence-transformers model by Hugging Face id: its pooling setup (modules.json and
the module folders' configs) is downloaded with the weights, so it pools as the local
folder does."""

from __future__ import annotations

import pytest
from hub_stand_in import HubStandIn, Repo
from pooling_cases import add_sentence_transformers, build_bert

from pagoda.entrypoints.llm import LLM
from pagoda.model.hub import download

REPO_ID = "pagoda-test/st-bert"


@pytest.fixture(scope="module")
def st_bert(tmp_path_factory):
    return add_sentence_transformers(build_bert(tmp_path_factory.mktemp("st")), "mean", True,
                                     max_seq_length=48)


@pytest.fixture
def hub(st_bert, tmp_path, monkeypatch):
    files = Repo.from_dir(str(st_bert)).files
    with HubStandIn({REPO_ID: Repo({**files, "README.md": b"# st\n",
                                    "2_Dense/model.safetensors": b"unused"})}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        yield server


def test_the_pooling_setup_comes_with_the_model(hub, st_bert):
    download(REPO_ID)
    fetched = hub.fetched_files(REPO_ID)
    assert {"modules.json", "1_Pooling/config.json", "sentence_bert_config.json"} <= fetched
    assert "2_Dense/model.safetensors" not in fetched and "README.md" not in fetched
    by_id = LLM(REPO_ID, dtype="float32")
    config = by_id.llm_engine.config
    assert (config.pooler_config.pooling_type, config.scheduler.max_model_len) == ("MEAN", 48)
    local = LLM(str(st_bert), dtype="float32")
    assert by_id.embed("the cat sat", use_tqdm=False)[0].outputs.embedding == \
        local.embed("the cat sat", use_tqdm=False)[0].outputs.embedding

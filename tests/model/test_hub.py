"""Hugging Face model ids: downloads from a stand-in hub (tests/hub_stand_in.py) on loopback.

Each test gets an empty HF cache and HF_ENDPOINT pointing at the stand-in, which serves
the tiny random Llama as `pagoda-test/tiny` (safetensors, with a .bin beside them),
`pagoda-test/tiny-bin` (PyTorch pickles only) and a gated copy.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hub_stand_in import HubStandIn, Repo
from safetensors.torch import load_file

from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.hub import GatedModelError, ModelNotFoundError, download, is_hub_id
from pagoda.model.loader import resolve_model_path
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.loader import load_tokenizer, resolve_tokenizer_path

TINY, TINY_BIN, GATED = "pagoda-test/tiny", "pagoda-test/tiny-bin", "pagoda-test/gated"
ALLOWED_TOKEN = "hf_allowed_token"
PROMPTS = ["The capital of France is", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def hub(tiny_llama_dir, tmp_path_factory):
    base = Repo.from_dir(tiny_llama_dir).files
    state = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    pickles = tmp_path_factory.mktemp("pickles")
    torch.save(state, pickles / "pytorch_model.bin")
    torch.save({"lr": 1e-3}, pickles / "training_args.bin")
    bin_bytes = (pickles / "pytorch_model.bin").read_bytes()
    no_safetensors = {n: d for n, d in base.items() if not n.endswith(".safetensors")}
    repos = {
        TINY: Repo({**base, "pytorch_model.bin": bin_bytes, "README.md": b"# tiny\n",
                    "original/params.json": b"{}"}),
        TINY_BIN: Repo({**no_safetensors, "pytorch_model.bin": bin_bytes,
                        "training_args.bin": (pickles / "training_args.bin").read_bytes()}),
        GATED: Repo(dict(base), gated=True, allowed_tokens={ALLOWED_TOKEN}),
    }
    with HubStandIn(repos) as server:
        yield server


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch):
    """An empty cache, the stand-in as the hub, no token, online."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    hub.requests.clear()
    return hub


@pytest.fixture(scope="module")
def local_outputs(tiny_llama_dir):
    return _greedy(tiny_llama_dir)


def _greedy(model: str) -> list[list[int]]:
    from pagoda.entrypoints.llm import LLM

    llm = LLM(model=model, dtype="float32", max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_hub_ids_are_told_from_local_paths(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("org/name.v1_2-x")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")  # an existing local folder wins
    assert not any(is_hub_id(p) for p in ("/abs/path", "./rel/x", "~/m", "a/b/c", "one",
                                           "org/../x", "a--b/c"))


@pytest.mark.parametrize("repo_id", [TINY, TINY_BIN])
def test_download_generates_like_the_local_folder(hub_env, local_outputs, repo_id):
    assert _greedy(repo_id) == local_outputs


def test_only_the_files_serving_reads_are_fetched(hub_env, tiny_llama_dir):
    path = download(TINY)
    tokenizer_and_config = {n for n in os.listdir(tiny_llama_dir) if not n.endswith(".safetensors")}
    assert hub_env.fetched_files(TINY) == tokenizer_and_config | {"model.safetensors"}
    assert "pytorch_model.bin" not in os.listdir(path)  # safetensors exist: no pickles
    # The pickles are a fallback only, and training leftovers never count as weights.
    download(TINY_BIN)
    assert hub_env.fetched_files(TINY_BIN) == tokenizer_and_config | {"pytorch_model.bin"}


def test_a_tokenizer_download_fetches_no_weights(hub_env, tiny_llama_dir):
    path = resolve_tokenizer_path(TINY)
    assert not any(n.endswith((".safetensors", ".bin")) for n in hub_env.fetched_files(TINY))
    text = "Hello, tokenizer of the hub!"
    assert load_tokenizer(path).encode(text) == load_tokenizer(tiny_llama_dir).encode(text)
    # What the tokenizer service does with a hub model: config and tokenizer, no weights.
    assert os.path.isfile(os.path.join(resolve_model_path(TINY, weights=False), "config.json"))
    assert not any(n.endswith(".safetensors") for n in hub_env.fetched_files(TINY))


def test_offline_reads_the_cache_and_fails_clearly_without_it(hub_env, monkeypatch):
    online = resolve_model_path(TINY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_env.requests.clear()
    assert resolve_model_path(TINY) == online
    assert resolve_tokenizer_path(TINY) == online
    assert hub_env.requests == []  # nothing left the process
    with pytest.raises(ModelNotFoundError, match=f"HF_HUB_OFFLINE.*'{TINY_BIN}'"):
        resolve_model_path(TINY_BIN)
    assert hub_env.requests == []


def test_an_unknown_id_or_revision_is_named(hub_env):
    with pytest.raises(ModelNotFoundError, match="'pagoda-test/missing'.*no model repository"):
        resolve_model_path("pagoda-test/missing")
    with pytest.raises(ValueError, match=f"'{TINY}' has no revision 'v9'"):
        resolve_model_path(TINY, revision="v9")
    commit = hub_env.repos[TINY].commit
    assert resolve_model_path(TINY, revision=commit).endswith(commit)


def test_a_gated_model_needs_a_token_with_access(hub_env, monkeypatch):
    with pytest.raises(GatedModelError, match=f"'{GATED}' is gated.*set HF_TOKEN"):
        resolve_model_path(GATED)
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(GatedModelError, match=f"'{GATED}'.*HF_TOKEN has no access"):
        resolve_model_path(GATED)
    monkeypatch.setenv("HF_TOKEN", ALLOWED_TOKEN)
    hub_env.requests.clear()
    assert os.path.isfile(os.path.join(resolve_model_path(GATED), "model.safetensors"))
    # The token goes to the hub as a bearer token, never to the CDN it redirects to.
    hub_requests = [r for r in hub_env.requests if r.server == "hub" and GATED in r.path]
    cdn_requests = [r for r in hub_env.requests if r.server == "cdn"]
    assert hub_requests and cdn_requests
    assert {r.authorization for r in hub_requests} == {f"Bearer {ALLOWED_TOKEN}"}
    assert {r.authorization for r in cdn_requests} == {None}


def test_download_dir_and_engine_args(hub_env, tmp_path, tiny_llama_dir):
    cache = tmp_path / "elsewhere"
    config = EngineArgs(model=TINY, tokenizer=TINY, download_dir=str(cache),
                        dtype="float32").create_engine_config()
    assert config.model.startswith(str(cache)) and config.tokenizer.startswith(str(cache))
    assert config.served_model_name == [TINY]
    assert not os.path.exists(os.path.join(os.environ["HF_HOME"], "hub", "models--pagoda-test--tiny"))
    shutil.rmtree(cache)


def test_pagoda_download_command(hub_env, capsys):
    from pagoda.services.cli.main import main

    assert main(["download", TINY, "--tokenizer-only"]) == 0
    path = capsys.readouterr().out.strip()
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    assert not any(n.endswith(".safetensors") for n in hub_env.fetched_files(TINY))
    assert main(["download", "pagoda-test/missing"]) == 1
    assert "'pagoda-test/missing'" in capsys.readouterr().err

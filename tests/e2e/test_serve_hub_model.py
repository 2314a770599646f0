"""`pagoda serve ORG/NAME`: the model comes from a (stand-in) Hugging Face hub, downloaded once
before the services start, and is served like the local folder it was made from."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import openai
import psutil
import pytest
from hub_stand_in import HubStandIn, Repo
from serve_cluster import ServeProcess

from pagoda.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
REPO = "pagoda-test/tiny-llama"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hub(tiny_llama_dir):
    files = Repo.from_dir(tiny_llama_dir).files
    files["pytorch_model.bin"] = b"the same weights as a pickle; never fetched"
    with HubStandIn({REPO: Repo(files)}) as server:
        yield server


def test_serve_a_hub_id_end_to_end(hub, tiny_llama_dir, redis_server, tmp_path):
    from pagoda.entrypoints.llm import LLM

    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "",
           "HF_TOKEN": ""}
    serve = ServeProcess([REPO, "--dtype", "float32", "--max-model-len", "256",
                          "--redis-url", redis_server.url], env=env)
    try:
        client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [REPO]
        served = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=12,
                                           temperature=0.0, extra_body={"ignore_eos": True})
        # The services read the cache the supervisor filled; none of them downloads.
        for name in ("tokenizer", "scheduler", "gpu-worker"):
            environ = psutil.Process(serve.service_pid(name)).environ()
            assert environ.get("HF_HUB_OFFLINE") == "1", name
    finally:
        code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]

    local = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)
    assert served.choices[0].text == local[0].outputs[0].text
    # One download for the tokenizer, scheduler and gpu-worker: each file fetched once.
    gets = collections.Counter(r.path for r in hub.requests
                               if r.method == "GET" and "/api/" not in r.path)
    assert gets and set(gets.values()) == {1}
    assert "model.safetensors" in hub.fetched_files(REPO)
    assert "pytorch_model.bin" not in hub.fetched_files(REPO)


def test_serve_names_a_missing_id_before_starting_anything(hub, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pagoda.services.cli.main", "serve", "pagoda-test/no-such-model",
         "--port", "0"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
             "HF_HUB_OFFLINE": ""})
    assert out.returncode == 1
    assert "'pagoda-test/no-such-model'" in out.stderr and "no model repository" in out.stderr
    assert "Redis" not in out.stderr  # failed before any service (or Redis) started


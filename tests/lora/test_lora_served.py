"""Served multi-LoRA: `pagoda serve --enable-lora --lora-modules ...` on two replicas,
through the official `openai` client and plain HTTP, as a vLLM user would call it."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
from lora_fixtures import make_adapter
from peft import PeftModel
from safetensors.torch import load_file, save_file
from serve_cluster import ServeProcess, wait_until
from transformers import LlamaForCausalLM

pytestmark = pytest.mark.slow
KEY = "lora-test-key"
PROMPT_IDS = [1, 504, 3458, 282, 4649, 314]  # a prompt as token ids: no tokenizer in the way


@pytest.fixture(scope="module")
def served(tiny_llama_dir, adapters, redis_server):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "256", "--block-size", "16",
                          "--data-parallel-size", "2", "--redis-url", redis_server.url,
                          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--max-cpu-loras", "2", "--lora-modules", f"a1={adapters[0]}",
                          f'{{"name": "a2", "path": "{adapters[1]}", "base_model_name": "tiny"}}',
                          "--api-key", KEY],
                         env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=120)


def greedy_ids(client, model: str, prompt=PROMPT_IDS, max_tokens: int = 8) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0.0, logprobs=0,
                                    extra_body={"ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def hf_greedy(base_dir: str, adapter_dir: str | None, prompt_ids: list[int]) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.eval().generate(ids, max_new_tokens=8, do_sample=False,
                                    attention_mask=torch.ones_like(ids))
    return out[0, len(prompt_ids):].tolist()


def post(served, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{served.base}{path}", json=body, headers=headers, timeout=60)


def test_adapters_are_listed_with_their_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "a1", "a2"}
    assert cards["tiny"].parent is None
    for name, path in (("a1", adapters[0]), ("a2", adapters[1])):
        assert (cards[name].parent, cards[name].root) == ("tiny", path)
    assert client.models.retrieve("a2").parent == "tiny"


def test_adapter_output_equals_hf_peft(client, tiny_llama_dir, adapters):
    base = greedy_ids(client, "tiny")
    assert base == hf_greedy(tiny_llama_dir, None, PROMPT_IDS)
    for name, path in (("a1", adapters[0]), ("a2", adapters[1])):
        got = greedy_ids(client, name)
        assert got == hf_greedy(tiny_llama_dir, path, PROMPT_IDS), name
        assert got != base  # the adapter is applied, so the comparison means something
    # Chat goes through the same adapter (no error; its own answer).
    reply = client.chat.completions.create(model="a1", max_tokens=4, temperature=0.0,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.model == "a1" and reply.choices[0].finish_reason in ("stop", "length")


def test_unknown_adapter_is_404_like_an_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "The model `nope` does not exist." in str(err.value)


def test_an_adapter_stays_on_the_replica_that_holds_it(served, adapters):
    def instance(model: str, i: int) -> str:
        reply = post(served, "/v1/completions", {"model": model, "max_tokens": 2,
                                                  "prompt": f"request {i} of {model} " * 3})
        assert reply.status_code == 200, reply.text
        return reply.headers["x-pagoda-instance"]

    for model in ("a1", "a2"):
        seen = {instance(model, i) for i in range(6)}
        assert len(seen) == 1, f"{model} was served by {seen}"


def test_runtime_load_and_unload(served, client, tiny_llama_dir, adapters, tmp_path):
    body = {"lora_name": "a3", "lora_path": adapters[2]}
    assert post(served, "/v1/load_lora_adapter", body, key=None).status_code == 401
    reply = post(served, "/v1/load_lora_adapter", body)
    assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'a3' added "
                                                    "successfully.")
    assert "a3" in {m.id for m in client.models.list().data}
    assert greedy_ids(client, "a3") == hf_greedy(tiny_llama_dir, adapters[2], PROMPT_IDS)
    again = post(served, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # Loaded again in place from another directory: the new weights, never the old
    # weights' cached blocks (the cache keys blocks by adapter name and id).
    moved = post(served, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": adapters[0],
                                                  "load_inplace": True})
    assert moved.status_code == 200
    assert greedy_ids(client, "a3") == greedy_ids(client, "a1")
    reply = post(served, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'a3' removed "
                                                    "successfully.")
    with pytest.raises(openai.NotFoundError):
        greedy_ids(client, "a3")
    gone = post(served, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"


def test_bad_adapters_are_refused_and_the_cluster_serves_on(served, client, tiny_llama_dir,
                                                            tmp_path):
    missing = post(served, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path":
                                                     str(tmp_path / "nowhere")})
    assert missing.status_code == 404, missing.text
    big = make_adapter(tiny_llama_dir, str(tmp_path / "big"), seed=5, rank=16)
    too_big = post(served, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": big})
    assert too_big.status_code == 400
    assert "greater than max_lora_rank 8" in too_big.json()["error"]["message"]
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text("{not json")
    broken = post(served, "/v1/load_lora_adapter", {"lora_name": "half", "lora_path": str(half)})
    assert broken.status_code == 400
    assert post(served, "/v1/load_lora_adapter", {"lora_name": "y"}).status_code == 400
    assert {m.id for m in client.models.list().data} == {"tiny", "a1", "a2"}
    assert greedy_ids(client, "a1")  # still serving


def test_an_adapter_that_breaks_its_step_fails_alone(served, client, tiny_llama_dir, adapters,
                                                     tmp_path):
    """Tensors that pass every check before the step but do not fit the model (a
    mid-step failure): that request fails with a 500, the replica recovers, and a
    greedy stream running meanwhile ends with its undisturbed text."""
    bad = tmp_path / "misfit"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(
        (Path(adapters[0]) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapters[0]) / "adapter_model.safetensors"))
    tensors = {k: (torch.cat([v, v[:, :3]], dim=1) if "lora_A" in k else v)
               for k, v in tensors.items()}  # in-features 3 wider than the model's
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    assert post(served, "/v1/load_lora_adapter",
                {"lora_name": "misfit", "lora_path": str(bad)}).status_code == 200
    want = client.completions.create(model="tiny", prompt="a steady stream", max_tokens=48,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny", prompt="a steady stream", max_tokens=48,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="misfit", prompt="break it", max_tokens=4)
    text += "".join(c.choices[0].text for c in chunks)
    assert text == want.choices[0].text
    # It failed inside a step (the worker's checks could not see it), not before one.
    assert wait_until(lambda: any("failed midway" in line and "at fault" in line
                                  for line in served.log), 10), "".join(served.log[-40:])
    assert greedy_ids(client, "a1") == hf_greedy(tiny_llama_dir, adapters[0], PROMPT_IDS)
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "misfit"}).status_code == 200
    assert httpx.get(f"{served.base}/health", timeout=10).status_code == 200


def test_lora_requests_info_names_the_running_adapters(served, client):
    stream = client.completions.create(model="a2", prompt="a long story", max_tokens=200,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))

    def running() -> set[str]:
        return {dict(labels).get("running_lora_adapters") for (name, labels), value
                in served.scrape().items()
                if name == "vllm:lora_requests_info" and value > 0
                and dict(labels).get("max_lora") == "2"}

    try:
        assert wait_until(lambda: "a2" in running(), 30), running()
    finally:
        stream.close()

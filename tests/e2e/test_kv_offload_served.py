"""`pagoda serve --kv-offloading-size` (and `--kv-offloading-disk-path/-size`): the
flags reach the scheduler and the gpu-worker, the plan carries the tiers' copies over
gRPC, revisited prefixes come back from the worker's host memory (or its disk), and
greedy output equals the in-process engine's without a tier."""

from __future__ import annotations

import openai
import pytest

from engine.test_kv_offload import BLOCK, TINY_BLOCK_BYTES, _prompts
from pagoda import LLM, SamplingParams
from pagoda.core.kv_disk_index import RECORD_OVERHEAD
from pagoda.core.kv_offload import GIB
from serve_cluster import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # ~70 s on 2 cores
SHAPE = ["--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "256",
         "--num-gpu-blocks-override", "24", "--max-num-batched-tokens", "64"]


def _tier_flags(tier: str, tmp_path) -> list[str]:
    if tier == "cpu":
        return ["--kv-offloading-size", repr(64 * TINY_BLOCK_BYTES / GIB)]
    return ["--kv-offloading-size", repr(4 * TINY_BLOCK_BYTES / GIB),  # 4 host slots
            "--kv-offloading-disk-path", str(tmp_path / "kv-disk"),
            "--kv-offloading-disk-size", repr(64 * (TINY_BLOCK_BYTES + RECORD_OVERHEAD) / GIB)]


@pytest.fixture(scope="module", params=["cpu", "disk"])
def served(request, tiny_llama_dir, redis_server, tmp_path_factory):
    flags = _tier_flags(request.param, tmp_path_factory.mktemp("tier"))
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", *SHAPE, *flags,
                          "--kv-offloading-backend", "native", "--redis-url", redis_server.url])
    serve.tier = request.param
    yield serve
    serve.stop()


def test_served_revisits_come_from_the_tier(served, tiny_llama_dir):
    first, revisits = _prompts()
    client = openai.OpenAI(base_url=served.url, api_key="x", max_retries=0, timeout=120)
    got = []
    for prompt in first + revisits:  # one at a time: each evicts the earlier prefixes
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                        temperature=0.0, logprobs=0,
                                        extra_body={"ignore_eos": True,
                                                    "return_tokens_as_token_ids": True})
        got.append([int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens])
    llm = LLM(tiny_llama_dir, dtype="float32", block_size=BLOCK, max_model_len=256,
              num_gpu_blocks_override=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in first + revisits], greedy,
                         use_tqdm=False)]
    assert got == want
    metrics = served.scrape()
    tier = ("tier", served.tier)
    hits = sum(v for (name, labels), v in metrics.items()
               if name == "pagoda_kv_offload_hits_total" and tier in labels)
    onloaded = sum(v for (name, labels), v in metrics.items()
                   if name == "pagoda_kv_offload_bytes_total" and tier in labels
                   and ("direction", "onload") in labels)
    # From disk: at most the 4 host slots' blocks came from memory instead.
    assert hits >= 4 * 9 - (4 if served.tier == "disk" else 0)
    assert onloaded == hits * TINY_BLOCK_BYTES
    # The worker's onload latency, per tier, reaches the cluster's /metrics.
    assert sum(v for (name, labels), v in metrics.items()
               if name == "pagoda_kv_offload_onload_seconds_count" and tier in labels) > 0

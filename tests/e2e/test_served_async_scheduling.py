"""`pagoda serve --async-scheduling` (the scheduler plans step N+1 while the worker runs
step N, over gRPC) streams exactly what the offline engine gives one step at a time, on
the tiny Llama, under a small KV pool (preemption): greedy with different max_tokens,
a stop token finishing mid-batch, seeded sampling with n=2; a dropped stream frees its
blocks."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from serve_cluster import ServeProcess, scheduler_load, wait_until

from pagoda import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Once upon a time, in a kingdom far away, there lived a princess who"]
POOL = ["--num-gpu-blocks-override", "24", "--block-size", "4", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def serve(tiny_llama_dir, redis_server):
    cluster = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                            "--redis-url", redis_server.url, "--disable-log-stats",
                            "--tokenizer-replicas", "1", "--async-scheduling", *POOL],
                           timeout=400)
    yield cluster
    cluster.stop()


def cases(reference_tokens):
    out = []
    for i, tokens in enumerate(reference_tokens):
        if i % 3 == 0:
            out.append(dict(temperature=0.0, max_tokens=6 + 4 * i))
        elif i % 3 == 1:
            out.append(dict(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[3]]))
        else:
            out.append(dict(temperature=1.0, seed=5 + i, n=2, max_tokens=14))
    return out


def test_served_async_equals_offline_sync(serve, tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=24, block_size=4,
              max_model_len=256)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    params = cases([o.outputs[0].token_ids for o in greedy])
    expected = llm.generate(PROMPTS, [SamplingParams(**p) for p in params], use_tqdm=False)
    client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=180)

    def served(i):
        p = dict(params[i])
        extra = {k: p.pop(k) for k in ("stop_token_ids",) if k in p}
        result = client.completions.create(model="tiny", prompt=PROMPTS[i], extra_body=extra, **p)
        return sorted(c.text for c in result.choices)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch
        got = list(pool.map(served, range(len(PROMPTS))))
    assert got == [sorted(c.text for c in o.outputs) for o in expected]
    assert any(c.finish_reason == "stop" for o in expected for c in o.outputs)

    dropped = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=60,
                                        stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(dropped):
        if i == 5:
            break
    dropped.close()  # the gateway aborts it while its next step is already planned

    def idle():
        load = scheduler_load(serve.scheduler_address())
        return load.num_running == 0 and load.num_waiting == 0 and load.kv_cache_usage == 0

    assert wait_until(idle, timeout=60)

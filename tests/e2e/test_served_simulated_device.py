"""`pagoda serve --simulated-device`: the whole served path (gateway, tokenizer,
scheduler, kv-cache-manager, worker) on the simulated device, with the official client.

The streamed tokens are the ones the offline engine gets from the same device (they
depend on the prompt only), the worker records one line per step, and a stream the
client drops mid-way leaves the scheduler's KV blocks all free again.
"""

from __future__ import annotations

import openai
import pytest
from serve_cluster import ServeProcess, scheduler_load, wait_until

from pagoda import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    return tmp_path_factory.mktemp("simulated") / "steps.txt"


@pytest.fixture(scope="module")
def serve(tiny_llama_dir, redis_server, record):
    device = f'{{"base_ms": 5, "record_path": "{record}"}}'
    cluster = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len",
                            "512", "--redis-url", redis_server.url, "--disable-log-stats",
                            "--tokenizer-replicas", "1", "--simulated-device", device],
                           timeout=400)
    yield cluster
    cluster.stop()


def test_streams_the_simulated_tokens_and_frees_every_block(serve, tiny_llama_dir, record):
    expected = LLM(model=tiny_llama_dir, simulated_device={"base_ms": 1}).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                       temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == expected.outputs[0].text
    assert "--simulated-device" in serve.service_args("gpu-worker")

    dropped = client.completions.create(model="tiny", prompt=PROMPT * 3, max_tokens=400,
                                        stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(dropped):
        if i == 5:
            break
    assert scheduler_load(serve.scheduler_address()).kv_cache_usage > 0  # it holds blocks
    dropped.close()  # the client goes away mid-stream: the gateway aborts the request

    def idle():
        load = scheduler_load(serve.scheduler_address())
        return load.num_running == 0 and load.num_waiting == 0 and load.kv_cache_usage == 0

    assert wait_until(idle, timeout=60)
    assert wait_until(lambda: record.exists() and len(record.read_text().splitlines()) >= 12,
                      timeout=30)

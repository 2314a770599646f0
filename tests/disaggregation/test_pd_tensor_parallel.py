"""Prefill and decode replicas split differently: blocks travel whole (every layer and
KV head), so a TP=1 prefill replica feeds a TP=2 decode replica and a TP=2 one feeds
a TP=2 one, with greedy outputs equal to a colocated single-rank cluster's."""

from __future__ import annotations

import httpx
import pytest
from pd_cluster import BASE, PREFILL_HEADER, role_process, start_pd
from serve_cluster import ServeProcess, wait_until

pytestmark = pytest.mark.slow
LONG = " ".join(f"word{i}" for i in range(120))  # ~ 250 tokens: many 16-token blocks
PROMPTS = [("Hello there", 10), (LONG, 8), (LONG + " and then", 8)]
MP = ["--distributed-executor-backend", "mp"]


def completions(serve: ServeProcess) -> list[tuple[str, bool]]:
    """(text, prefilled remotely) of each prompt, greedy."""
    out = []
    for prompt, max_tokens in PROMPTS:
        reply = httpx.post(f"{serve.url}/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert reply.status_code == 200, reply.text
        out.append((reply.json()["choices"][0]["text"], PREFILL_HEADER in reply.headers))
    return out


def pulled_blocks(serve: ServeProcess) -> float:
    return sum(v for (n, _), v in serve.scrape().items()
               if n == "pagoda_kv_transfer_blocks_total")


@pytest.fixture(scope="module")
def colocated_texts(tiny_llama_dir, redis_server) -> list[str]:
    serve = ServeProcess([tiny_llama_dir, *BASE, "--redis-url", redis_server.url])
    try:
        return [text for text, _ in completions(serve)]
    finally:
        assert serve.stop() == 0


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 2)])
def test_split_replicas_equal_colocated(tiny_llama_dir, redis_server, colocated_texts,
                                        prefill_tp, decode_tp):
    serve = start_pd(tiny_llama_dir, redis_server.url, *MP,
                     "--prefill-tensor-parallel-size", str(prefill_tp),
                     "--decode-tensor-parallel-size", str(decode_tp))
    try:
        for kind in ("scheduler", "gpu-worker"):  # each pool's TP is on its command lines
            for role, tp in (("kv_producer", prefill_tp), ("kv_consumer", decode_tp)):
                cmd = role_process(serve, kind, role).cmdline()
                last = len(cmd) - 1 - cmd[::-1].index("--tensor-parallel-size")
                assert int(cmd[last + 1]) == tp
        before = pulled_blocks(serve)
        results = completions(serve)
        assert [text for text, _ in results] == colocated_texts
        assert all(remote for _, remote in results)
        # The long prompts' full blocks came from the prefill worker (the second one
        # shares the first's leading blocks, which the decode side then holds).
        assert wait_until(lambda: pulled_blocks(serve) - before >= 15, 10)
    finally:
        assert serve.stop() == 0, serve.stderr_text()[-3000:]

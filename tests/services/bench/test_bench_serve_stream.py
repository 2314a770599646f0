"""`pagoda bench serve` against a fake OpenAI SSE server on loopback.

The fake streams like Pagoda's gateway with `logprobs` on: a first token with no
text (half of a two-byte character), then text. A counter stands in for the clock,
so TTFT and ITL are checked as "which chunk", never as wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import io
import itertools
import json
import threading

import httpx
import pytest

from pagoda.services.bench.datasets import BenchRequest
from pagoda.services.bench.stream import request_body, send_request
from pagoda.services.cli.main import main


def chunk(text: str, tokens: list[str] | None, usage: int | None = None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": None,
              "logprobs": None if tokens is None else {"tokens": tokens,
                                                       "token_logprobs": [-1.0] * len(tokens)}}
    out = {"object": "text_completion", "choices": [choice]}
    if usage is not None:
        out["usage"] = {"prompt_tokens": 7, "completion_tokens": usage, "total_tokens": 7 + usage}
    return out


# What the gateway streams for "é!!" with logprobs: "é" is two byte-level tokens, and
# the first of them has no text of its own.
WITH_LOGPROBS = [chunk("", ["bytes:\\xc3"]), chunk("é", ["bytes:\\xa9"]), chunk("!", ["!"]),
                 chunk("!", ["!"])]
# The same stream without logprobs but with continuous usage stats: the textless token
# still gets its chunk, and the usage says how many tokens each chunk brought.
WITH_USAGE = [chunk("", None, 1), chunk("é", None, 2), chunk("!", None, 3), chunk("!", None, 4)]
FINAL_USAGE = {"object": "text_completion", "choices": [],
               "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}}


class FakeOpenAI(http.server.ThreadingHTTPServer):
    """/v1/models and streamed /v1/completions; keeps every request body it got."""

    daemon_threads = True

    def __init__(self, chunks: list[dict]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.chunks = chunks
        self.bodies: list[dict] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def do_GET(self) -> None:
        self._send(json.dumps({"object": "list", "data": [{"id": "fake", "root": None}]}),
                   "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        events = io.StringIO()
        for c in [*self.server.chunks, FINAL_USAGE]:
            events.write(f"data: {json.dumps(c)}\n\n")
        events.write("data: [DONE]\n\n")
        self._send(events.getvalue(), "text/event-stream")

    def _send(self, text: str, kind: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def fake_server(chunks: list[dict]):
    server = FakeOpenAI(chunks)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def record(chunks: list[dict]):
    """One request through send_request, timed by a clock that ticks once per reading:
    0 at the send, then 1, 2, ... at each chunk, then the end."""
    ticks = itertools.count()
    request = BenchRequest("Hi", [1, 2], 4)
    with fake_server(chunks) as server:
        async def go():
            async with httpx.AsyncClient(timeout=30) as client:
                body = request_body("openai", "fake", request, "text", True, 0.0, 0)
                return await send_request(client, f"{server.url}/v1/completions", body, request,
                                          clock=lambda: float(next(ticks)))
        return asyncio.run(go())


@pytest.mark.parametrize("chunks", [WITH_LOGPROBS, WITH_USAGE], ids=["logprobs", "usage"])
def test_ttft_counts_a_first_token_without_text(chunks):
    result = record(chunks)
    assert result.ok, result.error
    # Tick 1 is the empty-text chunk: TTFT stops there, not at "é" (tick 2).
    assert result.ttft == 1.0
    assert result.itl == [1.0, 1.0, 1.0]  # one gap per later chunk with a token
    assert result.output_tokens == 4 and result.prompt_len == 7  # the final usage
    # Read at 1..4 (token chunks), 5 (usage chunk), then the end at 6.
    assert result.latency == 6.0


def test_text_only_chunks_fall_back_to_one_token_each():
    chunks = [chunk("a", None), chunk("b", None)]
    result = record(chunks)
    assert (result.ttft, result.itl) == (1.0, [1.0])
    assert result.output_tokens == 4  # the final usage corrects the count


def run_cli(capsys, url: str, *flags: str) -> dict:
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "4",
                 "--max-concurrency", "2", "--random-input-len", "16",
                 "--random-output-len", "4", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_sends_text_prompts_and_reports_vllm_keys(capsys, smollm2_gguf_path, smollm2_tokenizer):
    with fake_server(WITH_LOGPROBS) as server:
        result = run_cli(capsys, server.url, "--tokenizer", smollm2_gguf_path, "--seed", "3")
    assert (result["base_url"], result["model_id"], result["seed"]) == (server.url, "fake", 3)
    assert (result["num_prompts"], result["max_concurrency"], result["request_rate"]) == (4, 2, "inf")
    assert (result["completed"], result["failed"]) == (4, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (4 * 7, 4 * 4)
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration",
                *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
                  for m in ("ttft", "tpot", "itl", "e2el"))):
        assert key in result
    measured = server.bodies[1:]  # the first is the warm-up
    assert len(measured) == 4
    for body in measured:
        assert isinstance(body["prompt"], str)
        assert len(smollm2_tokenizer.encode(body["prompt"], add_special_tokens=False)) == 16
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert (body["logprobs"], body["ignore_eos"], body["max_tokens"]) == (0, True, 4)
    assert server.bodies[0]["prompt"] not in [b["prompt"] for b in measured]


def test_token_prompts_and_a_fresh_seed_per_run(capsys, smollm2_gguf_path):
    seeds, prompts = [], []
    for _ in range(2):
        with fake_server(WITH_LOGPROBS) as server:
            seeds.append(run_cli(capsys, server.url, "--tokenizer", smollm2_gguf_path,
                                 "--prompt-format", "tokens")["seed"])
        prompts.append([b["prompt"] for b in server.bodies[1:]])
    assert seeds[0] != seeds[1] and prompts[0] != prompts[1]
    for prompt in prompts[0]:
        assert len(prompt) == 16 and all(isinstance(t, int) for t in prompt)


def test_chat_backend_sends_messages(capsys, smollm2_gguf_path):
    chat_chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None}]},
                   {"choices": [{"index": 0, "delta": {"content": ""},
                                 "logprobs": {"content": [{"token": "x", "logprob": -1.0}]}}]},
                   {"choices": [{"index": 0, "delta": {"content": "é"},
                                 "logprobs": {"content": [{"token": "y", "logprob": -1.0}]}}]}]
    with fake_server(chat_chunks) as server:
        result = run_cli(capsys, server.url, "--tokenizer", smollm2_gguf_path,
                         "--backend", "openai-chat")
    assert result["endpoint"] == "/v1/chat/completions" and result["completed"] == 4
    body = server.bodies[-1]
    assert body["messages"][0]["role"] == "user" and isinstance(body["messages"][0]["content"], str)
    assert (body["logprobs"], body["top_logprobs"]) == (True, 0)

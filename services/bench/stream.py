"""One streamed request of `pagoda bench serve`: its body, and when each token arrived.

A token can arrive without text: a byte of a multi-byte character, a special
token. Counting only chunks with text would start TTFT late and undercount, so
tokens are counted per chunk, most exact source first:

1. `usage.completion_tokens` on a chunk with choices (vLLM's
   `stream_options.continuous_usage_stats`): the tokens so far, whatever the
   chunk shows; the difference from the count so far is this chunk's share.
2. The choice's logprobs (`logprobs.tokens` for completions, `logprobs.content`
   for chat): one entry per token. The body asks for the sampled token's logprob
   (`--logprobs 0`) so that a server which sends nothing for a textless token
   unless logprobs are on (Pagoda's gateway does this) still sends a chunk for it.
3. Otherwise a chunk whose choice has text counts as one token (what a server
   without either leaves us; its final usage still corrects the total).

TTFT is the time to the first chunk that carries a token; ITL the gaps between
chunks that carry tokens (vLLM's definition: per chunk, not per token).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pagoda.services.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    """What one request measured; times in seconds from when it was sent."""

    ok: bool
    prompt_len: int = 0  # the server's usage.prompt_tokens when it reports it
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def request_body(backend: str, model: str, request: BenchRequest, prompt_format: str,
                 ignore_eos: bool, temperature: float, logprobs: int | None) -> dict:
    """The JSON body of one streamed request (`openai`: completions; `openai-chat`)."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": request.output_len, "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
    else:
        body["prompt"] = request.prompt if prompt_format == "text" else request.prompt_token_ids
        if logprobs is not None:
            body["logprobs"] = logprobs
    return body


def tokens_in_chunk(choices: list[dict], usage: dict | None, seen: int) -> int:
    """How many new tokens a chunk with `choices` carries, given `seen` so far."""
    if usage and usage.get("completion_tokens") is not None:
        return max(0, int(usage["completion_tokens"]) - seen)
    count = 0
    for choice in choices:
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            entries = logprobs.get("tokens", logprobs.get("content"))
            if entries is not None:
                count += len(entries)
                continue
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            count += 1
    return count


class StreamRecorder:
    """Token arrival times of one stream, fed one parsed SSE chunk at a time."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.num_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at = start
        self.itl: list[float] = []
        self.usage: dict = {}  # the latest usage seen (the final chunk's is the total)

    def add(self, chunk: dict, now: float) -> None:
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        choices = chunk.get("choices") or []
        if not choices:
            return
        new = tokens_in_chunk(choices, usage, self.num_tokens)
        if not new:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.itl.append(now - self.last_token_at)
        self.last_token_at = now
        self.num_tokens += new

    def result(self, request: BenchRequest, end: float) -> RequestResult:
        output_tokens = int(self.usage.get("completion_tokens") or self.num_tokens)
        prompt_len = int(self.usage.get("prompt_tokens") or request.prompt_len)
        if self.first_token_at is None:
            return RequestResult(False, prompt_len, error="the stream carried no token")
        return RequestResult(True, prompt_len, output_tokens, self.first_token_at - self.start,
                             end - self.start, self.itl)



async def sse_chunks(response) -> AsyncIterator[dict]:
    """The JSON chunks of an OpenAI server-sent event stream, up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)

async def send_request(client, url: str, body: dict, request: BenchRequest,
                       clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """POST one streamed request and record it; every failure is a result, never a raise."""
    start = clock()
    recorder = StreamRecorder(start)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                return RequestResult(False, error=f"HTTP {response.status_code}: {text}")
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    return RequestResult(False, error=f"stream error: {chunk['error']}"[:300])
                recorder.add(chunk, clock())
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, not fatal)
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}"[:300])
    return recorder.result(request, clock())

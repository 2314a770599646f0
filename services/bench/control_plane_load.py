"""The load of `pagoda bench control-plane`: N streaming clients in a closed loop for a
fixed window, and what the window measured.

Each client sends one streamed completion after another (`ignore_eos`, exact
`max_tokens`), with aiohttp on kept-alive connections (vLLM's benchmark client; the
default) or httpx with a new connection per request (`--client httpx`). Token
counts come from `continuous_usage_stats` (services/bench/stream.py). Only tokens and
requests that arrive inside the window [t0, t1] count; the streams still open at t1
are cancelled (the server aborts them). ITL is per chunk, vLLM's definition.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from pagoda.services.bench.stream import sse_chunks, tokens_in_chunk


@dataclass
class WindowStats:
    """What the clients saw between t0 and t1 (Unix seconds)."""

    t0: float = 0.0
    t1: float = 0.0
    tokens: int = 0
    requests_done: int = 0
    itl: list[float] = field(default_factory=list)  # seconds, chunk to chunk
    prompt_tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def prompt_text(index: int, words: int) -> str:
    """A prompt of about `words` + 3 tokens, different per request (no shared prefix
    beyond the first words)."""
    return f"Request {index}:" + " hello" * words


class _Stream:
    """One request's accounting into `stats`: tokens and ITL inside [t0, t1], and the
    request counted done when it ended inside the window with all its tokens."""

    def __init__(self, stats: WindowStats, max_tokens: int) -> None:
        self.stats, self.max_tokens = stats, max_tokens
        self.seen, self.last, self.prompt_len = 0, None, None

    def chunk(self, chunk: dict, now: float) -> None:
        stats = self.stats
        usage = chunk.get("usage")
        if usage and self.prompt_len is None:
            self.prompt_len = usage.get("prompt_tokens")
        new = tokens_in_chunk(chunk.get("choices") or [], usage, self.seen)
        if not new:
            return
        self.seen += new
        if stats.t0 <= now <= stats.t1:
            stats.tokens += new
            if self.last is not None and self.last >= stats.t0:
                stats.itl.append(now - self.last)
        self.last = now

    def end(self, end: float) -> None:
        stats = self.stats
        if stats.t0 <= end <= stats.t1 and self.seen == self.max_tokens:
            stats.requests_done += 1
            if self.prompt_len is not None:
                stats.prompt_tokens.append(self.prompt_len)


def _body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def _client(client: httpx.AsyncClient, url: str, model: str, words: int,
                  max_tokens: int, counter, stats: WindowStats, stop_at: float) -> None:
    """httpx, stopping at `data: [DONE]` (the connection is not reused)."""
    while time.time() < stop_at:
        stream = _Stream(stats, max_tokens)
        try:
            async with client.stream("POST", url, json=_body(
                    model, prompt_text(next(counter), words), max_tokens)) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:200]
                    stats.errors.append(f"HTTP {response.status_code}: {text}")
                    await asyncio.sleep(0.1)
                    continue
                async for chunk in sse_chunks(response):
                    stream.chunk(chunk, time.time())
            stream.end(time.time())
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            stats.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(0.1)


async def _client_aiohttp(session, url: str, model: str, words: int, max_tokens: int,
                          counter, stats: WindowStats, stop_at: float) -> None:
    """aiohttp (vLLM's benchmark client), each response read to its end so that the
    connection is kept and reused, as SDK clients do."""
    import aiohttp  # lazy: only this client needs it (it comes with kubernetes)

    while time.time() < stop_at:
        stream = _Stream(stats, max_tokens)
        try:
            async with session.post(url, json=_body(
                    model, prompt_text(next(counter), words), max_tokens)) as response:
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")[:200]
                    stats.errors.append(f"HTTP {response.status}: {text}")
                    await asyncio.sleep(0.1)
                    continue
                done = False
                async for raw in response.content:  # one SSE line at a time
                    line = raw.decode().strip()
                    if done or not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True  # read on to the end of the body: the connection is kept
                        continue
                    stream.chunk(json.loads(data), time.time())
            stream.end(time.time())
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
            stats.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(0.1)


CLIENTS = ("aiohttp", "httpx")


async def run_window(base_url: str, model: str, concurrency: int, words: int, max_tokens: int,
                     t0: float, t1: float, client: str = "aiohttp") -> WindowStats:
    """`concurrency` clients from now until t1 (Unix seconds); the stats of [t0, t1].
    `client`: aiohttp with kept-alive connections (default; vLLM's benchmark client), or
    httpx with a new connection per request (this bench's client until stop 40: its
    pool stalls with hundreds of kept-alive connections, 56 against 311 short req/s at
    256 streams on the 2-core box)."""
    stats = WindowStats(t0=t0, t1=t1)
    counter = iter(range(10**9))
    url = f"{base_url}/completions"

    async def run(make_task) -> None:
        tasks = [asyncio.create_task(make_task()) for _ in range(concurrency)]
        await asyncio.sleep(max(0.0, stats.t1 - time.time()))
        for task in tasks:  # the streams still open: cancelled (aborted at the server)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    if client == "aiohttp":
        import aiohttp  # lazy: as above

        connector = aiohttp.TCPConnector(limit=concurrency + 8)
        timeout = aiohttp.ClientTimeout(total=120.0, connect=30.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await run(lambda: _client_aiohttp(session, url, model, words, max_tokens, counter,
                                              stats, stats.t1))
        return stats
    if client != "httpx":
        raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {client!r}")
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0, connect=30.0)) \
            as session:
        await run(lambda: _client(session, url, model, words, max_tokens, counter, stats,
                                  stats.t1))
    return stats


def read_steps(path: str, t0: float, t1: float) -> list[tuple[float, float, int, int]]:
    """The simulated device's steps (start, end, tokens, requests) that started in
    [t0, t1], from its record file."""
    steps = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) != 4:
                    continue  # a line being written
                start, end = float(parts[0]), float(parts[1])
                if t0 <= start <= t1:
                    steps.append((start, end, int(parts[2]), int(parts[3])))
    except FileNotFoundError:
        pass
    return steps


def idle_gaps(steps: list[tuple[float, float, int, int]]) -> list[float]:
    """Seconds between one step's end and the next one's start."""
    return [b[0] - a[1] for a, b in zip(steps, steps[1:])]


def last_step_end(path: str) -> float | None:
    """When the device's latest recorded step ended (Unix seconds); None before any."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 256))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        parts = line.split()
        if len(parts) == 4:
            return float(parts[1])
    return None


async def wait_idle(path: str, quiet_s: float = 0.5, timeout: float = 120.0) -> float:
    """Seconds until the device took no step for `quiet_s` (every request, aborted ones
    included, is gone), at most `timeout`."""
    start = time.time()
    while time.time() - start < timeout:
        end = last_step_end(path)
        if end is None or time.time() - end > quiet_s:
            return max(0.0, (end or start) - start)
        await asyncio.sleep(0.1)
    return timeout

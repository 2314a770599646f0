"""`pagoda bench serve`: load a running OpenAI-compatible server, print one JSON line.

Prompts are seeded random token ids of exactly `--random-input-len` tokens sent to
`/v1/completions` (as token-id prompts, so every server does the same work), each
streamed with `ignore_eos` to exactly `--random-output-len` tokens, at most
`--max-concurrency` at a time. TTFT is the time to the first text chunk; TPOT is
(latency - TTFT) / (output tokens - 1), per request; token counts come from the
server's final usage chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="Load a running server with streaming requests.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="Model name (default: the server's first).")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="Requests sent before timing.")
    parser.set_defaults(func=run)
    return parser


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    output_tokens: int = 0
    error: str = ""


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids, where special tokens usually live.
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(num)]


async def one_request(client, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    ttft, tokens = 0.0, 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}: "
                                     f"{(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"]))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if not ttft and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 (counted as an error)
        return RequestResult(False, error=repr(exc))
    return RequestResult(True, time.perf_counter() - start, ttft, tokens)


async def bench(args: argparse.Namespace) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency + 4)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None,
                                 limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        vocab = 32000  # random ids below every supported model's vocabulary size

        def body(prompt: list[int]) -> dict:
            return {"model": model, "prompt": prompt, "max_tokens": args.random_output_len,
                    "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}

        for prompt in random_prompts(args.warmup, args.random_input_len, vocab, args.seed + 1):
            await one_request(client, "/v1/completions", body(prompt))
        prompts = random_prompts(args.num_prompts, args.random_input_len, vocab, args.seed)
        semaphore = asyncio.Semaphore(args.max_concurrency)

        async def limited(prompt: list[int]) -> RequestResult:
            async with semaphore:
                return await one_request(client, "/v1/completions", body(prompt))

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    return summarize(args, model, results, elapsed)


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult],
              elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [(r.latency - r.ttft) * 1000 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "model": model, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
        "input_len": args.random_input_len, "output_len": args.random_output_len,
        "completed": len(ok), "errors": len(results) - len(ok),
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(ok) / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((out_tokens + len(ok) * args.random_input_len) / elapsed, 2),
    }
    for name, values in (("ttft_ms", ttfts), ("tpot_ms", tpots)):
        summary[f"mean_{name}"] = round(statistics.fmean(values), 2) if values else None
        summary[f"p50_{name}"] = round(percentile(values, 50), 2) if values else None
        summary[f"p99_{name}"] = round(percentile(values, 99), 2) if values else None
    if len(ok) < len(results):
        summary["first_error"] = next(r.error for r in results if not r.ok)
    return summary


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run(args: argparse.Namespace) -> int:
    summary = asyncio.run(bench(args))
    print(json.dumps(summary), flush=True)
    return 0 if summary["errors"] == 0 else 1

"""`pagoda bench serve`: load a running OpenAI-compatible server, print one JSON line.

Like `vllm bench serve`, with its flag names and result keys: `--dataset-name
random` (prompts of exactly `--random-input-len` tokens, `--random-output-len`
out, `ignore_eos` so every run does the same work) or `sharegpt` (a local
`--dataset-path`; replies end naturally); requests sent at `--request-rate`
(Poisson, `inf` = all at once), at most `--max-concurrency` in flight. Prompts
go as text, through the server's tokenizer, unless `--prompt-format tokens`.
Without `--seed` every run draws a fresh seed (printed), so a run never hits the
prefix cache that the previous run filled. TTFT counts the first token even
when it has no text (stream.py says how). The line names the server, the model
and every setting, then throughput (`output_throughput`, `total_token_throughput`,
`request_throughput`) and mean/median/p99 TTFT, TPOT, ITL and E2E latency in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time

import httpx

from pagoda.bench.stats import percentile
from pagoda.services.bench import random_mm
from pagoda.services.bench.datasets import (BenchRequest, arrival_times, random_requests,
                                            sharegpt_requests)
from pagoda.services.bench.stream import RequestResult, request_body, send_request
from pagoda.services.bench.structured import MODES as STRUCTURED_MODES
from pagoda.services.bench.structured import structured_fields

ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions",
             "openai-chat": "/v1/chat/completions"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="Load a running server with streaming requests.",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(ENDPOINTS), default="openai",
                        help="openai (and vllm): /v1/completions; openai-chat: /v1/chat/completions.")
    parser.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None, help="Path (default: the backend's).")
    parser.add_argument("--model", default=None, help="Model name (default: the server's first).")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer for building prompts: a directory, GGUF file or hub id "
                             "(default: the model path the server reports, else --model).")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--dataset-name", choices=["random", "sharegpt", "random-mm"],
                        default="random",
                        help="random-mm: random text and random images, one chat each "
                             "(openai-chat backend; services/bench/random_mm.py).")
    parser.add_argument("--dataset-path", default=None, help="A local ShareGPT-format JSON file.")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="Fixed output length for ShareGPT (default: each reply's length).")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32,
                        help="Requests in flight at most (0: no limit).")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Requests per second, Poisson arrivals (default inf: all at once).")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of the arrival gaps (1: Poisson).")
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--prompt-format", choices=["text", "tokens"], default="text",
                        help="Send prompts as text (default) or as token ids (completions only).")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                        help="Default: on for random (fixed work), off for sharegpt.")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--logprobs", type=_logprobs, default=0,
                        help="Logprobs per token to ask for (default 0: the sampled token's, so "
                             "a token without text still reaches the client); 'none' to omit.")
    parser.add_argument("--seed", type=int, default=None, help="Default: fresh each run.")
    parser.add_argument("--warmup", type=int, default=1, help="Requests sent before timing.")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--structured", choices=STRUCTURED_MODES, default=None,
                        help="Constrain every answer (structured outputs): a JSON schema, a "
                             "regex or a choice (services/bench/structured.py).")
    random_mm.add_args(parser)
    parser.set_defaults(func=run)
    return parser


def _logprobs(value: str) -> int | None:
    return None if value.lower() == "none" else int(value)


def resolve_settings(args: argparse.Namespace) -> None:
    """Fill the defaults that depend on other flags; reject what cannot work."""
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.endpoint = args.endpoint or ENDPOINTS[args.backend]
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset_name in ("random", "random-mm")
    if args.dataset_name == "random-mm":
        if args.backend != "openai-chat":
            raise SystemExit("pagoda bench serve: --dataset-name random-mm needs "
                             "--backend openai-chat (images travel as chat parts)")
        random_mm.parse_buckets(args.random_mm_bucket_config)
    if args.prompt_format == "tokens" and args.backend == "openai-chat":
        raise SystemExit("pagoda bench serve: --prompt-format tokens needs a completions backend")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise SystemExit("pagoda bench serve: --dataset-name sharegpt needs --dataset-path")


def build_requests(args: argparse.Namespace, tokenizer) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up requests, measured requests); warm-ups are random prompts of their own
    seed, so they never share a prefix with what is measured."""
    warmup = random_requests(tokenizer, args.warmup, args.random_input_len,
                             min(args.random_output_len, 16), args.seed + 1)
    if args.dataset_name == "sharegpt":
        requests = sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.seed,
                                     args.sharegpt_output_len)
    else:
        requests = random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                   args.random_output_len, args.seed)
    return warmup, requests


async def bench(args: argparse.Namespace) -> dict:
    # lazy: the tokenizer loader brings torch and transformers; the CLI imports this module for its
    # flags
    from pagoda.tokenizer.loader import load_tokenizer

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or args.num_prompts
    async with httpx.AsyncClient(headers=headers, limits=httpx.Limits(max_connections=limit + 4),
                                 timeout=httpx.Timeout(args.request_timeout, connect=10.0)) as client:
        listed = (await client.get(f"{args.base_url}/v1/models")).json()["data"][0]
        model = args.model or listed["id"]
        root = listed.get("root")
        tokenizer_id = args.tokenizer or (root if root and os.path.exists(root) else model)
        tokenizer = load_tokenizer(None, tokenizer_id)
        warmup, requests = build_requests(args, tokenizer)
        url = args.base_url + args.endpoint

        def body(request: BenchRequest) -> dict:
            return {**request_body(args.backend, model, request, args.prompt_format,
                                   args.ignore_eos, args.temperature, args.logprobs),
                    **structured_fields(args.structured)}

        bodies, warm_bodies = [body(r) for r in requests], [body(r) for r in warmup]
        if args.dataset_name == "random-mm":  # warm-ups get images of their own seed
            bodies = [random_mm.with_images(b, r, u) for b, r, u in
                      zip(bodies, requests, random_mm.image_urls(args, len(requests), args.seed))]
            warm_bodies = [random_mm.with_images(b, r, u) for b, r, u in zip(
                warm_bodies, warmup,
                random_mm.image_urls(args, len(warmup), args.seed + 1, same=False))]
        for request, warm in zip(warmup, warm_bodies):
            await send_request(client, url, warm, request)
        results = await run_schedule(client, url, bodies, requests,
                                     arrival_times(len(requests), args.request_rate,
                                                   args.burstiness, args.seed), limit)
    return summarize(args, model, tokenizer_id, *results)


async def run_schedule(client, url: str, bodies: list[dict], requests: list[BenchRequest],
                       times: list[float], limit: int) -> tuple[list[RequestResult], float]:
    """Send request i at times[i] (seconds from the start) or when a slot frees,
    whichever is later; (results in order, wall seconds)."""
    semaphore = asyncio.Semaphore(limit)
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
        async with semaphore:
            return await send_request(client, url, bodies[i], requests[i])

    results = await asyncio.gather(*(one(i) for i in range(len(requests))))
    return list(results), time.perf_counter() - start


def summarize(args: argparse.Namespace, model: str, tokenizer_id: str,
              results: list[RequestResult], duration: float) -> dict:
    """vLLM's result keys (`vllm bench serve --save-result`), after the settings."""
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    summary = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "base_url": args.base_url,
        "endpoint": args.endpoint, "backend": args.backend, "model_id": model,
        "tokenizer_id": tokenizer_id, "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path, "prompt_format": args.prompt_format,
        "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency or None,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature, "logprobs": args.logprobs, "seed": args.seed,
        "structured": args.structured,
        **({"random_mm_base_items_per_request": args.random_mm_base_items_per_request,
            "random_mm_bucket_config": args.random_mm_bucket_config,
            "random_mm_same_image": args.random_mm_same_image}
           if args.dataset_name == "random-mm" else {}),
        "duration": round(duration, 3), "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(total_out / duration, 2),
        "total_token_throughput": round((total_in + total_out) / duration, 2),
    }
    metrics = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, seconds in metrics.items():
        values = [s * 1000 for s in seconds]
        summary[f"mean_{name}_ms"] = round(statistics.fmean(values), 2) if values else None
        summary[f"median_{name}_ms"] = round(percentile(values, 50), 2) if values else None
        summary[f"std_{name}_ms"] = round(statistics.pstdev(values), 2) if values else None
        summary[f"p99_{name}_ms"] = round(percentile(values, 99), 2) if values else None
    if len(ok) < len(results):
        summary["first_error"] = next(r.error for r in results if not r.ok)
    return summary


def run(args: argparse.Namespace) -> int:
    resolve_settings(args)
    summary = asyncio.run(bench(args))
    print(json.dumps(summary), flush=True)
    return 0 if summary["failed"] == 0 else 1

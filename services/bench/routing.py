"""`pagoda bench routing`: the shared-prefix workload against N replicas, once per router.

The workload (issue 5's): `--num-prefixes` shared system prompts of
`--prefix-len` tokens, each followed by `--users-per-prefix` different user turns
of `--suffix-len` tokens, sent in random order at `--max-concurrency`, streamed
with `ignore_eos` to `--output-len` tokens. Token-id prompts, so every router
gets exactly the same work. By default the benchmark starts its own cluster
(`--data-parallel-size` replicas, one gateway per router, each replica's KV cache
sized by `--num-gpu-blocks-override` to hold about half the prefixes) and gives
each router a fresh prompt set (another seed), so no router profits from an
earlier one's cache. Prints one JSON line per router, then one line of
kv_aware / round_robin ratios (TTFT mean and p90, throughput, cache hit rate).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

from pagoda.bench.stats import percentile
from pagoda.services.cli import serve
from pagoda.services.cli.local_cluster import LocalCluster, ServiceProcess
from pagoda.free_ports import free_port
from pagoda.services.common.redis_server import PrivateRedis

ROUTERS = ("round_robin", "kv_aware")
VOCAB = 32000  # ids below every supported model's vocabulary size


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("routing", help="Shared-prefix workload, once per router.")
    parser.add_argument("--model", default=None, help="Model to serve (default: SmolLM2).")
    parser.add_argument("--base-url", default=None,
                        help="Bench a running gateway instead (its router only).")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="KV blocks per replica (default: about half the prefixes).")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--users-per-prefix", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=500)
    parser.add_argument("--suffix-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="Show the services' logs.")
    parser.set_defaults(func=run)
    return parser


def shared_prefix_workload(num_prefixes: int, users_per_prefix: int, prefix_len: int,
                           suffix_len: int, seed: int = 0) -> list[list[int]]:
    """Prompts (system prefix + user turn), shuffled."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prefixes):
        prefix = [rng.randrange(100, VOCAB) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(100, VOCAB) for _ in range(suffix_len)]
                    for _ in range(users_per_prefix)]
    rng.shuffle(prompts)
    return prompts


def default_num_blocks(args: argparse.Namespace) -> int:
    """KV blocks holding about half the prefixes, plus one per request in flight."""
    half = -(-args.num_prefixes // 2)
    return half * (args.prefix_len // args.block_size) + args.max_concurrency


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    instance: str = ""
    error: str = ""


async def one_request(client, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            result.instance = response.headers.get("x-pagoda-instance", "")
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("choices") and not result.ttft:
                    result.ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except Exception as exc:  # noqa: BLE001 (counted as an error)
        result.error = repr(exc)
        return result
    result.ok, result.latency = True, time.perf_counter() - start
    return result


async def run_workload(base_url: str, prompts: list[list[int]], concurrency: int,
                       output_len: int, model: str | None = None
                       ) -> tuple[list[RequestResult], float]:
    """Every prompt through the gateway at `concurrency`; (results in prompt order, seconds)."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        model = model or (await client.get("/v1/models")).json()["data"][0]["id"]
        semaphore = asyncio.Semaphore(concurrency)

        async def limited(prompt: list[int]) -> RequestResult:
            async with semaphore:
                return await one_request(client, model, prompt, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return list(results), time.perf_counter() - start


def summarize(router: str, results: list[RequestResult], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    per_instance: dict[str, int] = {}
    for r in ok:
        per_instance[r.instance] = per_instance.get(r.instance, 0) + 1
    summary = {
        "router": router, "completed": len(ok), "errors": len(results) - len(ok),
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(ok) / elapsed, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / elapsed, 2),
        "mean_ttft_ms": round(statistics.fmean(ttfts), 2) if ttfts else None,
        "p90_ttft_ms": round(percentile(ttfts, 90), 2) if ttfts else None,
        "cache_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else 0.0,
        "max_replica_share": round(max(per_instance.values()) / len(ok), 3) if ok else None,
        "requests_per_replica": dict(sorted(per_instance.items())),
    }
    if len(ok) < len(results):
        summary["first_error"] = next(r.error for r in results if not r.ok)
    return summary


def ratios(by_router: dict[str, dict]) -> dict:
    """kv_aware / round_robin for each headline figure."""
    kv, rr = by_router.get("kv_aware"), by_router.get("round_robin")
    if not kv or not rr:
        return {}
    keys = ("mean_ttft_ms", "p90_ttft_ms", "output_tokens_per_s", "cache_hit_rate")
    return {"ratio": "kv_aware/round_robin",
            **{k: round(kv[k] / rr[k], 3) if kv.get(k) and rr.get(k) else None for k in keys}}


@contextlib.contextmanager
def bench_cluster(args: argparse.Namespace, routers: list[str]):
    """A local cluster with one gateway per router: yields {router: base URL}."""
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    blocks = args.num_gpu_blocks_override or default_num_blocks(args)
    argv = ["serve", *([args.model] if args.model else []), "--port", str(free_port()),
            "--data-parallel-size", str(args.data_parallel_size), "--router", routers[0],
            "--num-gpu-blocks-override", str(blocks), "--block-size", str(args.block_size),
            "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
            "--disable-log-stats"]
    serve_args = parser.parse_args(argv)
    with PrivateRedis() as redis_server, open("/dev/null", "w") as sink:
        services = serve.build_services(serve_args, redis_server.url)
        urls = {routers[0]: f"http://{services[-1].address}"}
        for router in routers[1:]:
            services.append(extra_gateway(services[-1], router, free_port()))
            urls[router] = f"http://{services[-1].address}"
        cluster = LocalCluster(services, log_stream=sink if not args.verbose else sys.stderr)
        try:
            cluster.start()
            cluster.wait_healthy(900)
            yield urls
        finally:
            cluster.stop()


def extra_gateway(gateway, router: str, port: int):
    """Another gateway on the same peers, with `router`."""
    argv = list(gateway.argv)
    argv[argv.index("--router") + 1] = router
    argv[argv.index("--port") + 1] = str(port)
    host = gateway.address.rsplit(":", 1)[0]
    return ServiceProcess(f"gateway-{router}", argv, f"{host}:{port}", http_health=True,
                          kind="gateway")


def run(args: argparse.Namespace) -> int:
    routers = [r for r in args.routers.split(",") if r]
    workload = dict(num_prefixes=args.num_prefixes, users_per_prefix=args.users_per_prefix,
                    prefix_len=args.prefix_len, suffix_len=args.suffix_len)
    with (contextlib.nullcontext({"server": args.base_url}) if args.base_url
          else bench_cluster(args, routers)) as urls:
        by_router = {}
        for k, (router, url) in enumerate(urls.items()):
            warmup = shared_prefix_workload(2, 1, args.prefix_len, args.suffix_len, -1 - k)
            asyncio.run(run_workload(url, warmup, 2, args.output_len))
            prompts = shared_prefix_workload(**workload, seed=args.seed + 1000 * k)
            results, elapsed = asyncio.run(run_workload(url, prompts, args.max_concurrency,
                                                        args.output_len))
            by_router[router] = summarize(router, results, elapsed)
            print(json.dumps(by_router[router]), flush=True)
    if ratios(by_router):
        print(json.dumps(ratios(by_router)), flush=True)
    return 0 if all(s["errors"] == 0 for s in by_router.values()) else 1

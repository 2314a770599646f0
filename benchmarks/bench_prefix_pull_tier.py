"""A prefix pulled from a peer's host KV tier, against one pulled from its device and
one recomputed (not a pytest file).

    .venv/bin/python benchmarks/bench_prefix_pull_tier.py [MODEL] [--lengths 256,512,1024] [--trials 3]

The cluster of bench_prefix_pull.py (replicas S and R, gateways with and without
--kv-prefix-pull), each replica with a small device pool and a host tier
(--num-gpu-blocks-override, --kv-offloading-size). Per length and trial, on fresh
random prefixes:

    tier       S computed the prefix, fillers pushed it into S's host tier (the index
               says so); R pulls it: S onloads it first (services/scheduler/kv_tier_lease.py)
    device     S computed the prefix and still holds it on its device; R pulls it
    recompute  R computes the prompt (the gateway without the flag)

One request at a time, max_tokens 1, timed at the client (time to first token); medians.
Prints one JSON object.

Measured with `--trials 3` (SmolLM2-135M Q4_1, 2-core CPU shared with other jobs, load
average ~6, so every figure is slow; the ratios are from the same run):

    prefix tokens (blocks)   from S's tier   from S's device   recomputed
      256 (16)               0.168 s         0.080 s           0.652 s
      512 (32)               0.212 s         0.165 s           2.201 s
     1024 (64)               0.425 s         0.183 s           3.876 s

The tier path adds S's onload and its one-token step to the device pull.
"""

from __future__ import annotations

import argparse
import json
import statistics
import random
import sys
import time

from bench_prefix_pull import BLOCK_SIZE, SUFFIX, Bench, tokens

POOL_BLOCKS = 160
HOST_TIER_GIB = 0.5


def lookup(bench: Bench, prompt: list[int]):
    from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as kpb
    from pagoda.services._proto.pagoda.kv_cache_manager.v1 import (
        kv_cache_manager_pb2_grpc as kpb_grpc)
    from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
    from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
    import grpc

    with grpc.insecure_channel(bench.tokenizer) as channel:
        hashes = tpb_grpc.TokenizerServiceStub(channel).Tokenize(tpb.TokenizeRequest(
            token_ids=tpb.TokenIds(token_ids=prompt), block_size=BLOCK_SIZE),
            timeout=10).block_hashes
    with grpc.insecure_channel(bench.index) as channel:
        return kpb_grpc.KvCacheManagerServiceStub(channel).LookupPrefix(
            kpb.LookupPrefixRequest(model=bench.model, block_size=BLOCK_SIZE,
                                    block_hashes=hashes), timeout=10)


def park_in_tier(bench: Bench, prefix: list[int], rng: random.Random) -> None:
    """S computes `prefix`, then fillers push it from S's device into its host tier."""
    bench.on_source(prefix, rng)
    s, blocks = bench.addresses[0], len(prefix) // BLOCK_SIZE
    for _ in range(20):
        reply = lookup(bench, prefix)
        if reply.num_cached_blocks.get(s, 0) == 0 and reply.num_host_blocks.get(s, 0) >= blocks:
            return
        bench.complete(tokens(rng, (POOL_BLOCKS // 2) * BLOCK_SIZE), 0)
        time.sleep(0.2)
    raise RuntimeError("the prefix never showed in S's host tier alone")


def measure(bench: Bench, length: int, trials: int, rng: random.Random) -> dict:
    times = {"tier": [], "device": [], "recompute": []}
    for _ in range(trials):
        parked = tokens(rng, length)
        park_in_tier(bench, parked, rng)
        seconds, instance, cached = bench.complete(parked + tokens(rng, SUFFIX), 1)
        assert instance == bench.addresses[1], instance
        if cached < length:
            print(f"warning: {length}-token tier pull found {cached} cached tokens",
                  file=sys.stderr)
        times["tier"].append(seconds)
        held = tokens(rng, length)
        bench.on_source(held, rng)
        seconds, _, cached = bench.complete(held + tokens(rng, SUFFIX), 1)
        times["device"].append(seconds)
        times["recompute"].append(
            bench.complete(tokens(rng, length + SUFFIX), 1, "plain")[0])
    row = {"prefix_tokens": length, "blocks": length // BLOCK_SIZE,
           **{f"{k}_ttft_s": round(statistics.median(v), 4) for k, v in times.items()}}
    row["tier_vs_recompute"] = round(row["recompute_ttft_s"] / row["tier_ttft_s"], 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None,
                        help="Model (default: pagoda serve's, SmolLM2-135M-Instruct).")
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    assert max(lengths) // BLOCK_SIZE < POOL_BLOCKS // 2, "a prefix must fit half the pool"
    bench = Bench(args.model, POOL_BLOCKS * BLOCK_SIZE // 2 + 2 * SUFFIX, extra=(
        "--num-gpu-blocks-override", str(POOL_BLOCKS), "--kv-offloading-backend", "native",
        "--kv-offloading-size", str(HOST_TIER_GIB), "--kv-lease-timeout", "60"))
    rng = random.Random(args.seed)
    try:
        bench.start()
        bench.complete(tokens(rng, max(lengths)), 1, "plain")  # warm R's shapes
        rows = [measure(bench, length, args.trials, rng) for length in lengths]
    finally:
        bench.stop()
    print(json.dumps({"model": bench.model, "block_size": BLOCK_SIZE, "trials": args.trials,
                      "device_pool_blocks": POOL_BLOCKS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

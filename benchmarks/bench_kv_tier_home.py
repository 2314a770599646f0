"""Where the host KV tier should live: in the gpu-worker's own memory, or in a node-local
pool that the kv-cache-manager owns and several replicas share. Not a pytest file.

    .venv/bin/python benchmarks/bench_kv_tier_home.py [--block-kib 720] [--blocks 256]

A tier in another process costs, per block moved, whichever of these it would use:

    in_worker     copy a block from the KV cache into a host tensor in the same process
                  (what `--kv-offloading-backend native` does today, CPU build)
    shm_copy      copy it into a POSIX shared-memory segment mapped as a tensor (a pool
                  the manager owns and maps into every replica: the same memcpy, plus the
                  mapping, set up once)
    grpc_bytes    send it as bytes to another process over loopback gRPC (a pool with no
                  shared memory: the manager receives each block)
    grpc_rpc      one small loopback gRPC round trip (the per-step coordination a shared
                  pool needs: slots reserved or released, the index updated)

Block size defaults to SmolLM2-135M's (30 layers x K/V x 16 tokens x 3 KV heads x 64 x
fp32 = 720 KiB). Prints one JSON object: milliseconds per block for the copies, per call
for the round trip, and the bandwidths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent import futures
from multiprocessing import shared_memory

import grpc
import numpy as np
import torch

_METHOD = "/bench.KvTierHome/Put"


def _timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs, after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _serve() -> tuple[grpc.Server, str]:
    handler = grpc.method_handlers_generic_handler("bench.KvTierHome", {
        "Put": grpc.unary_unary_rpc_method_handler(
            lambda request, context: len(request).to_bytes(8, "little"),
            request_deserializer=None, response_serializer=None)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", 1 << 30)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", type=int, default=720)
    parser.add_argument("--blocks", type=int, default=256,
                        help="Blocks in the source cache and in each pool.")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    floats = args.block_kib * 1024 // 4
    cache = torch.randn(args.blocks, floats)
    host = torch.empty_like(cache)
    segment = shared_memory.SharedMemory(create=True, size=cache.numel() * 4)
    try:
        shm = torch.from_numpy(np.ndarray(cache.shape, dtype=np.float32, buffer=segment.buf))
        order = torch.randperm(args.blocks)

        def copy_into(pool: torch.Tensor) -> None:
            for i in order[:16].tolist():  # 16 scattered blocks, as a step's offloads are
                pool[(i * 7) % args.blocks].copy_(cache[i])

        in_worker = _timed(lambda: copy_into(host), args.repeats) / 16
        shm_copy = _timed(lambda: copy_into(shm), args.repeats) / 16
        server, address = _serve()
        channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 1 << 30)])
        put = channel.unary_unary(_METHOD)
        payload = cache[0].numpy().tobytes()
        grpc_bytes = _timed(lambda: put(payload), args.repeats)
        grpc_rpc = _timed(lambda: put(b"x" * 64), args.repeats)
        channel.close()
        server.stop(None)
        del shm
    finally:
        segment.close()
        segment.unlink()
    block_mb = args.block_kib / 1024
    print(json.dumps({
        "block_kib": args.block_kib,
        "ms_per_block": {"in_worker": round(in_worker * 1e3, 4),
                         "shm_copy": round(shm_copy * 1e3, 4),
                         "grpc_bytes": round(grpc_bytes * 1e3, 4)},
        "grpc_rpc_ms": round(grpc_rpc * 1e3, 4),
        "gb_per_s": {"in_worker": round(block_mb / 1024 / in_worker, 2),
                     "shm_copy": round(block_mb / 1024 / shm_copy, 2),
                     "grpc_bytes": round(block_mb / 1024 / grpc_bytes, 2)},
    }, indent=1))


if __name__ == "__main__":
    main()

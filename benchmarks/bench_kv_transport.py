"""KV transport cost between two gpu-workers, per connector (not a pytest file).

    .venv/bin/python benchmarks/bench_kv_transport.py [MODEL] [--blocks 16,64,256] [--trials 5]

Starts three `pagoda gpu-worker` processes on 127.0.0.1 with the model (default: the
packaged SmolLM2 GGUF, bf16): a source, a sink on PagodaConnector (gRPC stream,
CRC-32 per block) and a sink on PagodaDistConnector (torch.distributed pair group,
gloo on this CPU, NCCL on CUDA). Each trial asks a sink to FetchBlocks N blocks from
the source, exactly what a decode replica's scheduler asks after a remote prefill,
and times the call at the client. Reports the median per connector and N: ms per
pull, µs per block and MB/s. The first pull of the dist sink (opening the pair) is
reported apart. Nothing else runs: this is the transport alone, with both workers
idle, not a loaded cluster. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import grpc

CONNECTORS = ("PagodaConnector", "PagodaDistConnector")


def free_port() -> int:
    from pagoda.free_ports import free_port as pick

    return pick()


def start_worker(model: str, port: int, connector: str, dtype: str) -> subprocess.Popen:
    config = json.dumps({"kv_connector": connector, "kv_role": "kv_both"})
    return subprocess.Popen(
        [sys.executable, "-m", "pagoda.services.cli.main", "gpu-worker", "--host", "127.0.0.1",
         "--port", str(port), "--model", model, "--dtype", dtype, "--block-size", "16",
         "--kv-transfer-config", config],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})


def ready(address: str, num_blocks: int, deadline: float):
    from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
    from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
    from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
    from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as wpb_grpc

    channel = grpc.insecure_channel(address)
    while True:
        try:
            wpb_grpc.WorkerServiceStub(channel).InitializeKvCache(
                wpb.InitializeKvCacheRequest(num_blocks=num_blocks), timeout=60)
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    stub = kpb_grpc.KvTransferServiceStub(channel)
    return stub, stub.GetKvLayout(kpb.GetKvLayoutRequest(), timeout=10)


def main() -> int:
    from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--blocks", default="16,64,256")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.model is None:
        from pagoda.model.loader import default_model_path

        args.model = default_model_path()
    sizes = [int(n) for n in args.blocks.split(",")]
    num_blocks = max(sizes) * 2 + 8
    ports = {name: free_port() for name in ("source", *CONNECTORS)}
    procs = [start_worker(args.model, ports["source"], "PagodaConnector", args.dtype),
             *(start_worker(args.model, ports[c], c, args.dtype) for c in CONNECTORS)]
    try:
        deadline = time.monotonic() + 300
        source = f"127.0.0.1:{ports['source']}"
        _, layout = ready(source, num_blocks, deadline)
        sinks = {c: ready(f"127.0.0.1:{ports[c]}", num_blocks, deadline)[0] for c in CONNECTORS}
        block_bytes = layout.num_layers * 2 * layout.block_size * layout.num_kv_heads \
            * layout.head_dim * (2 if layout.kv_dtype in ("bfloat16", "float16") else 4)
        report = {"model": args.model, "kv_dtype": layout.kv_dtype, "block_bytes": block_bytes,
                  "device": layout.device_type, "results": []}

        def pull(connector: str, n: int) -> float:
            request = kpb.FetchBlocksRequest(
                source_address=source, source_epoch=layout.epoch,
                remote_block_ids=list(range(n)), local_block_ids=list(range(n, 2 * n)),
                timeout_s=120)
            started = time.perf_counter()
            sinks[connector].FetchBlocks(request, timeout=180)
            return time.perf_counter() - started

        report["dist_first_pull_ms"] = round(pull("PagodaDistConnector", 1) * 1e3, 2)
        pull("PagodaConnector", 1)  # the gRPC channel's connection, likewise apart
        for n in sizes:
            for connector in CONNECTORS:
                median = statistics.median(pull(connector, n) for _ in range(args.trials))
                report["results"].append({
                    "connector": connector, "blocks": n, "ms_per_pull": round(median * 1e3, 2),
                    "us_per_block": round(median / n * 1e6, 1),
                    "MB_per_s": round(n * block_bytes / median / 1e6, 1)})
        print(json.dumps(report, indent=1))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

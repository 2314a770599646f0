"""Cluster-wide prefix cache: a prompt whose prefix another replica holds, pulled
(--kv-prefix-pull) or computed (not a pytest file).

    .venv/bin/python benchmarks/bench_prefix_pull.py [MODEL] [--lengths 64,...,2048] [--trials 3]

Starts `pagoda serve MODEL --data-parallel-size 2 --router session --kv-prefix-pull
--kv-prefix-pull-min-blocks 1` (replicas S and R; the X-Session-Id header pins each
request to one) and a second gateway on the same replicas without the flag. For each
prefix length and trial, on fresh random prefixes that S has just computed:

    pull       prefix + suffix to R through the flagged gateway: R pulls the prefix from S
    recompute  prefix + suffix to R through the plain gateway: R computes the whole prompt
    local      prefix + suffix to S: a local prefix-cache hit (the floor)

Each is one request with max_tokens 1, timed at the client (its time to first token);
the medians over trials are reported with R's gpu-worker's own pull seconds and bytes
per block (pagoda_kv_transfer_seconds / _blocks_total / _bytes_total), a least-squares
line through time vs blocks for pull and for recompute (prefixes up to 32 blocks, where a
prefill is close to linear), where the lines cross, and the shortest measured prefix from
which the pull was faster at every length: the blocks from which a pull pays. One request at a time: this measures
latency, not throughput under load. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

BLOCK_SIZE = 16
SUFFIX = 8  # tokens after the prefix: the part every variant computes
LINEAR_BLOCKS = 32


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _rendezvous(key: str, address: str) -> int:
    from pagoda.services.gateway.routing.router import _rendezvous as rendezvous

    return rendezvous(key, address)


class Bench:
    """The cluster: replicas S (0) and R (1), gateways `pull` and `plain`."""

    def __init__(self, model: str | None, max_model_len: int, extra: tuple[str, ...] = ()
                 ) -> None:
        """`extra`: more `pagoda serve` flags (bench_prefix_pull_tier.py's tiers)."""
        from pagoda.services.bench.routing import extra_gateway
        from pagoda.services.cli import serve
        from pagoda.services.cli.local_cluster import LocalCluster
        from pagoda.free_ports import free_port
        from pagoda.services.common.redis_server import PrivateRedis

        self.redis = PrivateRedis().start()
        parser = argparse.ArgumentParser()
        serve.add_parser(parser.add_subparsers())
        args = parser.parse_args([
            "serve", *([model] if model else []), "--port", str(free_port()),
            "--served-model-name", "m", "--max-model-len", str(max_model_len),
            "--block-size", str(BLOCK_SIZE), "--disable-log-stats",
            "--data-parallel-size", "2", "--router", "session", "--kv-prefix-pull",
            "--kv-prefix-pull-min-blocks", "1", "--enable-prompt-tokens-details", *extra])
        services = serve.build_services(args, self.redis.url)
        gateway = next(s for s in services if s.kind == "gateway")
        plain = extra_gateway(gateway, "session", free_port())
        at = plain.argv.index("--kv-prefix-pull")
        del plain.argv[at:at + 3]  # the flag and --kv-prefix-pull-min-blocks 1
        services.append(plain)
        self.urls = {"pull": f"http://{gateway.address}", "plain": f"http://{plain.address}"}
        self.by_name = {s.name: s for s in services}
        self.addresses = flag(gateway.argv, "--scheduler-addrs").split(",")
        self.session = {}
        for i in range(100):
            key = f"user{i}"
            self.session.setdefault(max(range(2), key=lambda r: _rendezvous(
                key, self.addresses[r])), key)
        # One of the tokenizer replicas the gateway balances over (any answers the same).
        self.tokenizer = flag(gateway.argv, "--tokenizer-addr").split(",")[0]
        self.index = flag(gateway.argv, "--kv-cache-manager-addr")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-prefix-pull-")
        self.cluster = LocalCluster(services, log_stream=self.log)
        self.http = httpx.Client(timeout=600)

    def start(self) -> None:
        self.cluster.start()
        self.cluster.wait_healthy(900)
        for gateway in self.urls:  # both replicas routable at both gateways
            for replica in (0, 1):
                deadline = time.monotonic() + 120
                while self.complete([1, 2, 3], replica, gateway)[1] != self.addresses[replica]:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"replica {replica} never routable at {gateway}")
                    time.sleep(0.5)
        self.model = self._model()

    def stop(self) -> None:
        self.http.close()
        self.cluster.stop()
        self.redis.stop()

    def _model(self) -> str:
        from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
        from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc

        with grpc.insecure_channel(self.addresses[0]) as channel:
            return spb_grpc.SchedulerServiceStub(channel).GetModelInfo(
                spb.GetModelInfoRequest(), timeout=10).model

    def complete(self, prompt: list[int], replica: int, gateway: str = "pull"
                 ) -> tuple[float, str, int]:
        """(seconds, the instance that served it, cached tokens) of one max_tokens=1 request."""
        start = time.perf_counter()
        reply = self.http.post(f"{self.urls[gateway]}/v1/completions",
                               headers={"X-Session-Id": self.session[replica]},
                               json={"model": "m", "prompt": prompt, "max_tokens": 1,
                                     "temperature": 0.0})
        seconds = time.perf_counter() - start
        reply.raise_for_status()
        details = reply.json()["usage"].get("prompt_tokens_details") or {}
        return seconds, reply.headers.get("x-pagoda-instance"), details.get("cached_tokens", -1)

    def indexed_blocks(self, prompt: list[int], replica: int) -> int:
        from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as kpb
        from pagoda.services._proto.pagoda.kv_cache_manager.v1 import (
            kv_cache_manager_pb2_grpc as kpb_grpc)
        from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
        from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc

        with grpc.insecure_channel(self.tokenizer) as channel:
            hashes = tpb_grpc.TokenizerServiceStub(channel).Tokenize(tpb.TokenizeRequest(
                token_ids=tpb.TokenIds(token_ids=prompt), block_size=BLOCK_SIZE),
                timeout=10).block_hashes
        with grpc.insecure_channel(self.index) as channel:
            reply = kpb_grpc.KvCacheManagerServiceStub(channel).LookupPrefix(
                kpb.LookupPrefixRequest(model=self.model, block_size=BLOCK_SIZE,
                                        block_hashes=hashes), timeout=10)
        return reply.num_cached_blocks.get(self.addresses[replica], 0)

    def on_source(self, prefix: list[int], rng: random.Random) -> None:
        """S computes `prefix` (plus a suffix) and the index learns it."""
        self.complete(prefix + tokens(rng, SUFFIX), 0)
        deadline = time.monotonic() + 30
        while self.indexed_blocks(prefix, 0) < len(prefix) // BLOCK_SIZE:
            if time.monotonic() > deadline:
                raise RuntimeError("the index never showed the prefix on S")
            time.sleep(0.05)

    def pull_counters(self) -> dict[str, float]:
        """R's gpu-worker: pulled blocks, bytes and seconds so far."""
        port = flag(self.by_name["gpu-worker-1"].argv, "--metrics-port")
        text = self.http.get(f"http://127.0.0.1:{port}/metrics").text
        wanted = {"pagoda_kv_transfer_blocks_total": "blocks",
                  "pagoda_kv_transfer_bytes_total": "bytes",
                  "pagoda_kv_transfer_seconds_sum": "seconds"}
        found = {v: 0.0 for v in wanted.values()}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    found[wanted[sample.name]] += sample.value
        return found


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (blocks, seconds)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x in xs))
    return my - slope * mx, slope


def measure(bench: Bench, length: int, trials: int, rng: random.Random) -> dict:
    times = {"pull": [], "recompute": [], "local": []}
    moved = {"blocks": 0.0, "bytes": 0.0, "seconds": 0.0}
    for trial in range(trials):
        pulled, computed = tokens(rng, length), tokens(rng, length)
        bench.on_source(pulled, rng)
        bench.on_source(computed, rng)
        order = ["pull", "recompute"] if trial % 2 == 0 else ["recompute", "pull"]
        for kind in order:
            if kind == "pull":
                before = bench.pull_counters()
                seconds, instance, cached = bench.complete(pulled + tokens(rng, SUFFIX), 1)
                after = bench.pull_counters()
                for key in moved:
                    moved[key] += after[key] - before[key]
                if cached < length:
                    print(f"warning: {length}-token pull found {cached} cached tokens",
                          file=sys.stderr)
            else:
                seconds, instance, cached = bench.complete(
                    computed + tokens(rng, SUFFIX), 1, "plain")
            assert instance == bench.addresses[1], instance
            times[kind].append(seconds)
        times["local"].append(bench.complete(pulled + tokens(rng, SUFFIX), 0)[0])
    blocks = length // BLOCK_SIZE
    row = {"prefix_tokens": length, "blocks": blocks,
           **{f"{k}_ttft_s": round(statistics.median(v), 4) for k, v in times.items()}}
    if moved["blocks"]:
        row["pull_ms_per_block"] = round(1000 * moved["seconds"] / moved["blocks"], 3)
        row["bytes_per_block"] = int(moved["bytes"] / moved["blocks"])
    row["recompute_ms_per_block"] = round(1000 * (row["recompute_ttft_s"]
                                                  - row["local_ttft_s"]) / blocks, 3)
    row["pull_saves_s"] = round(row["recompute_ttft_s"] - row["pull_ttft_s"], 4)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None,
                        help="Model (default: pagoda serve's, SmolLM2-135M-Instruct).")
    parser.add_argument("--lengths", default="32,64,128,256,512,1024,2048",
                        help="Prefix lengths in tokens (multiples of 16).")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    bench = Bench(args.model, max(lengths) + 2 * SUFFIX + 64)
    rng = random.Random(args.seed)
    try:
        bench.start()
        for length in (lengths[0], lengths[-1]):  # warm both replicas' shapes
            bench.on_source(tokens(rng, length), rng)
            bench.complete(tokens(rng, length), 1, "plain")
        rows = [measure(bench, length, args.trials, rng) for length in lengths]
    finally:
        bench.stop()
    # The lines through the short prefixes only: there a prefill's time is close to
    # linear in its blocks (attention's quadratic part shows past ~512 tokens on a CPU).
    linear = [r for r in rows if r["blocks"] <= LINEAR_BLOCKS] or rows
    pull_line = fit([(r["blocks"], r["pull_ttft_s"]) for r in linear])
    recompute_line = fit([(r["blocks"], r["recompute_ttft_s"]) for r in linear])
    slopes = recompute_line[1] - pull_line[1]
    paying = [r["blocks"] for r in rows if r["pull_ttft_s"] < r["recompute_ttft_s"]]
    pays_from = next((b for b in paying if all(x in paying for x in
                                                (r["blocks"] for r in rows) if x >= b)), None)
    result = {
        "model": bench.model, "block_size": BLOCK_SIZE, "trials": args.trials, "rows": rows,
        f"pull_line_s_upto_{LINEAR_BLOCKS}_blocks": {
            "fixed": round(pull_line[0], 4), "per_block": round(pull_line[1], 5)},
        f"recompute_line_s_upto_{LINEAR_BLOCKS}_blocks": {
            "fixed": round(recompute_line[0], 4), "per_block": round(recompute_line[1], 5)},
        "break_even_blocks": (round((pull_line[0] - recompute_line[0]) / slopes, 1)
                              if slopes > 0 else None),
        "pull_faster_from_blocks": pays_from,  # measured: at this length and every longer one
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

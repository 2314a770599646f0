"""`pagoda bench startup` (vLLM's `vllm bench startup`): how long `pagoda serve` takes to
a ready cluster and to its first token, cold and warm, and where that time goes.

Each iteration starts `pagoda serve` (every service, as `make run` does), measures from
the spawn:

- ready: the first `/health` 200 (every service up: the gateway answers 200 only with a
  tokenizer and a replica serving);
- first token: the first streamed token of a one-token completion sent at once after;

and reads the `start-up:` line every service logs when it serves
(`pagoda.services.common.startup_clock`): its phases (imports, engine config, model
load, the wait for the worker and the KV cache, the grammar backend, the server) and
when its process started, relative to the spawn.

Cold iterations run with fresh caches (an empty `PAGODA_CACHE_DIR`, where the CPU
kernels are built, and an empty `TORCHINDUCTOR_CACHE_DIR`), as vLLM's cold runs use a
fresh cache root; warm ones use the machine's caches after `--num-iters-warmup` starts.
Neither can empty the OS page cache (that needs root), so "cold" still reads the
weights from memory when an earlier run read them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import tempfile
import time

import httpx

from pagoda.services.bench.serve_child import ServeChild
from pagoda.services.common.startup_clock import parse_report

# "[gpu-worker] 2026-... INFO ... start-up: ..." -> the service's name in brackets;
# "pagoda serve: start-up: ..." -> the supervisor itself.
_SERVICE_RE = re.compile(r"^(\[(?P<service>[\w-]+)\]|(?P<supervisor>pagoda serve):)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "startup", help="Time from `pagoda serve` to a ready cluster and a first token.",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="Model to serve (default: SmolLM2-135M-Instruct).")
    parser.add_argument("--num-iters-cold", type=int, default=1,
                        help="Cold starts (fresh kernel and compile caches).")
    parser.add_argument("--num-iters-warmup", type=int, default=1,
                        help="Starts before the warm ones, not measured.")
    parser.add_argument("--num-iters-warm", type=int, default=3, help="Warm starts.")
    parser.add_argument("--serve-args", default="",
                        help="More `pagoda serve` flags, one string (e.g. "
                             "'--tokenizer-replicas 1').")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="Seconds one start may take before it counts as failed.")
    parser.add_argument("--output-json", default=None, metavar="PATH",
                        help="Also write every iteration's figures here.")
    parser.add_argument("--verbose", action="store_true", help="Show the clusters' logs.")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if min(args.num_iters_cold, args.num_iters_warmup, args.num_iters_warm) < 0:
        raise SystemExit("iteration counts must not be negative")
    flags = ([args.model] if args.model else []) + shlex.split(args.serve_args)
    results: dict[str, list[dict]] = {"cold": [], "warm": []}
    for i in range(args.num_iters_cold):
        with tempfile.TemporaryDirectory(prefix="pagoda_startup_cold_") as cache:
            env = {"PAGODA_CACHE_DIR": os.path.join(cache, "pagoda"),
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor")}
            results["cold"].append(_report(f"cold {i + 1}", one_start(flags, env, args)))
    for i in range(args.num_iters_warmup):
        _report(f"warm-up {i + 1}", one_start(flags, {}, args))
    for i in range(args.num_iters_warm):
        results["warm"].append(_report(f"warm {i + 1}", one_start(flags, {}, args)))
    print(summary(results))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


def one_start(flags: list[str], env: dict[str, str], args: argparse.Namespace) -> dict:
    """One `pagoda serve` from spawn to its first token, then stopped."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # ServeChild passes this process's environment on
    spawned = time.monotonic()
    try:
        child = ServeChild(flags, timeout=args.timeout, verbose=args.verbose)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        base = child.url.removesuffix("/v1")
        ready = _wait_healthy(base, spawned, args.timeout)
        first_token = _first_token(child.url, spawned)
        services = services_from_log(child.timed_log(), spawned)
    finally:
        child.stop()
    return {"ready_s": ready, "first_token_s": first_token, "services": services}


def _wait_healthy(base: str, spawned: float, timeout: float) -> float:
    # One client: a new one per poll loads the CA bundle each time (~30 ms of CPU, on
    # the cores the cluster starts on).
    with httpx.Client(timeout=5) as client:
        while time.monotonic() - spawned < timeout:
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return time.monotonic() - spawned
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"/health was not 200 within {timeout:g} s")


def _first_token(url: str, spawned: float) -> float:
    model = httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"the first completion failed: {reply.status_code} "
                               f"{reply.read()!r}")
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.monotonic() - spawned
    raise RuntimeError("the first completion streamed no token")


def services_from_log(lines: list[tuple[float, str]], spawned: float) -> dict[str, dict]:
    """Each service's `start-up:` report: its phases, and when its process started and
    when it served, both in seconds after the spawn (several replicas of a kind: the
    last to report, which is the one the cluster waited for)."""
    found: dict[str, dict] = {}
    for arrived, line in lines:
        parsed = parse_report(line)
        service = _SERVICE_RE.match(line)
        if parsed is None or service is None:
            continue
        phases, _what, total = parsed
        kind = service["supervisor"] or re.sub(r"-\d+$", "", service["service"])  # tokenizer-1
        served = arrived - spawned
        if kind not in found or served > found[kind]["served_s"]:
            found[kind] = {"phases": phases, "started_s": max(served - total, 0.0),
                           "served_s": served}
    return found


def _report(label: str, result: dict) -> dict:
    print(f"{label}: ready {result['ready_s']:.2f} s, first token "
          f"{result['first_token_s']:.2f} s", flush=True)
    return result


def summary(results: dict[str, list[dict]]) -> str:
    """The table: ready and first token per kind (median, min, max), then where the
    warm starts' time went per service (median seconds per phase)."""
    lines = ["", "| start | runs | ready s (median, min-max) | first token s (median, min-max) |",
             "|---|---|---|---|"]
    for kind, runs in results.items():
        if not runs:
            continue
        cells = []
        for key in ("ready_s", "first_token_s"):
            values = [r[key] for r in runs]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-"
                         f"{max(values):.2f})")
        lines.append(f"| {kind} | {len(runs)} | {cells[0]} | {cells[1]} |")
    runs = results["warm"] or results["cold"]
    if runs:
        kind = "warm" if results["warm"] else "cold"
        lines += ["", f"Where the time went ({kind} starts, median seconds; started/served: "
                  "after the spawn):", "",
                  "| service | started | phases | served |", "|---|---|---|---|"]
        for service in sorted({s for r in runs for s in r["services"]},
                              key=lambda s: _median(runs, s, "served_s")):
            phases = {}
            for r in runs:
                for name, seconds in r["services"].get(service, {}).get("phases", {}).items():
                    phases.setdefault(name, []).append(seconds)
            text = ", ".join(f"{n} {statistics.median(v):.2f}" for n, v in phases.items())
            lines.append(f"| {service} | {_median(runs, service, 'started_s'):.2f} | {text} | "
                         f"{_median(runs, service, 'served_s'):.2f} |")
    return "\n".join(lines)


def _median(runs: list[dict], service: str, key: str) -> float:
    values = [r["services"][service][key] for r in runs if service in r["services"]]
    return statistics.median(values) if values else float("nan")

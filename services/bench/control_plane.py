"""`pagoda bench control-plane`: can the control plane keep up with a GPU?

For each `--step-ms` it starts `pagoda serve --simulated-device` (every real service:
gateway, tokenizers, scheduler, kv-cache-manager, Redis, routing, streaming,
detokenizing; the worker's step only sleeps, `pagoda.executor.simulated`), then for
each `--concurrency` runs that many streaming clients in a closed loop, and after them
the short-request load (16 in / 16 out). One table row per (step, concurrency):

- tok/s and % of ideal: output tokens the clients received per second in the window,
  against concurrency / step time (every stream gets one token per step);
- batch: the mean requests per simulated step in the window;
- idle p50/p99: the worker's gap between one step's end and the next one's start (the
  device's record file, `record_path`);
- sched ms/step: the scheduler process's CPU (psutil, user + system) per step, every
  thread; engine ms/step: its engine-loop thread's alone (the step's planning and
  bookkeeping, and sending it to the worker; the rest is the event loop's streams,
  gRPC's threads, the call-completion thread the engine loop started ("engine-loop's
  threads": it decodes the worker's replies), the KV-event publisher:
  `scheduler_threads_ms_per_step` in the JSON, by thread name);
- gw us/tok: the gateway's CPU (its API servers included) per streamed token;
- ITL+ p50/p99: the clients' inter-token latency minus the step time;
- short req/s: short requests completed per second (16 in / 16 out, ignore_eos), once
  the cluster has dropped the cancelled streams (`drain_after_cancel_s` in the JSON);
- client cores: this process's CPU seconds per second during the streaming window.

The cluster runs with `--async-scheduling` (a CUDA device's default, not the CPU's), unless
`--no-async-scheduling`.

Every process shares one machine with the clients, so the figures are a lower bound of
what the control plane does on a machine of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from pagoda.bench.stats import percentile
from pagoda.services.bench.control_plane_load import (CLIENTS, idle_gaps, read_steps, run_window,
                                                     wait_idle)
from pagoda.services.bench.serve_child import (ServeChild, ThreadSamples, cpu_seconds,
                                               thread_cpu_samples, thread_cpu_seconds)


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "control-plane", help="The served control plane at GPU step rates (simulated device).",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="Model folder or file for the tokenizer and config (its weights "
                             "are not loaded; default: SmolLM2-135M-Instruct).")
    parser.add_argument("--step-ms", type=_floats, default=[50.0, 25.0, 15.0],
                        help="Simulated step times, comma-separated (default 50,25,15).")
    parser.add_argument("--per-token-ms", type=float, default=0.0,
                        help="Added to each step per scheduled token (default 0).")
    parser.add_argument("--concurrency", type=_ints, default=[64, 128, 256],
                        help="Streaming clients, comma-separated (default 64,128,256).")
    parser.add_argument("--duration", type=float, default=20.0,
                        help="Seconds measured per row (streams), after --warmup.")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--client", choices=CLIENTS, default="aiohttp",
                        help="The load client: aiohttp on kept-alive connections (vLLM's "
                             "benchmark client), or httpx with a new connection per request "
                             "(this bench's client before stop 40; its pool stalls with "
                             "hundreds of kept-alive connections).")
    parser.add_argument("--short-duration", type=float, default=None,
                        help="Seconds of the short-request load per row (default: half "
                             "--duration; 0 skips it).")
    parser.add_argument("--input-words", type=int, default=27,
                        help="Words of a streaming prompt (about words + 3 tokens).")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--short-input-words", type=int, default=11,
                        help="Words of a short prompt (about 16 tokens).")
    parser.add_argument("--short-output-len", type=int, default=16)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="Serve with vLLM's --async-scheduling (default: on, as a CUDA "
                             "device is served by default; the simulated device runs on the "
                             "CPU, whose own default is off). --no-async-scheduling measures "
                             "the synchronous loop: one planning gap per step.")
    parser.add_argument("--serve-args", default="",
                        help="More `pagoda serve` flags, one string (e.g. "
                             "'--tokenizer-replicas 1').")
    parser.add_argument("--json", default=None, metavar="PATH", help="Also write the rows here.")
    parser.add_argument("--verbose", action="store_true", help="Show the cluster's log.")
    parser.set_defaults(func=run)
    return parser


def serve_flags(args: argparse.Namespace, step_ms: float, record_path: str) -> list[str]:
    device = {"base_ms": step_ms, "per_token_ms": args.per_token_ms, "record_path": record_path}
    model = ["--model", args.model] if args.model else []
    # No KV tensors exist: blocks for every stream at once, so nothing is preempted.
    blocks = max(args.concurrency) * (-(-(args.input_words + 8 + args.output_len) // 16) + 1) * 2
    # What a GPU deployment runs by default; --serve-args come last and win.
    scheduling = "--async-scheduling" if args.async_scheduling else "--no-async-scheduling"
    return [*model, "--simulated-device", json.dumps(device),
            "--num-gpu-blocks-override", str(max(blocks, 4096)),
            "--max-num-seqs", str(max(args.concurrency)), scheduling,
            *shlex.split(args.serve_args)]


async def measure_row(args, child: ServeChild, model: str, record: str, step_ms: float,
                      concurrency: int) -> dict:
    await wait_idle(record)
    procs = child.service_processes()
    me = psutil.Process()
    t0 = time.time() + args.warmup
    t1 = t0 + args.duration
    cpu: dict[str, dict[str, float]] = {}
    threads_at_t0: ThreadSamples = {}
    threads: dict[str, float] = {}  # the scheduler's threads' CPU in the window, by name

    async def snapshot(at: float, key: str) -> None:
        await asyncio.sleep(max(0.0, at - time.time()))
        cpu[key] = {kind: cpu_seconds(p) for kind, p in procs.items()}
        cpu[key]["client"] = cpu_seconds([me])
        if key == "t0":
            threads_at_t0.update(thread_cpu_samples(procs.get("scheduler", [])))
        else:
            threads.update(thread_cpu_seconds(procs.get("scheduler", []), since=threads_at_t0))

    stats, *_ = await asyncio.gather(
        run_window(child.url, model, concurrency, args.input_words, args.output_len, t0, t1,
                   args.client),
        snapshot(t0, "t0"), snapshot(t1, "t1"))
    # The streams open at t1 were cancelled: how long the cluster takes to drop them.
    drain_s = await wait_idle(record)
    steps = read_steps(record, t0, t1)
    gaps = idle_gaps(steps)
    used = {kind: cpu["t1"][kind] - cpu["t0"].get(kind, 0.0) for kind in cpu["t1"]}
    wall = t1 - t0
    step_s = step_ms / 1000.0
    row = {
        "step_ms": step_ms, "concurrency": concurrency,
        "tok_s": stats.tokens / wall, "ideal_tok_s": concurrency / step_s,
        "steps": len(steps),
        "mean_batch": statistics.fmean(s[3] for s in steps) if steps else 0.0,
        "idle_p50_ms": percentile(gaps, 50) * 1e3 if gaps else None,
        "idle_p99_ms": percentile(gaps, 99) * 1e3 if gaps else None,
        "sched_ms_per_step": used.get("scheduler", 0.0) / len(steps) * 1e3 if steps else None,
        "scheduler_threads_ms_per_step": {
            name: round(seconds / len(steps) * 1e3, 3) for name, seconds in threads.items()}
        if steps else {},
        "gateway_us_per_token": used.get("gateway", 0.0) / stats.tokens * 1e6
        if stats.tokens else None,
        "itl_added_p50_ms": (percentile(stats.itl, 50) - step_s) * 1e3 if stats.itl else None,
        "itl_added_p99_ms": (percentile(stats.itl, 99) - step_s) * 1e3 if stats.itl else None,
        "cores": {kind: round(v / wall, 3) for kind, v in used.items()},
        "drain_after_cancel_s": drain_s,
        "errors": len(stats.errors), "first_error": stats.errors[0] if stats.errors else "",
    }
    row["ratio"] = row["tok_s"] / row["ideal_tok_s"]
    short = args.duration / 2 if args.short_duration is None else args.short_duration
    if short > 0:
        s0 = time.time() + 2.0
        short_stats = await run_window(child.url, model, concurrency, args.short_input_words,
                                       args.short_output_len, s0, s0 + short, args.client)
        row["short_req_s"] = short_stats.requests_done / short
        row["short_prompt_tokens"] = (statistics.fmean(short_stats.prompt_tokens)
                                      if short_stats.prompt_tokens else None)
        row["short_errors"] = len(short_stats.errors)
        await wait_idle(record)
    return row


def _model_name(url: str) -> str:
    return httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    head = ("step ms", "conc", "tok/s", "ideal", "% ideal", "batch", "idle p50/p99 ms",
            "sched ms/step", "engine ms/step", "gw us/tok", "ITL+ p50/p99 ms", "short req/s",
            "client cores", "errors")
    lines = [head]
    for r in rows:
        lines.append((
            _fmt(r["step_ms"], "g"), str(r["concurrency"]), _fmt(r["tok_s"], ".0f"),
            _fmt(r["ideal_tok_s"], ".0f"), _fmt(100 * r["ratio"], ".1f"),
            _fmt(r["mean_batch"], ".1f"),
            f"{_fmt(r['idle_p50_ms'], '.2f')}/{_fmt(r['idle_p99_ms'], '.2f')}",
            _fmt(r["sched_ms_per_step"], ".2f"),
            _fmt(r.get("scheduler_threads_ms_per_step", {}).get("engine-loop"), ".2f"),
            _fmt(r["gateway_us_per_token"], ".0f"),
            f"{_fmt(r['itl_added_p50_ms'], '.1f')}/{_fmt(r['itl_added_p99_ms'], '.1f')}",
            _fmt(r.get("short_req_s"), ".0f"), _fmt(r["cores"].get("client"), ".2f"),
            str(r["errors"] + r.get("short_errors", 0))))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("| " + " | ".join(c.rjust(w) for c, w in zip(line, widths)) + " |"
                     for line in lines)


def run(args: argparse.Namespace) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-cp-") as tmp:
        for step_ms in args.step_ms:
            record = str(Path(tmp) / f"steps-{step_ms:g}.txt")
            print(f"starting pagoda serve --simulated-device base_ms={step_ms:g} ...",
                  file=sys.stderr, flush=True)
            child = ServeChild(serve_flags(args, step_ms, record), verbose=args.verbose)
            try:
                model = _model_name(child.url)
                for concurrency in args.concurrency:
                    row = asyncio.run(measure_row(args, child, model, record, step_ms,
                                                  concurrency))
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                child.stop()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0

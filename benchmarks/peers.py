"""Pagoda and llama.cpp side by side, in one sitting, on the same GGUF (not a pytest file).

    .venv/bin/python benchmarks/peers.py [--rows offline,served,single,prefix] [--out FILE]
    .venv/bin/python benchmarks/peers.py --rows served --pagoda-only   # no llama.cpp build
    make bench-peers

Builds llama.cpp (benchmarks/build_llamacpp.sh, ~6 minutes, once, into --llamacpp-dir),
then runs each row as a pair of commands, one after the other so they never share
the CPU, and prints one JSON object: per row both figures, the ratio (Pagoda / llama.cpp,
or first / second TTFT for the prefix row) and the exact commands.

- offline: `pagoda bench throughput` vs `llama-batched-bench`, total tokens/s.
- served: `pagoda serve` vs `llama-server` (32 slots), each loaded at concurrency 32 by
  benchmarks/loadgen.py (the shared client) and by `pagoda bench serve`; output tokens/s
  and TTFT p50. Both servers get the same prompts (one fresh seed per sitting). Beside
  them, issue 28's served-vs-offline figure: `pagoda bench throughput` capped at the same
  32 sequences (64 prompts, 128 in / 128 out), output tokens/s, run just before
  `pagoda serve` starts, and `ratio_vs_offline_capped` (loadgen's figure over it; the
  target is >= 0.9).
- single: `pagoda bench latency --batch-size 1` vs `llama-bench -p 0 -n 128`. llama-bench's
  tg128 is decode alone; Pagoda's latency includes the 128-token prefill, so its decode
  rate is also derived from a second run with one output token: 127 / (t128 - t1).
- prefix: TTFT of a request with a 2,048-token prefix, then of one sharing that prefix
  (distinct suffix), through each server; ratio first / second.

The machine may be busy: each row records the 1-minute load average before it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import shlex
import subprocess
import sys
import tempfile
import time

from peer_procs import (CommandFailed, batched_bench_row, last_json_line, run_command, server,
                        tree_cpu_seconds)

HERE = pathlib.Path(__file__).resolve().parent
PAGODA = [str(pathlib.Path(sys.executable).parent / "pagoda")]
PY = sys.executable
ROWS = ("offline", "served", "single", "prefix")
PAGODA_PORT, LLAMA_PORT = 18000, 18180


def ensure_llamacpp(root: str) -> pathlib.Path:
    """The llama.cpp bin folder, building it first if missing (the script reuses a build)."""
    out = run_command(["bash", str(HERE / "build_llamacpp.sh"), root], timeout=3600)
    return pathlib.Path(out.strip().splitlines()[-1])


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def offline(bins: pathlib.Path, gguf: str) -> dict:
    ours = [*PAGODA, "bench", "throughput", "--model", gguf, "--input-len", "128",
            "--output-len", "128", "--num-prompts", "64"]
    peer = [str(bins / "llama-batched-bench"), "-m", gguf, "-t", "2", "-tb", "2", "-c", "8192",
            "-b", "2048", "-ub", "512", "-kvu", "-npp", "128", "-ntg", "128", "-npl", "32"]
    pagoda = last_json_line(run_command(ours, 1800))["total_tokens_per_s"]
    llama = batched_bench_row(run_command(peer, 1800), 32)["S t/s"]
    return {"metric": "total tokens/s", "pagoda": pagoda, "llamacpp": llama,
            "ratio": ratio(pagoda, llama), "commands": [shlex.join(ours), shlex.join(peer)]}


def offline_capped(gguf: str) -> tuple[float, str]:
    """The offline engine's output tokens/s on the served row's load (64 prompts of 128 in /
    128 out, at most 32 at once, as the served row's concurrency), and its command."""
    argv = [*PAGODA, "bench", "throughput", "--model", gguf, "--input-len", "128",
            "--output-len", "128", "--num-prompts", "64", "--max-num-seqs", "32"]
    return last_json_line(run_command(argv, 1800))["output_tokens_per_s"], shlex.join(argv)


def served_pair(url: str, model: str, pid: int, gguf: str, seed: int) -> tuple[dict, list[str]]:
    """loadgen.py and `pagoda bench serve` against one running server, 64 requests at 32."""
    loadgen = [PY, str(HERE / "loadgen.py"), "--base-url", url, "--model", model,
               "--endpoint", "completions", "-n", "64", "-c", "32", "--max-tokens", "128",
               "--prompt-tokens", "128", "--ignore-eos", "--seed", str(seed)]
    bench = [*PAGODA, "bench", "serve", "--base-url", url, "--model", model, "--tokenizer", gguf,
             "--num-prompts", "64", "--max-concurrency", "32", "--random-input-len", "128",
             "--random-output-len", "128", "--seed", str(seed)]
    cpu, start = tree_cpu_seconds(pid), time.monotonic()
    lg = last_json_line(run_command(loadgen, 1800))
    if lg["errors"]:
        raise CommandFailed(f"loadgen.py: {lg['errors']} errors, e.g. {lg['error_samples'][:1]}")
    cores = (tree_cpu_seconds(pid) - cpu) / (time.monotonic() - start)
    bs = last_json_line(run_command(bench, 1800))
    figures = {"loadgen_output_tok_s": lg["output_tok_per_s"], "loadgen_ttft_p50_ms": lg["ttft_ms_p50"],
               "loadgen_errors": lg["errors"], "server_cpu_cores_used_loadgen": round(cores, 2),
               "bench_serve_output_tok_s": bs["output_throughput"],
               "bench_serve_ttft_p50_ms": bs["median_ttft_ms"], "bench_serve_failed": bs["failed"]}
    return figures, [shlex.join(loadgen), shlex.join(bench)]


def prefix_ttfts(url: str, model: str, gguf: str, seed: int) -> dict:
    """TTFT (ms) of a 2,048-token-prefix request, then of a second one sharing the prefix."""
    import httpx

    from pagoda.services.bench.datasets import BenchRequest, random_requests
    from pagoda.services.bench.stream import request_body, send_request
    from pagoda.tokenizer.loader import load_tokenizer

    # A warm-up of its own prefix first, so neither measured request pays for a cold server.
    warm, prefix = (r.prompt for r in random_requests(load_tokenizer(None, gguf), 2, 2048, 4, seed))

    async def both() -> list[float]:
        ttfts = []
        async with httpx.AsyncClient(timeout=600) as client:
            for text in (warm, prefix + " First question: what comes next?",
                         prefix + " Second question: why?"):
                request = BenchRequest(text, [], 4)
                body = request_body("openai", model, request, "text", True, 0.0, 0)
                result = await send_request(client, f"{url}/v1/completions", body, request)
                if not result.ok:
                    raise CommandFailed(f"prefix request failed: {result.error}")
                ttfts.append(round(result.ttft * 1000, 1))
        return ttfts[1:]

    first, second = asyncio.run(both())
    return {"ttft_first_ms": first, "ttft_second_ms": second, "ratio": ratio(first, second)}


def served_and_prefix(bins: pathlib.Path | None, gguf: str, seed: int, logs: str,
                      rows: set[str]) -> dict:
    """Each server started once: the served row's load, then the prefix row's two requests.
    `bins` None: Pagoda's side only (no llama-server, no ratio to it)."""
    servers = {
        "pagoda": ([*PAGODA, "serve", gguf, "--host", "127.0.0.1", "--port", str(PAGODA_PORT)],
                   f"http://127.0.0.1:{PAGODA_PORT}"),
    }
    if bins is not None:
        servers["llamacpp"] = (
            [str(bins / "llama-server"), "-m", gguf, "-a", "smollm2", "--host", "127.0.0.1",
             "--port", str(LLAMA_PORT), "-c", "131072", "-np", "32", "--kv-unified",
             "-t", "2", "-tb", "2"], f"http://127.0.0.1:{LLAMA_PORT}")
    out: dict = {}
    if "served" in rows:
        load = loadavg()
        figure, command = offline_capped(gguf)
        out["served"] = {"metric": "output tokens/s at concurrency 32", "commands": {},
                         "offline_capped": {"output_tok_s": figure, "command": command,
                                            "loadavg_1m_before": load}}
    for name, (argv, url) in servers.items():
        with server(argv, url, os.path.join(logs, f"{name}-server.log"), timeout=900) as (model, pid):
            if "served" in rows:
                load = loadavg()
                figures, commands = served_pair(url, model, pid, gguf, seed)
                out["served"][name] = {**figures, "loadavg_1m_before": load}
                out["served"]["commands"][name] = [shlex.join(argv), *commands]
            if "prefix" in rows:
                out.setdefault("prefix", {"metric": "TTFT first / second, 2,048-token shared prefix",
                                          "commands": {}})
                out["prefix"][name] = {**prefix_ttfts(url, model, gguf, seed + 7),
                                       "loadavg_1m_before": loadavg()}
                out["prefix"]["commands"][name] = (
                    f"{shlex.join(argv)}; then two streamed POST {url}/v1/completions "
                    "(random 2,048-token text prefix + distinct suffix, max_tokens 4, logprobs 0)")
    if "served" in out:
        s = out["served"]
        s["ratio_vs_offline_capped"] = ratio(s["pagoda"]["loadgen_output_tok_s"],
                                             s["offline_capped"]["output_tok_s"])
        if "llamacpp" in s:
            s["ratio_loadgen"] = ratio(s["pagoda"]["loadgen_output_tok_s"],
                                       s["llamacpp"]["loadgen_output_tok_s"])
            s["ratio_bench_serve"] = ratio(s["pagoda"]["bench_serve_output_tok_s"],
                                           s["llamacpp"]["bench_serve_output_tok_s"])
    if "prefix" in out:
        out["prefix"]["ratio"] = out["prefix"]["pagoda"]["ratio"]
    return out


def single(bins: pathlib.Path, gguf: str, tmp: str) -> dict:
    def ours(output_len: int) -> tuple[dict, list[str]]:
        path = os.path.join(tmp, f"latency-{output_len}.json")
        argv = [*PAGODA, "bench", "latency", "--model", gguf, "--batch-size", "1", "--input-len",
                "128", "--output-len", str(output_len), "--num-iters-warmup", "1",
                "--num-iters", "5", "--output-json", path]
        run_command(argv, 1800)
        return json.loads(pathlib.Path(path).read_text()), argv

    full, argv_full = ours(128)
    prefill, argv_prefill = ours(1)
    peer = [str(bins / "llama-bench"), "-m", gguf, "-t", "2", "-p", "0", "-n", "128", "-o", "json"]
    llama = json.loads(run_command(peer, 1800))[0]["avg_ts"]
    decode = 127 / (full["avg_latency"] - prefill["avg_latency"])
    return {"metric": "single-stream tokens/s (128 out)",
            "pagoda": {"decode_tok_s": round(decode, 2),
                       "end_to_end_tok_s": round(128 / full["avg_latency"], 2),
                       "avg_latency_s": round(full["avg_latency"], 3),
                       "prefill_128_latency_s": round(prefill["avg_latency"], 3)},
            "llamacpp": round(llama, 2), "ratio": ratio(decode, llama),
            "commands": [shlex.join(argv_full), shlex.join(argv_prefill), shlex.join(peer)]}


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"Comma-separated, of {ROWS}.")
    parser.add_argument("--gguf", default=None, help="Default: Pagoda's default model.")
    parser.add_argument("--llamacpp-dir", default=os.path.expanduser("~/.cache/pagoda/llamacpp"))
    parser.add_argument("--seed", type=int, default=None, help="Prompts' seed (default: fresh).")
    parser.add_argument("--out", default=None, help="Also write the JSON object here.")
    parser.add_argument("--pagoda-only", action="store_true",
                        help="No llama.cpp (nothing built): the served and prefix rows' Pagoda "
                             "side, with the served row's ratio_vs_offline_capped.")
    args = parser.parse_args()
    rows = set(args.rows.split(","))
    if not rows <= set(ROWS):
        parser.error(f"--rows: unknown {sorted(rows - set(ROWS))}")
    if args.pagoda_only and rows & {"offline", "single"}:
        parser.error("--pagoda-only: only the served and prefix rows have a Pagoda side alone")
    if args.gguf is None:
        from pagoda.model.loader import default_model_path

        args.gguf = default_model_path()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**30)
    bins = None if args.pagoda_only else ensure_llamacpp(args.llamacpp_dir)
    result: dict = {"gguf": args.gguf, "seed": seed, "cpus": os.cpu_count(),
                    "note": "measured side by side in one sitting; a shared machine's load "
                            "makes absolute figures noisy (see each row's loadavg_1m_before)",
                    "rows": {}}
    tmp = tempfile.mkdtemp(prefix="pagoda-peers-")  # kept: the servers' logs
    result["logs"] = tmp
    if "offline" in rows:
        load = loadavg()
        result["rows"]["offline"] = {**offline(bins, args.gguf), "loadavg_1m_before": load}
    if rows & {"served", "prefix"}:
        result["rows"].update(served_and_prefix(bins, args.gguf, seed, tmp, rows))
    if "single" in rows:
        load = loadavg()
        result["rows"]["single"] = {**single(bins, args.gguf, tmp), "loadavg_1m_before": load}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (CommandFailed, subprocess.SubprocessError) as exc:
        print(f"peers.py: {exc}", file=sys.stderr)
        sys.exit(1)

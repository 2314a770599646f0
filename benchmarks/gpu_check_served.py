"""The "served" section of benchmarks/gpu_check.py: the whole cluster on the GPU.

`pagoda serve` (gateway, tokenizer, scheduler, kv-cache-manager, gpu-worker, a private
Redis) serves a Llama-shaped model with random weights from a temporary folder, and N
streaming clients in a closed loop (`pagoda bench control-plane`'s load) measure output
tok/s at each concurrency for a fixed window. Each row sets the served figure beside:

- the offline decode figure at the same batch (the throughput section's, CUDA graphs,
  no scheduler): what the control plane costs on a real device;
- the HBM roofline (weights + KV bytes per step over the measured copy bandwidth);
- the simulated-device curve: `pagoda serve --simulated-device` with the step time the
  offline loop measured at that batch, on the same machine: what the control plane alone
  delivers at that step rate.

Every prompt is the same words ("Request N: hello hello ..." under a word tokenizer where
each is one token), so prompts share their prefix; the timed window is decode-dominated.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import tempfile
import time
from pathlib import Path

import torch

import gpu_harness as h

WINDOW_S = 8.0  # timed window per concurrency, after a warm-up of WARMUP_S
WARMUP_S = 3.0
PROMPT_WORDS, MAX_TOKENS = 120, 128


def _write_model(folder: Path, spec_name: str, device, small: bool) -> None:
    from gpu_check_sections import _write_word_tokenizer

    spec = h.MODEL_SPECS[spec_name]
    hf = h.build_hf_model(spec, torch.bfloat16, device)
    hf.config.eos_token_id = 2  # the tokenizer's eos; clients send ignore_eos
    hf.save_pretrained(folder)
    # The clients' prompts are "Request N: hello hello ...". With "hello" a word of its
    # own, a tied-embedding random model's greedy answer repeats it (text in every
    # chunk); were it unk (= pad, a special token), the answer would be textless and
    # the stream would carry no chunk until the last, leaving ITL unmeasured.
    _write_word_tokenizer(str(folder), spec["vocab_size"], words=("hello", "Request"))
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _window(base_url: str, concurrency: int) -> dict:
    from pagoda.services.bench.control_plane_load import run_window

    t0 = time.time() + WARMUP_S
    stats = asyncio.run(run_window(base_url, "served", concurrency, PROMPT_WORDS, MAX_TOKENS,
                                   t0, t0 + WINDOW_S))
    itl = sorted(stats.itl)
    return dict(tok_s=stats.tokens / WINDOW_S, requests=stats.requests_done,
                errors=len(stats.errors), error_sample=stats.errors[:2],
                itl_p50_ms=1000 * itl[len(itl) // 2] if itl else None)


def _serve(flags: list[str]):
    from pagoda.services.bench.serve_child import ServeChild

    return ServeChild(flags, timeout=300.0)


def _save_log(child, log_path: Path | None, title: str) -> None:
    if log_path is None:
        return
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(f"===== {title}\n")
        f.writelines(list(child.log))


def check_served(report, device, args, deadline: float, small: bool, offline: dict) -> None:
    """`offline`: batch -> (offline decode tok/s, roofline tok/s) from the throughput
    section, for the served model; missing entries leave those columns empty. One
    cluster per `--served-flags` variant (default: one with no extra flags)."""
    spec_name = "tiny" if small else args.served_model
    concurrencies = [1, 4] if small else [int(c) for c in args.served_concurrency.split(",")]
    log_path = Path(args.served_log) if args.served_log else None
    folder = Path(tempfile.mkdtemp(prefix="pagoda-served-"))
    try:
        try:
            _write_model(folder, spec_name, device, small)
        except Exception as exc:  # noqa: BLE001
            report.error("served", "write_model", exc)
            return
        for extra in args.served_flags or [""]:
            rows = _variant(report, device, deadline, small, folder, spec_name, concurrencies,
                            shlex.split(extra), log_path)
            _simulated_curve(report, rows, offline, deadline, folder, log_path, shlex.split(extra))
            for row in rows:
                off = offline.get(row["batch"], (None, None))
                row["offline"], row["roofline"] = off
                if off[0]:
                    row["served_vs_offline"] = row["served"] / off[0]
                row["flags"] = extra
                report.served.append(row)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _variant(report, device, deadline, small, folder, spec_name, concurrencies, extra,
             log_path) -> list[dict]:
    """One served cluster with `extra` flags: a row per concurrency."""
    label = f"{spec_name}{'[' + ' '.join(extra) + ']' if extra else ''}"
    flags = [str(folder), "--served-model-name", "served", "--dtype", "bfloat16",
             "--device", device.type, "--max-model-len", "1024",
             "--max-num-seqs", str(max(concurrencies)), *extra]
    if small:
        flags += ["--num-gpu-blocks-override", "256"]
    rows: list[dict] = []
    if time.monotonic() + 60 > deadline:
        report.skip("served", label, "time budget spent")
        return rows
    started = time.monotonic()
    try:
        child = _serve(flags)
    except Exception as exc:  # noqa: BLE001
        report.error("served", f"{label}/start", exc)
        return rows
    report.check("served", f"{label}/start_s", time.monotonic() - started, "-", None,
                 "pagoda serve to its URL (weights, cache, graphs)")
    try:
        for c in concurrencies:
            if time.monotonic() + WINDOW_S + WARMUP_S + 10 > deadline:
                report.skip("served", f"{label}/c{c}", "time budget spent")
                continue
            try:
                got = _window(child.url, c)
            except Exception as exc:  # noqa: BLE001
                report.error("served", f"{label}/c{c}", exc)
                continue
            ok = got["errors"] == 0 and got["tok_s"] > 0
            report.check("served", f"{label}/c{c}_tok_s", got["tok_s"], "-", None if ok else False,
                         f"{got['requests']} requests done, itl p50 {got['itl_p50_ms']} ms, "
                         f"{got['errors']} errors {got['error_sample']}")
            rows.append(dict(batch=c, served=got["tok_s"], itl_p50_ms=got["itl_p50_ms"]))
    finally:
        child.stop()
        _save_log(child, log_path, f"serve {label}")
    return rows


def _simulated_curve(report, rows, offline, deadline, folder, log_path, extra) -> None:
    """The control plane alone at the offline loop's step time, per concurrency, with
    the variant's `extra` flags."""
    for row in rows:
        batch = row["batch"]
        offline_tok_s = offline.get(batch, (None, None))[0]
        if not offline_tok_s or batch < 16:
            continue
        if time.monotonic() + WINDOW_S + WARMUP_S + 40 > deadline:
            report.skip("served", f"simulated/c{batch}", "time budget spent")
            continue
        step_ms = 1000.0 * batch / offline_tok_s
        flags = [str(folder), "--served-model-name", "served", "--max-model-len", "1024",
                 "--max-num-seqs", str(batch),
                 "--simulated-device", json.dumps({"base_ms": round(step_ms, 3)}), *extra]
        label = f"simulated{'[' + ' '.join(extra) + ']' if extra else ''}/c{batch}"
        try:
            child = _serve(flags)
            try:
                got = _window(child.url, batch)
            finally:
                child.stop()
                _save_log(child, log_path, label)
            row["simulated"] = got["tok_s"]
            report.check("served", f"{label}_tok_s", got["tok_s"], "-", None,
                         f"step {step_ms:.2f} ms (offline), ideal {batch / step_ms * 1000:.0f} tok/s, "
                         f"itl p50 {got['itl_p50_ms']} ms, {got['errors']} errors")
        except Exception as exc:  # noqa: BLE001
            report.error("served", label, exc)


def print_served(rows: list[dict]) -> None:
    if not rows:
        return
    print("\nServed (pagoda serve, closed-loop streaming clients) vs offline decode, roofline and "
          "the simulated device at the offline step time (tokens/s)")
    head = ["batch", "served", "offline", "served/off", "roofline", "simulated", "itl p50 ms"]
    print("".join(f"{x:>13}" for x in head) + "  flags")
    for r in rows:
        cells = [r["batch"], r.get("served"), r.get("offline"), r.get("served_vs_offline"),
                 r.get("roofline"), r.get("simulated"), r.get("itl_p50_ms")]
        print("".join(f"{c:>13.2f}" if isinstance(c, float) else f"{str(c or '-'):>13}" for c in cells)
              + f"  {r.get('flags') or '-'}")

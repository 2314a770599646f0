#!/usr/bin/env python3
"""Device check of the CUDA path, in one run of a few minutes on one GPU.

    python3 benchmarks/gpu_check.py                 # everything, 1B and (if time) 8B
    python3 benchmarks/gpu_check.py --models 1b --json $OUT/gpu_check.json

1. kernels: every Triton kernel against its torch reference (`pagoda.kernels.reference`)
   on random inputs, relative error max|a-e|/max|e| under a per-dtype threshold,
   attention also with gpt-oss's sinks and window and DeepSeek's MLA shape
   (`gpu_check_families.py`);
   paths: quantized GEMMs, fused MoE, LoRA, fp8 KV cache, xgrammar mask, the KV
   connector's pair group, the host KV tier (`gpu_check_paths.py`);
2. greedy: a small random-weight Llama, pagoda (Triton kernels, chunked prefill mixed
   with decodes, CUDA graphs) against HF transformers `generate`, token for token in
   fp32; bf16 agreement reported; then `pagoda.LLM` end to end when it imports, also
   for tiny random gpt-oss and DeepSeek-V3;
3. throughput: decode tokens/s at batch 1/16/64/256 of a ~1B (and 8B) Llama with
   random weights: pagoda with CUDA graphs, pagoda eager, HF generate at the same
   batch, and the HBM roofline (weights + KV bytes per step over measured copy
   bandwidth).
4. served: `pagoda serve` (every service, private Redis) on the GPU with the 1B model,
   closed-loop streaming clients at concurrency 1/64/256, beside the offline figure,
   the roofline and `--simulated-device` at the offline step time (gpu_check_served.py).

Prints the tables last; exit status 0 only if every check passed (2: no GPU).
Kernels, paths, greedy and throughput need torch, triton, transformers and run from a
plain checkout (no install, no network); `pagoda.LLM` also needs `gguf`, and the served
section the whole install (grpcio, fastapi, a Redis server, ...): on a bare CUDA machine
`bash benchmarks/gpu_device_run.sh` installs the wheels `benchmarks/fetch_gpu_wheels.sh`
gathered, then runs this. Served variants: `--served-flags=--async-scheduling`, repeated
for several (e.g. with `--api-server-count 4`).
`--allow-cpu` smoke-runs the same code on the CPU with tiny shapes through the
Triton interpreter, to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def map_subpackage(name: str) -> None:
    """Make `pagoda.<name>` importable from ROOT/<name> where no install maps it (a plain
    checkout: setup.py maps kernels/ and services/ under `pagoda`)."""
    full = f"pagoda.{name}"
    if importlib.util.find_spec(full) is not None:
        return
    import pagoda

    spec = importlib.util.spec_from_file_location(
        full, ROOT / name / "__init__.py", submodule_search_locations=[str(ROOT / name)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    setattr(pagoda, name, module)


def bootstrap_imports() -> None:
    """Make `pagoda` and `pagoda.kernels` importable from a plain checkout."""
    if importlib.util.find_spec("pagoda") is None:
        sys.path.insert(0, str(ROOT / "libs"))
    map_subpackage("kernels")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="kernels,paths,greedy,throughput,served",
                   help="comma-separated subset of kernels,paths,greedy,throughput,served")
    p.add_argument("--models", default="1b,8b", help="throughput models: 1b, 8b (8b only if time allows)")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=128, help="context before timed decode steps")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per measurement")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget; later sections are skipped to stay inside it")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate timings")
    p.add_argument("--no-eager", action="store_true", help="skip the eager (no graphs) timings")
    p.add_argument("--paths-cases", default="",
                   help="comma-separated cases of the paths section (default: all)")
    p.add_argument("--served-flags", action="append", default=None,
                   help="extra `pagoda serve` flags for one served variant, e.g. "
                        "'--api-server-count 4'; repeat for several variants (default: one, none)")
    p.add_argument("--served-model", default="1b", help="the served section's model (1b, 8b)")
    p.add_argument("--served-concurrency", default="1,64,256")
    p.add_argument("--served-offline", default="",
                   help="BATCH:TOK_S,... offline decode figures for the served table when the "
                        "throughput section does not run (e.g. from an earlier run on the same "
                        "kind of device); the roofline column stays empty then")
    p.add_argument("--served-log", default=None, help="append the served clusters' logs here")
    p.add_argument("--json", default=None, help="also write all results to this file")
    p.add_argument("--allow-cpu", action="store_true",
                   help="smoke-run on CPU (tiny shapes, Triton interpreter); numbers are meaningless")
    return p.parse_args(argv)


class Report:
    """Correctness rows (PASS/FAIL/SKIP/INFO) and throughput rows, printed last."""

    def __init__(self, json_path: str | None = None) -> None:
        self.checks: list[dict] = []
        self.throughput: list[dict] = []
        self.served: list[dict] = []
        self.notes: list[str] = []
        self.environment: dict = {}
        self.json_path = json_path

    def check(self, section: str, name: str, value, limit, ok: bool | None, detail: str = "") -> None:
        status = "INFO" if ok is None else ("PASS" if ok else "FAIL")
        self.checks.append(dict(section=section, name=name, value=value, limit=limit, status=status,
                                detail=detail))
        print(f"[{status}] {section}/{name}: {value} (limit {limit}) {detail}", flush=True)

    def skip(self, section: str, name: str, why: str) -> None:
        self.checks.append(dict(section=section, name=name, value="", limit="", status="SKIP", detail=why))
        print(f"[SKIP] {section}/{name}: {why}", flush=True)

    def error(self, section: str, name: str, exc: BaseException) -> None:
        detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
        traceback.print_exc()
        self.checks.append(dict(section=section, name=name, value="", limit="", status="FAIL", detail=detail))

    @property
    def failed(self) -> bool:
        return any(c["status"] == "FAIL" for c in self.checks)

    def print_tables(self) -> None:
        print("\n" + "=" * 100)
        print(f"{'status':6} {'check':52} {'value':>12} {'limit':>10}  detail")
        for c in self.checks:
            value = f"{c['value']:.3g}" if isinstance(c["value"], float) else str(c["value"])
            print(f"{c['status']:6} {c['section'] + '/' + c['name']:52} {value:>12} {str(c['limit']):>10}  "
                  f"{c['detail']}")
        if self.throughput:
            print("\nDecode throughput (tokens/s; roofline = weights + KV bytes per step / copy bandwidth)")
            head = ["model", "batch", "pagoda+graphs", "pagoda eager", "HF generate", "roofline",
                    "% roofline", "x HF"]
            print("".join(f"{h:>15}" for h in head))
            for r in self.throughput:
                cells = [r["model"], r["batch"], r.get("graphs"), r.get("eager"), r.get("hf"),
                         r.get("roofline"), r.get("pct_roofline"), r.get("speedup_vs_hf")]
                print("".join(f"{c:>15.1f}" if isinstance(c, float) else f"{str(c or '-'):>15}"
                              for c in cells))
        from gpu_check_served import print_served  # benchmarks/ is on sys.path (main)

        print_served(self.served)
        for note in self.notes:
            print("note:", note)
        print("RESULT:", "FAIL" if self.failed else "PASS", flush=True)

    def finish(self) -> None:
        """Print the tables (last thing on stdout) and write the JSON file, if asked."""
        self.print_tables()
        if self.json_path:
            with open(self.json_path, "w", encoding="utf-8") as f:
                json.dump(dict(environment=self.environment, checks=self.checks,
                               throughput=self.throughput, served=self.served, notes=self.notes, failed=self.failed),
                          f, indent=1, default=str)


def install_watchdogs(report: Report, budget_s: float) -> None:
    """Past the budget, print what was measured and exit; if the process is stuck in
    C code (a hung kernel or sync), dump every thread's stack and exit anyway."""

    def on_alarm(signum, frame):
        report.check("run", "watchdog", f"{budget_s + 30:.0f}s", f"{budget_s:.0f}s", False,
                     "still running past the budget: stopped, later checks did not run")
        report.finish()
        os._exit(3)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(budget_s + 30))
    faulthandler.dump_traceback_later(budget_s + 60, exit=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False). This script checks "
              "the GPU path; run it on a machine with an NVIDIA GPU, or pass --allow-cpu for a "
              "CPU smoke run of the script itself.", file=sys.stderr)
        return 2
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    bootstrap_imports()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pagoda.model import ops  # the switch every model layer calls

    if on_cpu:
        from pagoda.kernels.testing import patch_triton_interpreter

        patch_triton_interpreter()
        ops.use_triton = lambda t: True  # run the kernels (interpreted) as CUDA would
    import gpu_check_families as check_families
    import gpu_check_sections as check_sections

    with contextlib.suppress(Exception):
        import transformers

        transformers.logging.set_verbosity_error()  # generate()'s flag warnings drown the report
    device = torch.device("cpu" if on_cpu else "cuda")
    report = Report(args.json)
    deadline = time.monotonic() + args.budget_s
    install_watchdogs(report, args.budget_s)
    report.environment = check_sections.describe_environment(device)
    print("environment:", json.dumps(report.environment), flush=True)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if "kernels" in sections:
        check_sections.check_kernels(report, device, small=on_cpu)
        check_families.check_family_kernels(report, device, small=on_cpu)
    if "paths" in sections:  # quantized GEMMs, MoE, LoRA, fp8 KV, xgrammar, KV pair, host tier
        from gpu_check_paths import check_paths

        only = {c.strip() for c in args.paths_cases.split(",") if c.strip()} or None
        check_paths(report, device, on_cpu, only)
    if "greedy" in sections:
        check_sections.check_greedy(report, device, small=on_cpu)
        check_families.check_family_greedy(report, device, small=on_cpu)
    if "throughput" in sections:
        check_sections.check_throughput(report, device, args, deadline, small=on_cpu)
    if "served" in sections:
        from gpu_check_served import check_served

        served_model = "tiny" if on_cpu else args.served_model
        offline = {int(b): (float(t), None) for b, t in
                   (pair.split(":") for pair in args.served_offline.split(",") if pair)}
        offline.update({r["batch"]: (r.get("graphs") or r.get("eager"), r.get("roofline"))
                        for r in report.throughput if r["model"] == served_model})
        check_served(report, device, args, deadline, small=on_cpu, offline=offline)
    signal.alarm(0)
    faulthandler.cancel_dump_traceback_later()
    report.finish()
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())

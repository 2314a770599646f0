"""Per-step cost of a worker group against one device, and where it goes (not a pytest file).

    .venv/bin/python benchmarks/bench_tp_overhead.py [--model DIR] [--batch 8]
        [--steps 200] [--splits 1x1,2x1,1x2] [--backend mp]

Runs decode steps (every request one token per step) of a tiny Llama through the
offline engine, one device and each T x P split, and reports the median step time.
For a group, rank 0 runs in this process, so its time is split by wrapping the
functions it calls: the plan broadcast, the all-reduces and logits gathers inside
the layers (time spent in a collective includes waiting for the slower rank), the
result's trip from the last stage, and the rest (rank 0's own compute and the
engine's Python). Without --model, a tiny random model is built from
tests/fixtures/tiny_llama/config.json.
"""

from __future__ import annotations

import argparse
import collections
import functools
import pathlib
import statistics
import tempfile
import time

FIXTURE = pathlib.Path(__file__).parents[1] / "tests" / "fixtures" / "tiny_llama" / "config.json"


def build_tiny_model(out: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_json_file(str(FIXTURE))).save_pretrained(out)
    from pagoda.model.loader import default_model_path
    from pagoda.tokenizer.loader import load_tokenizer

    load_tokenizer(default_model_path()).save_pretrained(out)
    return out


class Timers:
    """Wraps module functions and accumulates (calls, seconds) per label, per step."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def wrap(self, module, name: str, label: str) -> None:
        original = getattr(module, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                entry = self.totals[label]
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        setattr(module, name, timed)

    def take(self) -> dict[str, tuple[int, float]]:
        snapshot = {k: (int(v[0]), v[1]) for k, v in self.totals.items()}
        self.totals.clear()
        return snapshot


def install_timers() -> Timers:
    from pagoda.worker import rank_worker
    from pagoda.executor import group
    from pagoda.model import parallel_layers

    timers = Timers()
    timers.wrap(group, "broadcast_object", "plan broadcast")
    timers.wrap(parallel_layers, "all_reduce", "all-reduce")
    timers.wrap(parallel_layers, "gather", "logits gather")
    timers.wrap(rank_worker, "recv_object", "result from last stage")
    return timers


def run_split(model: str, tp: int, pp: int, backend: str, batch: int, steps: int,
              timers: Timers) -> tuple[list[float], dict[str, float]]:
    from pagoda import SamplingParams
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, dtype="float32", tensor_parallel_size=tp,
                                  pipeline_parallel_size=pp, distributed_executor_backend=backend,
                                  num_gpu_blocks_override=4096, max_model_len=1024))
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, [5 + i, 17, 300, 42], params)
    engine.step()  # the prefill
    engine.step()
    timers.take()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    parts = {label: seconds / steps for label, (_, seconds) in timers.take().items()}
    engine.core.shutdown()
    return times, parts


def raw_collective_latency(hidden: int, batch: int, iters: int = 500) -> None:
    """The floor: one all-reduce of a decode step's activations between two idle processes."""
    import subprocess
    import sys

    from pagoda.distributed.process_group import create_master_store

    store = create_master_store("127.0.0.1", 3, 60)
    procs = [subprocess.Popen([sys.executable, __file__, "--raw-rank", str(r), "--raw-port",
                               str(store.port), "--raw-shape", f"{batch}x{hidden}",
                               "--raw-iters", str(iters)]) for r in range(2)]
    for p in procs:
        p.wait()
    print(f"raw gloo all-reduce of [{batch}, {hidden}] fp32 between 2 processes: "
          f"{float(store.get('raw/0')):.1f} us; 16 KiB control broadcast "
          f"{float(store.get('raw/bcast')):.1f} us")


def _raw_rank(rank: int, port: int, shape: str, iters: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from pagoda.distributed.communication import all_reduce

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2,
                                  datetime.timedelta(seconds=60))
    x = torch.ones(*(int(n) for n in shape.split("x")))
    frame = torch.zeros(16 * 1024, dtype=torch.uint8)
    for _ in range(20):
        all_reduce(x, group)
    start = time.perf_counter()
    for _ in range(iters):
        all_reduce(x, group)
    reduce_us = (time.perf_counter() - start) / iters * 1e6
    start = time.perf_counter()
    for _ in range(iters):
        group.broadcast([frame]).wait()
    if rank == 0:
        store.set("raw/0", str(reduce_us))
        store.set("raw/bcast", str((time.perf_counter() - start) / iters * 1e6))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--splits", default="1x1,2x1,1x2")
    parser.add_argument("--backend", default="mp", choices=["mp", "ray"])
    parser.add_argument("--raw-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--raw-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--raw-shape", default="", help=argparse.SUPPRESS)
    parser.add_argument("--raw-iters", type=int, default=500, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_rank is not None:
        return _raw_rank(args.raw_rank, args.raw_port, args.raw_shape, args.raw_iters)
    model = args.model or build_tiny_model(tempfile.mkdtemp(prefix="tiny_llama_"))
    timers = install_timers()
    import json

    hidden = json.loads(pathlib.Path(model, "config.json").read_text())["hidden_size"]
    raw_collective_latency(hidden, args.batch)
    baseline = None
    print(f"decode steps of {args.batch} requests, {args.steps} steps, backend {args.backend}")
    for split in args.splits.split(","):
        tp, pp = (int(x) for x in split.split("x"))
        times, parts = run_split(model, tp, pp, args.backend, args.batch, args.steps, timers)
        median = statistics.median(times) * 1e3
        baseline = baseline if baseline is not None else median
        line = f"T={tp} P={pp}: median step {median:.2f} ms ({median - baseline:+.2f} ms vs first)"
        if parts:
            accounted = sum(parts.values()) * 1e3
            detail = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(parts.items()))
            rest = statistics.mean(times) * 1e3 - accounted
            line += f"\n    rank 0 per step (ms, mean): {detail}; rest {rest:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()

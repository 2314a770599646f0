"""Structured outputs: grammar compile time (cold and cached) and the per-step cost of
the bitmask, on SmolLM2's 49,152-token vocabulary (not a pytest file).

    .venv/bin/python benchmarks/bench_structured_outputs.py [--repeats 200] [--threads 1]

* compile: the scheduler's path for a new constraint (`init_request`: xgrammar's parse on
  the engine thread, then compilation on the pool) until the grammar is ready; "cached"
  is the same constraint again (a hash and a dict lookup, no compile);
* bitmask (scheduler): `grammar_bitmask` for B constrained rows that sample this step,
  matchers spread over a JSON answer (row i stopped after its first i tokens:
  inside keys, strings, numbers, arrays; xgrammar's batch fill for B > 1);
* advance (scheduler): one accepted token through a matcher;
* apply (worker): the packed bitmask onto [B, 49152] float32 logits (torch, CPU).
Each is the median wall time over `--repeats` runs (compile: over 5 distinct schemas).
`--threads` sets torch's threads (default 1: on a shared CPU, torch's parallel kernels
spin against other processes and the apply row then measures the contention).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from pagoda.config import StructuredOutputsConfig
from pagoda.sample.grammar import apply_grammar_bitmask
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.services.bench.structured import CHOICES, REGEX, REPORT_SCHEMA
from pagoda.structured_output.manager import StructuredOutputManager
from pagoda.tokenizer.loader import load_tokenizer

VOCAB = 49152
ANSWER = ('{"title": "A quiet evening", "rating": 4, "tags": ["calm", "river"], '
          '"summary": "Stars over the water."}')


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def schema_variant(i: int) -> dict:
    """Distinct schemas of the same size (a fresh one is a cache miss)."""
    schema = copy.deepcopy(REPORT_SCHEMA)
    schema["properties"][f"extra_{i}"] = {"type": "string"}
    return schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(None)
    manager = StructuredOutputManager(StructuredOutputsConfig(), VOCAB, lambda: tokenizer, [2])
    start = time.perf_counter()
    manager.backend  # tokenizer tables + compiler, once per scheduler (in the background)
    rows = [("backend start-up (once)", (time.perf_counter() - start) * 1000)]

    def ready(params: StructuredOutputsParams) -> float:
        start = time.perf_counter()
        manager.init_request(params, []).future.result()
        return (time.perf_counter() - start) * 1000

    cold = {
        "json_schema": statistics.median(
            ready(StructuredOutputsParams(json=schema_variant(i))) for i in range(5)),
        "regex": ready(StructuredOutputsParams(regex=REGEX)),
        "choice": ready(StructuredOutputsParams(choice=CHOICES)),
        "regex with a {1,2000} repetition": ready(StructuredOutputsParams(
            regex=r"[A-Za-z0-9 ,.'-]{1,2000}")),
    }
    for kind, ms in cold.items():
        rows.append((f"compile {kind}, cold", ms))
    cached = StructuredOutputsParams(json=schema_variant(0))
    rows.append(("compile json_schema, cached",
                 median_ms(lambda: manager.init_request(cached, []).future.result(),
                           args.repeats)))

    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    requests = []
    for i in range(32):
        request = manager.init_request(StructuredOutputsParams(json=REPORT_SCHEMA), [])
        request.future.result()
        manager.check_ready(request, [2], [])
        assert request.advance(ids[:i % len(ids)])
        requests.append(request)
    fresh = manager.init_request(StructuredOutputsParams(json=REPORT_SCHEMA), [])
    manager.check_ready(fresh, [2], [])
    token = tokenizer.encode(" river", add_special_tokens=False)[0]

    def advance_once() -> None:
        fresh.grammar.accept_token(token)
        fresh.grammar.reset()

    rows.append(("advance one token (+ reset)", median_ms(advance_once, args.repeats)))
    for batch in (1, 8, 32):
        rows.append((f"bitmask, {batch} rows (scheduler)",
                     median_ms(lambda: manager.grammar_bitmask(requests[:batch]), args.repeats)))
        bitmask = manager.grammar_bitmask(requests[:batch])
        logits = torch.randn(batch, VOCAB)
        rows.append((f"apply, {batch} rows (worker, CPU)",
                     median_ms(lambda: apply_grammar_bitmask(logits, bitmask, range(batch)),
                               args.repeats)))
    manager.shutdown()
    print(f"| structured outputs ({torch.get_num_threads()} torch threads) | ms |")
    print("|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()

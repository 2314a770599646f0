"""vLLM's periodic stats line, every `--log-stats-interval` seconds:

    Engine 000: Avg prompt throughput: 51.2 tokens/s, Avg generation throughput: 12.0
    tokens/s, Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 4.1%, Prefix cache
    hit rate: 37.5%

Throughputs and the prefix-cache hit rate cover the interval since the previous
line; running/waiting/KV usage are the latest snapshot. An idle engine logs at
DEBUG (no noise), as vLLM does, but the first idle interval after traffic still
logs at INFO so the drop to zero is visible.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import pagoda.envs as envs
from pagoda.core.scheduler import SchedulerStats
from pagoda.metrics.stats import IterationStats

logger = logging.getLogger("pagoda.metrics")
DEFAULT_LOG_STATS_INTERVAL = 10.0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`--log-stats-interval`, `--disable-log-stats` (metrics stay on either way)."""
    parser.add_argument("--log-stats-interval", type=float,
                        default=envs.get("PAGODA_LOG_STATS_INTERVAL"),
                        help="Seconds between engine stats log lines (throughput, running/"
                             "waiting, KV usage, prefix hit rate); 0 disables them (default: "
                             "$PAGODA_LOG_STATS_INTERVAL, else $VLLM_LOG_STATS_INTERVAL, "
                             f"else {DEFAULT_LOG_STATS_INTERVAL:g}).")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="Do not log engine stats (Prometheus metrics stay on).")


def log_stats_interval(args: argparse.Namespace) -> float:
    """The interval the flags ask for; 0 means no stats line."""
    if getattr(args, "disable_log_stats", False):
        return 0.0
    return max(float(getattr(args, "log_stats_interval", DEFAULT_LOG_STATS_INTERVAL)), 0.0)


class StatLogger:
    """`record` is called by the engine thread, `log` by a timer thread: a lock
    keeps the interval's counters consistent between the two."""

    def __init__(self, engine_index: int = 0, log: logging.Logger = logger) -> None:
        self.engine_index = engine_index
        self._log = log
        self._lock = threading.Lock()
        self._last_log_time = time.monotonic()
        self._prompt_tokens = self._generation_tokens = 0
        self._last_scheduler_stats: SchedulerStats | None = None
        # Cumulative prefix-cache (queries, hits) when the interval began.
        self._interval_start_prefix = (0, 0)
        # Cumulative speculation counts when the interval began (under --speculative-config).
        self._interval_start_spec = None
        self._was_busy = False

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        with self._lock:
            if iteration_stats is not None:
                self._prompt_tokens += iteration_stats.num_prompt_tokens
                self._generation_tokens += iteration_stats.num_generation_tokens
            if scheduler_stats is not None:
                self._last_scheduler_stats = scheduler_stats

    def log(self, now: float | None = None) -> str:
        """Emit (and return) the line for the interval that ends now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            elapsed = max(now - self._last_log_time, 1e-9)
            prompt_tp, gen_tp = self._prompt_tokens / elapsed, self._generation_tokens / elapsed
            last, (start_queries, start_hits) = (self._last_scheduler_stats,
                                                 self._interval_start_prefix)
            self._prompt_tokens = self._generation_tokens = 0
            self._last_log_time = now
            queries = hits = 0
            if last is not None:
                queries = last.prefix_cache_queries - start_queries
                hits = last.prefix_cache_hits - start_hits
                self._interval_start_prefix = (last.prefix_cache_queries, last.prefix_cache_hits)
        busy = bool(prompt_tp or gen_tp)
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        line = (f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt_tp:.1f} tokens/s, "
                f"Avg generation throughput: {gen_tp:.1f} tokens/s, "
                f"Running: {last.num_running if last else 0} reqs, "
                f"Waiting: {last.num_waiting if last else 0} reqs, "
                f"GPU KV cache usage: {(last.kv_cache_usage if last else 0.0) * 100:.1f}%, "
                f"Prefix cache hit rate: {(hits / queries if queries else 0.0) * 100:.1f}%")
        self._log.log(level, "%s", line)
        spec = last.spec_decoding if last is not None else None
        if spec is not None:
            spec_line = self._spec_line(spec, elapsed)
            if spec_line:
                self._log.log(level, "%s", spec_line)
        return line

    def _spec_line(self, spec, elapsed: float) -> str | None:
        """vLLM's `SpecDecoding metrics:` line for the interval (None when nothing was
        drafted in it)."""
        start = self._interval_start_spec
        self._interval_start_spec = (spec.num_drafts, spec.num_draft_tokens,
                                     spec.num_accepted_tokens, list(spec.accepted_per_pos))
        drafts, drafted, accepted, per_pos = start or (0, 0, 0, [0] * len(spec.accepted_per_pos))
        drafts, drafted = spec.num_drafts - drafts, spec.num_draft_tokens - drafted
        accepted = spec.num_accepted_tokens - accepted
        if drafts <= 0:
            return None
        rates = ", ".join(f"{(now - before) / drafts:.3f}"
                          for now, before in zip(spec.accepted_per_pos, per_pos))
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {accepted / max(drafted, 1) * 100:.1f}%")


class PeriodicLogger:
    """Calls `stat_logger.log()` every `interval` seconds in a daemon thread."""

    def __init__(self, stat_logger: StatLogger, interval: float) -> None:
        self.stat_logger = stat_logger
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-stats", daemon=True)

    def start(self) -> "PeriodicLogger":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.stat_logger.log()
            except Exception:  # a stats line must never take the service down
                logger.exception("stats logging failed")

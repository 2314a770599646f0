"""Environment variables Pagoda reads, with the vLLM names a vLLM deployment already sets.

Every setting has Pagoda's own name (`PAGODA_*`) and, where vLLM has the same
feature, vLLM's name as an alias. Rule: the Pagoda name wins when both are set; an
empty value counts as unset. Command-line flags (and `--config` files) override
both; the variables only change defaults. `--help` prints this table
(`environment_help`), so the two names are documented in one place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    """One setting: its Pagoda name, vLLM's name (None: no vLLM equivalent), how a
    value parses, the default when neither is set, and what it does."""

    name: str
    vllm_name: str | None
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _bool(value: str) -> bool:
    """vLLM's reading of a flag variable: "0"/"false" are off, anything else on."""
    return value.strip().lower() not in ("0", "false", "no", "off")


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise ValueError(f"must be positive, got {value}")
    return number


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return number


VARIABLES = {v.name: v for v in [
    EnvVar("PAGODA_API_KEY", "VLLM_API_KEY", str, None,
           "API key the gateway requires (`Authorization: Bearer KEY`); --api-key overrides."),
    EnvVar("PAGODA_LOG_LEVEL", "VLLM_LOGGING_LEVEL", str.upper, "INFO",
           "Log level of every service and of run-batch (DEBUG, INFO, WARNING, ...)."),
    EnvVar("PAGODA_CONFIGURE_LOGGING", "VLLM_CONFIGURE_LOGGING", _bool, True,
           "0: Pagoda leaves Python logging as it finds it (no handler, no format)."),
    EnvVar("PAGODA_LOGGING_CONFIG_PATH", "VLLM_LOGGING_CONFIG_PATH", str, None,
           "A JSON file with a logging.config.dictConfig dictionary, used instead of "
           "Pagoda's format."),
    EnvVar("PAGODA_LOG_STATS_INTERVAL", "VLLM_LOG_STATS_INTERVAL", _positive_float, 10.0,
           "Default seconds between engine stats lines (--log-stats-interval)."),
    EnvVar("PAGODA_ENGINE_READY_TIMEOUT_S", "VLLM_ENGINE_READY_TIMEOUT_S", _positive_float,
           900.0, "Default seconds `pagoda serve` waits for every service to be healthy "
           "(--startup-timeout)."),
    EnvVar("PAGODA_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT", _bool, False,
           "1: a request's greedy or seeded output does not depend on what else is in the "
           "batch, on chunking or on prefix-cache hits (--batch-invariant; CPU only)."),
    EnvVar("PAGODA_CPU_KERNELS", None, _bool, True,
           "0: the bf16 CPU path runs plain torch ops instead of Pagoda's fused C++ kernels "
           "(RMSNorm, rotary, SiLU-and-mul, KV write, decode attention; built once per "
           "machine into PAGODA_CACHE_DIR, ~/.cache/pagoda by default; read by "
           "`pagoda.kernels.cpu` itself, the same way)."),
    EnvVar("PAGODA_CPU_FUSED_DECODE", None, _bool, True,
           "0: a decode step of a Llama-shaped GGUF 4-bit model on the bf16 CPU path runs "
           "its decoder layers as a Python loop instead of one C++ call (same results; "
           "`pagoda.model.cpu_decode_stack`)."),
    EnvVar("PAGODA_CPU_GEMV", None, _bool, True,
           "0: a GGUF 4-bit model's small CPU steps multiply with torch's int4/int8 kernels "
           "(`_weight_int4pack_mm`, `_weight_int8pack_mm`) instead of Pagoda's skinny "
           "GEMV (kernels/cpu/csrc/gemv.h; other summation order, same weights). Read when "
           "the weights are packed."),
    EnvVar("PAGODA_CPU_PACKED_WEIGHTS", None, _bool, True,
           "0: bf16 linear layers on the CPU keep their plain weights (F.linear) instead of "
           "oneDNN-prepacked ones (same results; the prepacked product skips a per-call "
           "re-layout of the weight)."),
    EnvVar("PAGODA_LOAD_THREADS", None, _positive_int, None,
           "At most this many torch threads load the model (dequantizing, casting, GGUF "
           "int4 packing; unset: torch's count). `pagoda serve` sets it for its "
           "gpu-workers to the cores its other services leave at start-up (1 on 2 cores): "
           "threads that spin between regions take the cores the others start on."),
    EnvVar("PAGODA_GENERATE_STREAM", None, _bool, True,
           "0: the gateway sends each request to its scheduler replica as its own Generate "
           "call instead of over one multiplexed GenerateStream per replica (for comparing "
           "the two; a replica without GenerateStream gets Generate calls either way)."),
    EnvVar("PAGODA_GATEWAY_UVLOOP", None, _bool, True,
           "0: the gateway runs on asyncio's own event loop instead of uvloop (used when "
           "installed, as vLLM's API server does; for comparing the two)."),
    EnvVar("PAGODA_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", _bool,
           False, "1: the gateway serves POST /v1/load_lora_adapter and "
           "/v1/unload_lora_adapter (--allow-runtime-lora-updating)."),
    EnvVar("PAGODA_KV_EVENTS_USE_INT_BLOCK_HASHES", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", _bool,
           True, "With --kv-events-config: 1 sends each block hash as the integer of its "
           "last 8 bytes (big-endian, vLLM's default), 0 as the whole digest (bytes)."),
    # Media fetching (pagoda.multimodal.media): read by the service that loads images
    # (the tokenizer service in a cluster, the offline LLM in process).
    EnvVar("PAGODA_IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT", _positive_float, 5.0,
           "Seconds one image fetch (an http(s) image_url, all its redirects and its body) "
           "may take before the request fails with a 400."),
    EnvVar("PAGODA_MEDIA_FETCH_MAX_RETRIES", "VLLM_MEDIA_FETCH_MAX_RETRIES", int, 2,
           "Retries of a media fetch that failed in transport (connection error, timeout, "
           "HTTP 5xx); refusals (allow-list, size, 4xx) are never retried."),
    EnvVar("PAGODA_MEDIA_CACHE", "VLLM_MEDIA_CACHE", str, None,
           "A directory: http(s) media are kept there by URL and read back instead of "
           "fetched again (unset: no cache). URLs are taken as immutable: an image changed "
           "at the same URL is served from the cache until its file is removed; set it only "
           "for content-addressed or versioned URLs. Nothing evicts: bound it yourself."),
    EnvVar("PAGODA_MEDIA_LOADING_THREAD_COUNT", "VLLM_MEDIA_LOADING_THREAD_COUNT", int, 8,
           "Threads that fetch and decode one request's media in parallel."),
    EnvVar("PAGODA_MEDIA_MAX_BYTES", None, int, 20 * 1024 * 1024,
           "Largest media item in bytes (a data: URL's decoded bytes, a fetched body, a "
           "local file); larger is a 400."),
    EnvVar("PAGODA_SYSTEM_START_DATE", "VLLM_SYSTEM_START_DATE", str, None,
           "The `Current date:` (YYYY-MM-DD) of gpt-oss's harmony system message; unset: "
           "today's date, so the prompt changes at midnight."),
    EnvVar("PAGODA_IMAGE_MAX_PIXELS", None, int, 40_000_000,
           "Largest image in pixels (width x height), checked from the header before "
           "decoding (a decompression bomb is refused without being decoded)."),
]}


def get(name: str) -> Any:
    """The value of setting `name` (its Pagoda name): Pagoda's variable, else vLLM's,
    else the default. A value that does not parse raises ValueError naming the variable."""
    var = VARIABLES[name]
    for env_name in (var.name, var.vllm_name):
        raw = os.environ.get(env_name) if env_name else None
        if raw is None or raw == "":
            continue
        try:
            return var.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {env_name}={raw!r}: {exc}") from None
    return var.default


def source(name: str) -> str | None:
    """Which variable `get(name)` reads (for messages), or None when the default applies."""
    var = VARIABLES[name]
    return next((n for n in (var.name, var.vllm_name) if n and os.environ.get(n)), None)


def environment_help() -> str:
    """The table `--help` shows under every command."""
    lines = ["environment variables (the Pagoda name wins over vLLM's; flags win over both):"]
    for var in VARIABLES.values():
        names = var.name + (f", {var.vllm_name}" if var.vllm_name else "")
        lines.append(f"  {names}\n      {var.doc}")
    return "\n".join(lines)

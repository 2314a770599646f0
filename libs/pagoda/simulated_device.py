"""`--simulated-device`: the settings of the simulated device (benchmarks only).

A simulated device replaces the model runner of a worker (`pagoda.executor.simulated`):
each step sleeps `base_ms + per_token_ms * tokens` (the step's scheduled tokens) and
returns deterministic tokens, so the rest of the system (gateway, tokenizer, scheduler,
KV bookkeeping, streaming, detokenizing) runs at a GPU's step rate on any machine.
It is never on by default: only the flag (or `EngineArgs.simulated_device`) turns it on.

This module imports nothing heavy: the CLI parses the flag before any torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.json_flag import json_object

FLAG = "--simulated-device"
FLAG_HELP = (
    'Benchmarks only: replace the model runner by a simulated device, e.g. '
    '\'{"base_ms": 25, "per_token_ms": 0.01}\'. Each step sleeps base_ms + per_token_ms x '
    "(the step's scheduled tokens) and returns deterministic tokens (a function of the "
    "prompt and the position; never EOS or a stop token unless \"eos_after\": N makes the "
    "Nth output token EOS); the scheduler's KV blocks are allocated and freed as usual, "
    "but no KV tensors exist. \"record_path\": a file where the worker appends one line "
    "per step (start end tokens requests, Unix seconds): the benchmark's idle gaps. The "
    "weights are not loaded: the model folder gives the tokenizer and config only.")

_KEYS = {"base_ms", "per_token_ms", "eos_after", "record_path"}


@dataclass(frozen=True)
class SimulatedDeviceConfig:
    """Invariant: base_ms > 0, per_token_ms >= 0, eos_after None or >= 1."""

    base_ms: float
    per_token_ms: float = 0.0
    eos_after: int | None = None  # the Nth output token (1-based) is EOS; None: never
    record_path: str | None = None  # one line per step appended here; None: no record

    def step_seconds(self, num_tokens: int) -> float:
        """The simulated step's duration for `num_tokens` scheduled tokens."""
        return (self.base_ms + self.per_token_ms * num_tokens) / 1000.0

    @classmethod
    def parse(cls, value) -> "SimulatedDeviceConfig | None":
        """The flag's JSON (or a dict, or a config); None or "" gives None. ValueError
        naming the flag and the field for anything else."""
        if isinstance(value, SimulatedDeviceConfig):
            return value
        raw = json_object(value, FLAG)
        if raw is None:
            return None
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ValueError(f"{FLAG}: unknown field(s) {unknown}; expected {sorted(_KEYS)}")
        if "base_ms" not in raw:
            raise ValueError(f"{FLAG}: base_ms (the step time in milliseconds) is required")
        base, per_token = _number(raw, "base_ms"), _number(raw, "per_token_ms", 0.0)
        if base <= 0:
            raise ValueError(f"{FLAG}: base_ms must be positive, got {base}")
        if per_token < 0:
            raise ValueError(f"{FLAG}: per_token_ms must be non-negative, got {per_token}")
        eos_after = raw.get("eos_after")
        if eos_after is not None and (isinstance(eos_after, bool) or not isinstance(eos_after, int)
                                      or eos_after < 1):
            raise ValueError(f"{FLAG}: eos_after must be a positive integer, got {eos_after!r}")
        record_path = raw.get("record_path")
        if record_path is not None and not isinstance(record_path, str):
            raise ValueError(f"{FLAG}: record_path must be a string")
        return cls(base, per_token, eos_after, record_path)


def _number(raw: dict, key: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{FLAG}: {key} must be a number, got {value!r}")
    return float(value)

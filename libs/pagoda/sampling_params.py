"""Sampling parameters, with vLLM's field names, defaults and validation.

Validated once, where a request enters the system: the constructor (the gateway's
HTTP body, the offline `LLM`). A wire decoder rebuilds already-validated params
with `from_validated`, which normalises but does not check again.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

# Below this temperature sampling is treated as greedy (as vLLM does), which avoids
# dividing logits by a number that would overflow them.
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one prompt.

    Invariant: an instance has passed `validate()`, here (the constructor) or in the
    process that sent it (`from_validated`); every invalid value raises `ValueError`
    whose message names the field (e.g. ``temperature``). A new field needs no
    converter code: the wire converters go by `dataclasses.fields` and field name.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k, like vLLM
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self.validate()

    @classmethod
    def from_validated(cls, **values: Any) -> "SamplingParams":
        """Rebuild params that were validated where they entered the system (a wire
        decoder's constructor): missing fields take their defaults, values are
        normalised as the constructor would, and nothing is checked again."""
        params = cls.__new__(cls)
        for f in fields(cls):
            params.__dict__[f.name] = values.get(f.name, f.default) \
                if f.default is not MISSING else values[f.name]
        params._normalize()
        return params

    def _normalize(self) -> None:
        """One representation per meaning: stop is a list, top_k -1 is 0, an empty
        logit_bias is None."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = self.logit_bias or None

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        _check(self.temperature >= 0.0, "temperature",
               f"temperature must be non-negative, got {self.temperature}.")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        _check(self.seed is None or isinstance(self.seed, int), "seed",
               f"seed must be an integer, got {self.seed!r}.")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                   f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                   f"got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and value >= 0), name,
                   f"{name} must be non-negative, got {value}.")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "stop must be a non-empty string or a list of non-empty strings.")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers.")

    # ------------------------------------------------------------------ helpers
    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def clone(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(message if field_name in message else f"{field_name}: {message}")

"""vLLM's `RepetitionDetectionParams`: end a request whose output loops.

A model stuck in a loop ("abcabcabc...", the same emoji again and again) would only
stop at max_tokens. With `SamplingParams(repetition_detection=RepetitionDetectionParams(
max_pattern_size=N, min_count=C))` the scheduler checks, after each output token, whether
the output ends with some pattern of min_pattern_size..max_pattern_size tokens repeated
at least C times in a row; if so the request finishes with vLLM's finish reason
"repetition" and stop reason "repetition_detected" (`pagoda.core.request.check_stop`).

Pure Python (the gateway builds these params from a request's JSON).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

# vLLM's stop_reason of a request ended by repetition detection.
REPETITION_STOP_REASON = "repetition_detected"
_INT32_MAX = 2**31 - 1


@dataclass
class RepetitionDetectionParams:
    """vLLM's fields and rules. `max_pattern_size`: the longest pattern checked, 0
    disables detection; `min_pattern_size`: the shortest (0 means 1), at most
    `max_pattern_size`; `min_count`: how many back-to-back repeats end the request, at
    least 2 when detection is on. Invalid values raise ValueError naming the field
    (``repetition_detection.min_count``)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_value(cls, value: Any) -> "RepetitionDetectionParams | None":
        """From a JSON object (a request body's) or an instance; an unknown key is a
        ValueError naming it, as any other invalid value."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError("repetition_detection must be an object with max_pattern_size, "
                             "min_pattern_size and min_count.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"repetition_detection.{unknown[0]} is not a field of "
                             f"repetition_detection (known: {', '.join(sorted(known))}).")
        return cls(**value)

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"repetition_detection.{f.name} must be an integer, "
                                 f"got {value!r}.")
            if value > _INT32_MAX:  # it travels as an int32
                raise ValueError(f"repetition_detection.{f.name} must be at most {_INT32_MAX}.")
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 \
                or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection.max_pattern_size, min_pattern_size must be "
                             ">=0, with min_pattern_size <= max_pattern_size. Set both to 0 to "
                             "disable repetitive pattern detection.")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("repetition_detection.min_count must be >= 2 to detect repetitive "
                             "patterns in engine output. If you do not wish to detect "
                             "repetitive patterns, set max_pattern_size to 0.")

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0


def check_sequence_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether `token_ids` ends with a pattern of min..max_pattern_size tokens repeated
    `min_count` times back to back. Costs at most max_pattern_size * min_count token
    comparisons per pattern size: cheap enough to run after every token."""
    if not params.enabled:
        return False
    n = len(token_ids)
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        if size * params.min_count > n:
            return False  # longer patterns fit even less
        tail = token_ids[n - size:]
        if all(token_ids[n - size * (k + 1): n - size * k] == tail
               for k in range(1, params.min_count)):
            return True
    return False

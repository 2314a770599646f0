"""vLLM's `--reasoning-config` and `thinking_token_budget`: at most N reasoning tokens.

`ReasoningConfig` names the thinking block's markers, as strings (`think_start_str`,
`think_end_str`, tokenized with the model's tokenizer at start-up) or token ids
(`think_start_token_ids`, `think_end_token_ids`). A request with
`thinking_token_budget=N` then thinks at most N tokens: once N tokens followed the
start marker with no end marker, the engine forces the end marker's tokens one by one
(`pagoda.sample.thinking_budget`), and the answer proper follows.

`budget_state` is the one rule, a pure function of the tokens so far (prompt + output),
so the worker can apply it to every row of a speculative step (row j as if its first
j drafts were output) and the scheduler can cut drafts that cross the budget: the count
stays exact with or without speculation (vLLM's bug #39573 was speculation overshooting
it). As in vLLM, tokens after a start marker at the end of the prompt (a template that
opens the block) count toward the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from pagoda.json_flag import json_object


@dataclass
class ReasoningConfig:
    """vLLM's `ReasoningConfig`. Invariant after `resolve`: both token-id lists are
    non-empty (the budget can be enforced)."""

    think_start_str: str | None = None
    think_end_str: str | None = None
    think_start_token_ids: list[int] | None = None
    think_end_token_ids: list[int] | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> "ReasoningConfig | None":
        """From the flag's JSON; ValueError naming an unknown key or a missing marker."""
        value = json_object(value, "--reasoning-config")
        if value is None:
            return None
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"--reasoning-config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
        config = cls(**value)
        for side in ("start", "end"):
            text, ids = getattr(config, f"think_{side}_str"), getattr(config, f"think_{side}_token_ids")
            if ids is not None and (not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise ValueError(f"--reasoning-config: think_{side}_token_ids must be a "
                                 f"non-empty list of token ids")
            if ids is None and not (isinstance(text, str) and text):
                raise ValueError(f"--reasoning-config: think_{side}_str (or "
                                 f"think_{side}_token_ids) is required")
        return config

    def resolve(self, tokenize: Callable[[str], list[int]], vocab_size: int) -> "ReasoningConfig":
        """Token ids for markers given as strings (`tokenize`: the model tokenizer's
        tokens of a text, as ids, no special tokens added); ValueError if one is out of
        the vocabulary or a string has no tokens."""
        for side in ("start", "end"):
            name = f"think_{side}_token_ids"
            if getattr(self, name) is None:
                setattr(self, name, list(tokenize(getattr(self, f"think_{side}_str"))))
            ids = getattr(self, name)
            if not ids or not all(0 <= t < vocab_size for t in ids):
                raise ValueError(f"--reasoning-config: {name} {ids} are not token ids of this "
                                 f"model (vocabulary of {vocab_size})")
        return self


def validate_thinking_token_budget(value: Any) -> int | None:
    """vLLM's rule: a non-negative integer, or -1 (or None) for no budget (-> None)."""
    if value is None:
        return None
    if isinstance(value, (bool, float)) or not isinstance(value, int) or value < -1:
        raise ValueError("thinking_token_budget must be a non-negative integer or -1 for "
                         f"unlimited, got {value!r}.")
    return None if value == -1 else value


@dataclass(frozen=True)
class BudgetState:
    """Where a sequence stands against its budget. `forced`: the token the next
    position must be (an end-marker token), else None; `free`: how many more tokens
    may be sampled freely before forcing starts (None: not thinking, no limit yet)."""

    forced: int | None
    free: int | None


def budget_state(token_ids: Sequence[int], budget: int, start_ids: Sequence[int],
                 end_ids: Sequence[int]) -> BudgetState:
    """The budget rule for the next token after `token_ids` (prompt + output).

    Thinking means the latest marker is the start marker; `count` tokens followed it.
    Below the budget the next `budget - count` tokens are free; at or past it the
    end marker is forced token by token (`count - budget` of its tokens were written).
    Scans back only to the latest marker."""
    marker = _latest_marker(token_ids, start_ids, end_ids)
    if marker is None or marker[0] == "end":
        return BudgetState(None, None)
    count = len(token_ids) - marker[1]
    if count < budget:
        return BudgetState(None, budget - count)
    written = count - budget
    return BudgetState(end_ids[written] if written < len(end_ids) else None, 0)


def _latest_marker(token_ids: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int]
                   ) -> tuple[str, int] | None:
    """("start" | "end", the index just after it) of the marker that ends last."""
    n = len(token_ids)
    for stop in range(n, 0, -1):
        for kind, ids in (("end", end_ids), ("start", start_ids)):
            k = len(ids)
            if k <= stop and token_ids[stop - 1] == ids[-1] and list(token_ids[stop - k:stop]) == list(ids):
                return kind, stop
    return None

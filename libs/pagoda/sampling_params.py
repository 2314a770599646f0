"""Sampling parameters, with vLLM's field names, defaults and validation.

Validated once per trust boundary: the constructor checks its own values (the
gateway's HTTP body, the offline `LLM`); a wire decoder rebuilds params with
`from_validated`, which normalises but does not check, and the receiving boundary
runs `validate()` once in its request check (`pagoda.request_checks`, the
scheduler). Checks against the model (vocabulary, lengths, --max-logprobs) are
`pagoda.request_checks`'; the worker trusts its scheduler for both.
"""

from __future__ import annotations

import json as _json
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from pagoda.reasoning.budget import validate_thinking_token_budget
from pagoda.repetition_detection import RepetitionDetectionParams

# Below this temperature sampling is treated as greedy (as vLLM does), which avoids
# dividing logits by a number that would overflow them.
GREEDY_TEMPERATURE_EPS = 1e-5


# The constraint fields of `StructuredOutputsParams`, in vLLM's order; exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint on a completion's text, with vLLM's names (`vllm.sampling_params`).

    `json`: a JSON schema (a dict, a JSON string or a pydantic model class); `regex`: a
    regular expression the whole text matches; `choice`: the text is one of these strings;
    `grammar`: an EBNF (GBNF) grammar whose `root` rule the text derives; `json_object`:
    any JSON object; `structural_tag`: xgrammar's structural tag (a dict or a JSON string).
    `disable_any_whitespace`: JSON without free whitespace between tokens.

    Invariants after construction: exactly one constraint field is set (`kind` names it);
    `json` and `structural_tag` hold parsed JSON (so the wire and the grammar cache see
    one representation); `json_object` is True or None. Invalid values raise ValueError
    naming the field (``structured_outputs.regex``). Whether the backend can compile the
    constraint is the engine's check (`pagoda.structured_output`), not this class's.
    """

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self._normalize()
        self.validate()

    def _normalize(self) -> None:
        if hasattr(self.json, "model_json_schema"):  # a pydantic model class
            self.json = self.json.model_json_schema()
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    setattr(self, name, _json.loads(value))
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.{name} is not valid JSON: {exc}") from None
        if self.json_object is False:
            self.json_object = None  # "not JSON mode" is no constraint
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)

    def validate(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None]
        _check(len(given) <= 1, "structured_outputs",
               f"structured_outputs: only one kind of constraint may be given, got "
               f"{' and '.join(given)}.")
        _check(len(given) == 1, "structured_outputs",
               "structured_outputs: one of " + ", ".join(STRUCTURED_OUTPUT_KINDS) + " is required.")
        _check(self.json is None or isinstance(self.json, (dict, bool)), "structured_outputs.json",
               "structured_outputs.json must be a JSON schema (an object).")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""),
                   f"structured_outputs.{name}", f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            _check(isinstance(self.choice, list) and self.choice
                   and all(isinstance(c, str) and c for c in self.choice), "structured_outputs.choice",
                   "structured_outputs.choice must be a non-empty list of non-empty strings.")
        _check(self.structural_tag is None or isinstance(self.structural_tag, dict),
               "structured_outputs.structural_tag",
               "structured_outputs.structural_tag must be a JSON object.")

    @classmethod
    def from_validated(cls, **values: Any) -> "StructuredOutputsParams":
        """Rebuild params validated where they entered the system (a wire decoder)."""
        params = cls.__new__(cls)
        for f in fields(cls):
            params.__dict__[f.name] = values.get(f.name, f.default)
        return params

    @property
    def kind(self) -> str:
        """The name of the one constraint field that is set."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> Any:
        """The constraint itself (the value of `kind`)."""
        return getattr(self, self.kind)


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one prompt.

    Invariant: an instance has passed `validate()`, here (the constructor) or at the
    trust boundary that decoded it (`from_validated`, then `pagoda.request_checks`);
    every invalid value raises `ValueError` whose message names the field (e.g.
    ``temperature``). A new field needs no converter code: the wire converters go by
    `dataclasses.fields` and field name (libs/pagoda/README.md, "Adding a sampling
    parameter").
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
    # Constrained decoding (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # The only token ids the completion may use; None: any (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Words the completion never contains (vLLM's bad_words). They are encoded where the
    # prompt is tokenized (`pagoda.tokenizer.bad_words`) into `bad_words_token_ids`,
    # the token sequences the sampler bans.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Keep only the prompt's last N tokens (-1: the context length); applied where the
    # prompt is tokenized (`pagoda.tokenizer.truncation`), so it never travels further.
    truncate_prompt_tokens: int | None = None
    # vLLM's extra_args: free-form per-request arguments for custom logits processors.
    extra_args: dict[str, Any] | None = None
    # vLLM's flat_logprobs: logprobs as one `FlatLogprobs` container (pagoda.logprobs).
    flat_logprobs: bool = False
    # vLLM's: at most this many reasoning tokens, then the end-of-thinking marker is
    # forced (needs --reasoning-config; pagoda.reasoning.budget). None or -1: no budget.
    thinking_token_budget: int | None = None
    # vLLM's: end the request (finish_reason "repetition") once its output loops
    # (pagoda.repetition_detection). A dict is accepted and converted.
    repetition_detection: RepetitionDetectionParams | None = None

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
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)  # [] stays: it is invalid
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.bad_words_token_ids = ([list(w) for w in self.bad_words_token_ids]
                                    if self.bad_words_token_ids else None)
        if isinstance(self.repetition_detection, dict):
            self.repetition_detection = RepetitionDetectionParams.from_value(self.repetition_detection)
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None

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
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
               "structured_outputs must be a StructuredOutputsParams.")
        self._validate_token_fields()
        validate_thinking_token_budget(self.thinking_token_budget)
        _check(self.repetition_detection is None
               or isinstance(self.repetition_detection, RepetitionDetectionParams),
               "repetition_detection", "repetition_detection must be a RepetitionDetectionParams.")
        if self.repetition_detection is not None:
            self.repetition_detection.validate()

    def _validate_token_fields(self) -> None:
        """allowed_token_ids, bad_words and truncate_prompt_tokens, with vLLM's messages
        where vLLM has one (the vocabulary is checked where it is known)."""
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids",
                   "allowed_token_ids is not None and empty!")
            _check(all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", "allowed_token_ids contains out-of-vocab token id!")
        check_bad_words(self.bad_words or ())
        _check(all(isinstance(w, list) and w and all(isinstance(t, int) and t >= 0 for t in w)
                   for w in self.bad_words_token_ids or ()), "bad_words_token_ids",
               "bad_words_token_ids must be non-empty lists of token ids.")
        t = self.truncate_prompt_tokens
        _check(t is None or (isinstance(t, int) and (t >= 1 or t == -1)), "truncate_prompt_tokens",
               f"truncate_prompt_tokens must be an integer >= 1 or -1, got {t}")

    # ------------------------------------------------------------------ helpers
    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def clone(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_bad_words(bad_words: list[str]) -> None:
    """The rule on `bad_words` as a client writes them (the gateway checks them before
    it encodes them, ahead of building the params)."""
    _check(all(isinstance(w, str) and w for w in bad_words), "bad_words",
           "bad_words must be a list of non-empty strings.")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(message if field_name in message else f"{field_name}: {message}")

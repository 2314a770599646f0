"""`use_beam_search` in the completions and chat APIs: which fields it reads, and the
400s for what it cannot honour.

vLLM's mapping (`to_beam_search_params`): `n` is the beam width (and the number of
choices), `max_tokens`, `temperature` (unset: the generation config's, else 1.0),
`ignore_eos`, `length_penalty` and `include_stop_str_in_output` go to
`BeamSearchParams`; `cache_salt`, `priority`, `skip_special_tokens` and the prompt's own
fields apply as usual. vLLM silently ignores the other sampling fields under beam
search; Pagoda refuses the ones a client set (a 400 naming the field), since the answer
would not honour them. Each step asks the replica for 2 * n logprobs, so n is bounded
by --max-logprobs (vLLM refuses the same request with its logprobs message).
"""

from __future__ import annotations

from typing import Any

from pagoda.beam_search import BeamSearchParams
from pagoda.services.gateway.errors import APIError

# vLLM's default temperature for a request that sets none (its _DEFAULT_SAMPLING_PARAMS).
DEFAULT_TEMPERATURE = 1.0
# Fields beam search does not honour, with the value that means "not set".
_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("top_p", None), ("top_k", None), ("min_p", None), ("seed", None),
    ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", None),
    ("stop", None), ("stop_token_ids", None), ("min_tokens", 0), ("logit_bias", None),
    ("prompt_logprobs", None), ("echo", False), ("allowed_token_ids", None),
    ("bad_words", None), ("structured_outputs", None), ("response_format", None),
    ("guided_json", None), ("guided_regex", None), ("guided_choice", None),
    ("guided_grammar", None), ("tools", None), ("suffix", None), ("vllm_xargs", None),
    ("thinking_token_budget", None), ("repetition_detection", None))


def check_beam_search(body: Any, max_logprobs: int) -> None:
    """The 400s of a `use_beam_search` body (after the common checks of `n`)."""
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(f"best_of ({body.best_of}) must equal n ({body.n}) with "
                       f"use_beam_search: n is the beam width.", param="best_of")
    if max_logprobs != -1 and 2 * body.n > max_logprobs:
        raise APIError(f"Beam search with n={body.n} needs 2 * n = {2 * body.n} logprobs per "
                       f"step, more than the maximum allowed, {max_logprobs} "
                       f"(--max-logprobs): n must be at most {max_logprobs // 2}.", param="n")
    if body.num_logprobs() is not None:
        name = "logprobs"
        raise APIError(f"{name} is not supported with use_beam_search.", param=name)
    for name, unset in _UNSUPPORTED:
        value = getattr(body, name, unset)
        if value is not None and value != unset and value != []:
            raise APIError(f"{name} is not supported with use_beam_search.", param=name)
    if getattr(body, "tool_choice", None) not in (None, "none", "auto"):
        raise APIError("tool_choice is not supported with use_beam_search.", param="tool_choice")


def beam_search_params(body: Any, max_tokens: int) -> BeamSearchParams:
    """vLLM's `to_beam_search_params`; a 400 naming the request's field."""
    temperature = body.temperature if body.temperature is not None else DEFAULT_TEMPERATURE
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens,
                                ignore_eos=body.ignore_eos, temperature=temperature,
                                length_penalty=body.length_penalty,
                                include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param="n" if name == "beam_width" else name) from None

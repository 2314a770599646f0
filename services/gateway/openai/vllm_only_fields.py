"""vLLM request fields Pagoda does not serve: a 400 naming the field, never ignored.

A field neither vLLM nor Pagoda knows is ignored with a warning, as vLLM does
(request_models._Body). But a client that sends one of vLLM's own fields expects vLLM's
behaviour; silently dropping it would give a different answer than the one asked for
(per-request logits processors, a P/D connector's kv_transfer_params, prompt
embeddings). These are refused by name until Pagoda
serves them. vLLM's flat repetition-detection fields are folded into
`repetition_detection` (`fold_repetition_fields`), which Pagoda serves.
"""

from __future__ import annotations

from typing import Any

from pagoda.services.gateway.errors import APIError

# Fields of vLLM's ChatCompletionRequest / CompletionRequest with no Pagoda meaning yet,
# and what a client can use instead.
UNSERVED = {
    "kv_transfer_params": "Pagoda moves KV between prefill and decode replicas itself "
                          "(pagoda serve --prefill-replicas/--decode-replicas)",
    "logits_processors": "per-request processors are not loaded; start the server with "
                         "--logits-processors and pass arguments in vllm_xargs",
    "mm_processor_kwargs": "images (and their processor arguments) are taken by the chat API "
                           "only, as image_url parts",
    "prompt_embeds": "this server takes token ids or text only",
    "request_id": "send the X-Request-Id header instead",
    "return_token_ids": "use return_tokens_as_token_ids with logprobs",
}

# vLLM's flat repetition-detection fields -> RepetitionDetectionParams' keys.
_REPETITION_FIELDS = {"max_repetition_pattern_size": "max_pattern_size",
                      "min_repetition_pattern_size": "min_pattern_size",
                      "repetition_min_count": "min_count"}


def refuse_unserved(data: Any, served: Any = ()) -> None:
    """A 400 for the first vLLM field in a request body that Pagoda does not serve
    (a field set to null is as good as absent); `served`: the body's own fields, which
    one API serves though another does not (mm_processor_kwargs: chat only)."""
    if not isinstance(data, dict):
        return
    for name, instead in UNSERVED.items():
        if data.get(name) is not None and name not in served:
            raise APIError(f"{name} is a vLLM request field this server does not support: "
                           f"{instead}.", param=name)


def fold_repetition_fields(data: Any) -> Any:
    """vLLM's `max_repetition_pattern_size`/`min_repetition_pattern_size`/
    `repetition_min_count` as one `repetition_detection` object (0s: not asked for);
    both spellings at once is a 400."""
    if not isinstance(data, dict) or not any(data.get(f) for f in _REPETITION_FIELDS):
        return data
    if data.get("repetition_detection") is not None:
        raise APIError("Give either repetition_detection or max_repetition_pattern_size/"
                       "min_repetition_pattern_size/repetition_min_count, not both.",
                       param="repetition_detection")
    data = dict(data)
    data["repetition_detection"] = {key: data.pop(flat) for flat, key in
                                    _REPETITION_FIELDS.items() if data.get(flat) is not None}
    return data

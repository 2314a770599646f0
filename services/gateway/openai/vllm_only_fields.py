"""vLLM request fields Pagoda does not serve: a 400 naming the field, never ignored.

A field neither vLLM nor Pagoda knows is ignored with a warning, as vLLM does
(request_models._Body). But a client that sends one of vLLM's own fields expects vLLM's
behaviour; silently dropping it would give a different answer than the one asked for
(per-request logits processors, a P/D connector's kv_transfer_params, multimodal
processor arguments, prompt embeddings, the side a prompt is truncated from). These are
refused by name until Pagoda serves them, per route (`UNSERVED` for chat, completions
and /v1/messages, `RESPONSES_UNSERVED` for /v1/responses, `POOLING_UNSERVED` and
`EMBEDDINGS_UNSERVED` for the pooling routes). A field set to null is as good as
absent, and so is a field set to the value Pagoda gives anyway (`SERVED_VALUES`: vLLM's
default, or the behaviour Pagoda has), so a client that spells out the default is not
refused.

vLLM fields that are left ignored on purpose, because vLLM itself ignores them on these
routes or they change no answer: `return_token_offsets` and `return_mm_kwargs` (render
endpoints only), `prompt_cache_key` (Responses; vLLM ignores it), `stream_interval`
(chunking of a stream, not its text; the server's `--stream-interval` sets it),
`session_id` (a label of related requests; Pagoda's session router keys on `user`),
`routed_experts_prompt_start` (only with --enable-return-routed-experts).

vLLM's flat repetition-detection fields are folded into `repetition_detection`
(`fold_repetition_fields`), which Pagoda serves.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

from pagoda.services.gateway.errors import APIError

# Fields of vLLM's ChatCompletionRequest / CompletionRequest (and of the other routes
# built on them) with no Pagoda meaning yet, and what a client can use instead.
UNSERVED = {
    "kv_transfer_params": "Pagoda moves KV between prefill and decode replicas itself "
                          "(pagoda serve --prefill-replicas/--decode-replicas)",
    "ec_transfer_params": "this server has no encoder-cache disaggregation",
    "logits_processors": "per-request processors are not loaded; start the server with "
                         "--logits-processors and pass arguments in vllm_xargs",
    "mm_processor_kwargs": "images (and their processor arguments) are taken by the chat API "
                           "only, as image_url parts",
    "media_io_kwargs": "media loading options are set by the server (VLLM_MEDIA_* variables), not per request",
    "prompt_embeds": "this server takes token ids or text only",
    "request_id": "send the X-Request-Id header instead",
    "return_token_ids": "use return_tokens_as_token_ids with logprobs",
    "return_prompt_text": "render the prompt with POST /tokenize (return_token_strs)",
    "logprob_token_ids": "use logprobs/top_logprobs",
    "truncation_side": "truncate_prompt_tokens keeps a prompt's last tokens (left)",
    "watermarking": "this server samples without a watermark",
}

# vLLM's ResponsesRequest fields Pagoda's Responses API does not serve.
RESPONSES_UNSERVED = {
    **UNSERVED,
    "enable_response_messages": "the output items carry the turn; read them with "
                                "GET /v1/responses/{id}",
    "previous_input_messages": "continue a stored response with previous_response_id",
    "previous_response": "continue a stored response with previous_response_id",
}

# vLLM's fields of every pooling request (/pooling, /classify, /score, /rerank) that
# Pagoda does not serve, and those of the embedding requests (/v1/embeddings, /pooling).
POOLING_UNSERVED = {
    "mm_processor_kwargs": "this server takes text input only",
    "request_id": "send the X-Request-Id header instead",
    "truncation_side": "truncate_prompt_tokens truncates text inputs from the right "
                       "and token-id inputs from the left",
}
EMBEDDINGS_UNSERVED = {
    **POOLING_UNSERVED,
    "embed_dtype": "base64 embeddings are float32",
    "endianness": "base64 embeddings are little-endian",
    "messages": "embed text given as input",
}

# field -> the values Pagoda gives anyway (sending one is as good as leaving it out).
SERVED_VALUES: Mapping[str, tuple[Any, ...]] = {
    "return_token_ids": (False,),
    "return_prompt_text": (False,),
    "watermarking": (False,),
    "enable_response_messages": (False,),
    "truncation_side": ("left",),  # the generation routes keep a prompt's last tokens
}
EMBEDDINGS_SERVED_VALUES: Mapping[str, tuple[Any, ...]] = {
    "embed_dtype": ("float32",),
    "endianness": ("little",),  # vLLM's "native" is the machine's: refused, to be exact
}

# vLLM's flat repetition-detection fields -> RepetitionDetectionParams' keys.
_REPETITION_FIELDS = {"max_repetition_pattern_size": "max_pattern_size",
                      "min_repetition_pattern_size": "min_pattern_size",
                      "repetition_min_count": "min_count"}


def refuse_unserved(data: Any, unserved: Mapping[str, str] = UNSERVED,
                    served: Mapping[str, tuple[Any, ...]] = SERVED_VALUES,
                    own_fields: Collection[str] = ()) -> None:
    """A 400 for the first vLLM field of `unserved` that a request body sets to a value
    Pagoda does not give (null, or one of its `served` values, is as good as absent);
    `own_fields`: the request model's own fields, which one API serves though another
    does not (mm_processor_kwargs: chat only)."""
    if not isinstance(data, dict):
        return
    for name, instead in unserved.items():
        if name in own_fields:
            continue
        value = data.get(name)
        # bool is an int (`0 == False`), so the types must match too.
        if value is None or any(type(value) is type(v) and value == v
                                for v in served.get(name, ())):
            continue
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

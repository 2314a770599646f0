"""`/v1/embeddings` lines of a batch file: body -> pooling prompts, outputs -> response body.

Only a pooling model (`--runner pooling`, or one auto-detected as such) with the
"embed" task answers them, as `vllm run-batch` does; any other model gets a 400 that
says why. The body is the gateway's `EmbeddingRequest` (validated by batch_requests'
`parse_line`), so fields, defaults and ranges are the served API's. Prompts are
tokenized as `LLM.embed` tokenizes them (the tokenizer truncates text to
`truncate_prompt_tokens`, special tokens kept; token ids keep their last k), so a
batch line's embedding equals `LLM(model, runner="pooling").embed(...)`'s. What
depends on the model (`dimensions` on a non-matryoshka model, the context length) is
refused by the engine's `add_request`, which run_batch's `_submit` turns into an
error line. The response is OpenAI's list of embeddings, each vector through the
gateway's own `encode_vector` (float or base64).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagoda.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.generation.fan_out import check_prompt
from pagoda.services.gateway.openai.completion_bodies import Usage
from pagoda.services.gateway.pooling.fan_out import input_items, truncation_limit
from pagoda.services.gateway.pooling.request_models import EmbeddingRequest
from pagoda.services.gateway.pooling.routes import encode_vector

GENERATION_ONLY = ("The model does not support Embeddings API: it generates text (serve a "
                   "pooling model, or this one with --runner pooling).")


def embedding_prompts(body: EmbeddingRequest, ctx: Any) -> list[tuple[list[int], PoolingParams]]:
    """(token ids, pooling params) of each input of `body`; APIError (400) for a model
    that cannot embed, an empty input or a token id outside the vocabulary."""
    if ctx.pooling_task is None:
        raise APIError(GENERATION_ONLY)
    if ctx.pooling_task != "embed":
        raise APIError(f"The model does not support Embeddings API (its task is "
                       f"{ctx.pooling_task!r}).")
    inputs = input_items(body.input)
    max_length = truncation_limit(body.truncate_prompt_tokens, ctx.max_model_len)
    prompts = []
    for value in inputs:
        if isinstance(value, str):
            ids = list(ctx.tokenizer(value, add_special_tokens=body.add_special_tokens,
                                     truncation=max_length is not None,
                                     max_length=max_length)["input_ids"])
        else:
            ids = list(value)[-max_length:] if max_length else list(value)
        check_prompt(ids, ctx.vocab_size, "input")
        prompts.append((ids, body.pooling_params()))  # one per request: the engine fills it in
    return prompts


def embedding_body(body: EmbeddingRequest, model: str, outputs: list[PoolingRequestOutput],
                   report_details: bool) -> dict:
    """The /v1/embeddings response body (the gateway's shape) of one line's outputs,
    given in input order. Usage counts every prompt token; pooling completes none."""
    usage = Usage(prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
                  cached_tokens=sum(o.num_cached_tokens for o in outputs),
                  report_details=report_details)
    data = [{"index": i, "object": "embedding",
             "embedding": encode_vector(EmbeddingRequestOutput.from_base(o).outputs.embedding,
                                        body.encoding_format)}
            for i, o in enumerate(outputs)]
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "data": data, "usage": usage.as_dict()}

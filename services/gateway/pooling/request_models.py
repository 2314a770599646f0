"""Request bodies of the pooling endpoints (vLLM's field names), validated by pydantic.

    /v1/embeddings   EmbeddingRequest       OpenAI's, plus vLLM's extras
    /pooling         PoolingRequest         the model's own task (or `task`), raw vector out
    /classify        ClassificationRequest
    /score           ScoreRequest           text_1 x text_2: 1 -> 1, 1 -> N, N -> N
    /rerank          RerankRequest          Jina / Cohere shape (also /v1 and /v2)

A wrong type or value (an `encoding_format` that is not "float" or "base64") is a 400
through the app's validation handler, never a 422. What depends on the served model
(dimensions on a non-matryoshka model, the context length) is checked by the engine
(`PoolingParams.verify` in `pagoda.request_checks`), the one place both paths share.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagoda.pooling_params import PoolingParams
from pagoda.services.gateway.openai.vllm_only_fields import (EMBEDDINGS_SERVED_VALUES,
                                                             EMBEDDINGS_UNSERVED,
                                                             POOLING_UNSERVED, refuse_unserved)

INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# An input: text, a list of texts, token ids, or a list of token-id lists (OpenAI's forms).
Input = str | list[str] | list[TokenId] | list[list[TokenId]]
Truncation = Annotated[int, Field(ge=-1, le=INT32_MAX)] | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    # vLLM's fields of this route that Pagoda does not serve: a 400 naming the field.
    vllm_unserved: ClassVar[Mapping[str, str]] = POOLING_UNSERVED

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data: Any) -> Any:
        refuse_unserved(data, cls.vllm_unserved, EMBEDDINGS_SERVED_VALUES)
        return data

    model: str | None = None
    user: str | None = None
    # vLLM's: keep at most this many tokens of each input (-1: the context length),
    # truncated as the tokenizer truncates (special tokens kept).
    truncate_prompt_tokens: Truncation = None


class EmbeddingRequest(_Body):
    vllm_unserved: ClassVar[Mapping[str, str]] = EMBEDDINGS_UNSERVED
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    normalize: bool | None = None  # vLLM's: default the model's (normalised)
    add_special_tokens: bool = True

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(task="embed", dimensions=self.dimensions, normalize=self.normalize)


# The tasks /pooling may be asked for (vLLM's `task` field); "score" needs a text pair.
PoolingTask = Literal["embed", "classify", "token_classify", "token_embed"]


class PoolingRequest(_Body):
    vllm_unserved: ClassVar[Mapping[str, str]] = EMBEDDINGS_UNSERVED
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    add_special_tokens: bool = True
    # vLLM's: None runs the model's own task; "token_classify" serves a classifier as a
    # token reward model (one row of label probabilities per prompt token, `LLM.reward`).
    task: PoolingTask | None = None
    use_activation: bool | None = None  # classify / token_classify: False -> raw logits
    # embed / token_embed (vLLM's): matryoshka dimensions; normalize None: the model's.
    dimensions: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    normalize: bool | None = None

    def pooling_params(self) -> PoolingParams:
        # the model's defaults for the task; the engine refuses a field the task ignores
        return PoolingParams(task=self.task, use_activation=self.use_activation,
                             dimensions=self.dimensions, normalize=self.normalize)


class ClassificationRequest(_Body):
    input: Input
    add_special_tokens: bool = True
    use_activation: bool | None = None

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(task="classify", use_activation=self.use_activation)


class ScoreRequest(_Body):
    text_1: str | list[str]
    text_2: str | list[str]
    use_activation: bool | None = None


class RerankRequest(_Body):
    query: str
    documents: list[str]
    top_n: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None  # 0 or unset: all
    return_documents: bool = True  # Cohere's; vLLM always returns them
    use_activation: bool | None = None

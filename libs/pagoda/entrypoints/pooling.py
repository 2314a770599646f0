"""`LLM`'s methods for pooling models, with vLLM's signatures and output types.

    encode(prompts)          -> PoolingRequestOutput        (the model's own task)
    embed(prompts)           -> EmbeddingRequestOutput      (.outputs.embedding)
    classify(prompts)        -> ClassificationRequestOutput (.outputs.probs)
    reward(prompts)          -> PoolingRequestOutput        (.outputs.data [tokens, labels])
    score(data_1, data_2)    -> ScoringRequestOutput        (.outputs.score)

`score` pairs 1 -> 1, 1 -> N or N -> N texts. A cross-encoder (a classifier with one
label) reads each pair as one prompt, tokenized as a text pair (BERT: `[CLS] a [SEP]
b [SEP]`, token type 1 on b); an embedding model embeds both sides and scores the
cosine similarity of each pair; a late-interaction model (ColBERT, task token_embed)
embeds every token of both sides and scores MaxSim. Prompts are tokenized here, with
`truncate_prompt_tokens` applied as the tokenizer truncates (special tokens kept);
a prompt given as token ids keeps its last k tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from pagoda.entrypoints.prompts import Prompt, as_prompt_list, normalize_prompt
from pagoda.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                            PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from pagoda.pooling_params import PoolingParams
from pagoda.score_utils import cosine_similarity, maxsim, score_pairs, token_type_split

Params = PoolingParams | Sequence[PoolingParams] | None


class PoolingMethods:
    """Mixed into `LLM` (which sets `llm_engine`). Invariant: results come back in the
    order of the inputs, one per prompt (one per pair for `score`)."""

    llm_engine: Any
    _keep_enqueued_output: Any  # QueueMethods' (LLM mixes both in)

    def encode(self, prompts: Prompt | Sequence[Prompt], pooling_params: Params = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """The pooled vector of each prompt (`.outputs.data`, a float32 tensor; for
        token_embed one row per prompt token) for `pooling_task` (default: the model's
        own task)."""
        pooler = self._pooler_config("LLM.encode()")
        prompts = as_prompt_list(prompts)
        params = _params_per_prompt(pooling_params, len(prompts), pooling_task or pooler.task)
        items = [self._tokenize(p, truncate_prompt_tokens, q) for p, q in zip(prompts, params)]
        outputs = self._run_pooling(items, params, use_tqdm)
        if (pooling_task or pooler.task) == "token_embed":  # one row per token, as vLLM's
            for out in outputs:
                out.outputs.data = out.outputs.data.reshape(-1, pooler.hidden_size)
        return outputs

    def embed(self, prompts: Prompt | Sequence[Prompt], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: Params = None) -> list[EmbeddingRequestOutput]:
        self._pooler_config("LLM.embed()")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(self, prompts: Prompt | Sequence[Prompt], *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
                 pooling_params: Params = None) -> list[ClassificationRequestOutput]:
        self._pooler_config("LLM.classify()")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def reward(self, prompts: Prompt | Sequence[Prompt], /, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_params: Params = None) -> list[PoolingRequestOutput]:
        """Each prompt's per-token rewards (vLLM's `LLM.reward`: the `token_classify`
        task): `.outputs.data` is [prompt tokens, labels], the classification head's
        probabilities at every token."""
        self._pooler_config("LLM.reward()")
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, pooling_task="token_classify")

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """The score of each pair (data_1[i], data_2[i]); one data_1 text pairs with every
        data_2 text."""
        pooler = self._pooler_config("LLM.score()")
        left, right = score_pairs(data_1, data_2)
        if pooler.task == "embed":
            return self._embedding_score(left, right, truncate_prompt_tokens, use_tqdm,
                                         pooling_params)
        if pooler.task == "token_embed":
            return self._late_interaction_score(left, right, truncate_prompt_tokens, use_tqdm,
                                                pooling_params, pooler.hidden_size)
        params = [_clone_or_new(pooling_params, "score") for _ in left]
        items = [self._tokenize_pair(a, b, truncate_prompt_tokens, p)
                 for a, b, p in zip(left, right, params)]
        return [ScoringRequestOutput.from_base(o)
                for o in self._run_pooling(items, params, use_tqdm)]

    # ------------------------------------------------------------------ helpers
    def _pooler_config(self, method: str):
        config = self.llm_engine.config
        if config.runner != "pooling":
            raise ValueError(f"{method} is only supported for pooling models; this model runs "
                             "--runner generate (pass runner=\"pooling\" to LLM)")
        return config.pooler_config

    def _embedding_score(self, left: list[str], right: list[str], truncate: int | None,
                         use_tqdm: bool, params: PoolingParams | None) -> list[ScoringRequestOutput]:
        unique = list(dict.fromkeys(left + right))
        embedded = dict(zip(unique, self.embed(unique, truncate_prompt_tokens=truncate,
                                               use_tqdm=use_tqdm, pooling_params=params)))
        results = []
        for a, b in zip(left, right):
            ea, eb = embedded[a], embedded[b]
            score = cosine_similarity(ea.outputs.embedding, eb.outputs.embedding)
            results.append(ScoringRequestOutput(f"{ea.request_id}_{eb.request_id}",
                                                ScoringOutput(score),
                                                ea.prompt_token_ids + eb.prompt_token_ids))
        return results

    def _late_interaction_score(self, left: list[str], right: list[str], truncate: int | None,
                                use_tqdm: bool, params: PoolingParams | None, dim: int
                                ) -> list[ScoringRequestOutput]:
        """MaxSim of each (query, document) pair's token embeddings (ColBERT); each
        distinct text is encoded once."""
        unique = list(dict.fromkeys(left + right))
        encoded = dict(zip(unique, self.encode(
            unique, [_clone_or_new(params, "token_embed") for _ in unique],
            truncate_prompt_tokens=truncate, use_tqdm=use_tqdm, pooling_task="token_embed")))
        results = []
        for a, b in zip(left, right):
            ea, eb = encoded[a], encoded[b]
            score = maxsim(ea.outputs.data.reshape(-1).tolist(),
                           eb.outputs.data.reshape(-1).tolist(), dim)
            results.append(ScoringRequestOutput(f"{ea.request_id}_{eb.request_id}",
                                                ScoringOutput(score),
                                                ea.prompt_token_ids + eb.prompt_token_ids))
        return results

    def _tokenize(self, prompt: Prompt, truncate: int | None, params: PoolingParams) -> list[int]:
        text, ids, _ = normalize_prompt(prompt)
        max_length = self._truncation(truncate, params)
        if ids is not None:
            return ids[-max_length:] if max_length else ids
        tokenizer = self.llm_engine.tokenizer
        return tokenizer(text, truncation=max_length is not None, max_length=max_length)["input_ids"]

    def _tokenize_pair(self, first: str, second: str, truncate: int | None,
                       params: PoolingParams) -> list[int]:
        max_length = self._truncation(truncate, params)
        encoded = self.llm_engine.tokenizer(first, second, truncation=max_length is not None,
                                            max_length=max_length)
        params.token_type_split = token_type_split(encoded.get("token_type_ids"))
        return encoded["input_ids"]

    def _truncation(self, truncate: int | None, params: PoolingParams) -> int | None:
        """The token limit of a prompt (vLLM's `truncate_prompt_tokens`; -1: the context)."""
        truncate = truncate if truncate is not None else params.truncate_prompt_tokens
        if truncate is None:
            return None
        max_len = self.llm_engine.config.scheduler.max_model_len
        if truncate == -1:
            return max_len
        if truncate < 1:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's context length) "
                             f"or positive, got {truncate}.")
        if truncate > max_len:
            raise ValueError(f"truncate_prompt_tokens value ({truncate}) is greater than "
                             f"max_model_len ({max_len}). Please, select a smaller truncation "
                             "size.")
        return truncate

    def _run_pooling(self, items: list[list[int]], params: list[PoolingParams],
                     use_tqdm: bool) -> list[PoolingRequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (ids, p) in enumerate(zip(items, params)):
                order[engine.add_request(None, ids, p)] = i
        except Exception:
            engine.abort_request(list(order))
            raise
        results: list[PoolingRequestOutput | None] = [None] * len(items)
        with tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if self._keep_enqueued_output(output):
                        continue  # an enqueued request's: for wait_for_completion
                    if output.request_id in order:
                        results[order[output.request_id]] = output
                        bar.update(1)
        return results  # type: ignore[return-value]


def _clone_or_new(params: PoolingParams | None, task: str) -> PoolingParams:
    """A request's own copy (the engine completes it in place), its task set."""
    params = params.clone() if params is not None else PoolingParams()
    params.task = params.task or task
    return params


def _params_per_prompt(params: Params, n: int, task: str) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        return [_clone_or_new(params, task) for _ in range(n)]
    params = [_clone_or_new(p, task) for p in params]
    if len(params) != n:
        raise ValueError(f"Got {len(params)} pooling params for {n} prompts.")
    return params

"""The offline engine: tokenizer + engine core + output processor in one process.

Pooling requests (`PoolingParams`) need no output processor: each finishes in one
step with its vector, which `step` returns as a `PoolingRequestOutput`.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from pagoda.engine.arg_utils import EngineArgs
from pagoda.messages import EngineCoreRequest, FinishReason
from pagoda.engine.engine_core import EngineCore
from pagoda.executor.factory import make_executor
from pagoda.engine.output_processor import OutputProcessor, ParentRequest
from pagoda.lora.request import LoRARequest
from pagoda.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagoda.metrics.engine_metrics import EngineMetrics
from pagoda.metrics.reader import Metric, get_metrics_snapshot
from pagoda.metrics.recorder import EngineStatsRecorder
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.pooling_params import PREFILL_ONLY, TOKEN_TASKS, PoolingParams
from pagoda.request_checks import check_request
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.bad_words import bad_words_token_ids
from pagoda.tokenizer.loader import load_tokenizer
from pagoda.tokenizer.truncation import truncate_prompt

logger = logging.getLogger(__name__)


class LLMEngine:
    """Invariant: every request added is eventually returned by `step` exactly once."""

    def __init__(self, engine_args: EngineArgs, log_stats: bool = False) -> None:
        self.config = engine_args.create_engine_config()
        self.tokenizer = load_tokenizer(self.config.model, self.config.tokenizer)
        self.core = EngineCore(self.config, make_executor(self.config))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._pooling: dict[str, tuple[list[int], PoolingParams]] = {}  # unfinished ones
        self.log_stats = log_stats
        self.stats_registry = CollectorRegistry()  # this engine's series alone
        self.stats = make_stats_recorder(self.config, self.stats_registry) if log_stats else None

    def add_request(self, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams | PoolingParams, request_id: str | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None,
                    mm_features: list[MultiModalFeature] | None = None) -> str:
        """Queue one prompt. `mm_features`: its media items, already processed with
        `pagoda.multimodal.processing.process_prompt` (which expanded `prompt_token_ids`)."""
        mm_features = list(mm_features or [])
        self.core.sleep.check_awake()  # before any bookkeeping: nothing to undo
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("Either a prompt or prompt_token_ids is required.")
            prompt_token_ids = self.tokenizer.encode(prompt)
        request_id = request_id or str(next(self._ids))
        if isinstance(params, PoolingParams):
            request = EngineCoreRequest(request_id, list(prompt_token_ids), PREFILL_ONLY,
                                        cache_salt=cache_salt, pooling_params=params,
                                        priority=priority)
            check_request(request, self.config)
            self._add_core_request(request)
            self._pooling[request_id] = (list(prompt_token_ids), params)
            return request_id
        if mm_features and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be used with multi-modal data "
                             "(it would cut an image's placeholder run)")
        prompt_token_ids, params = apply_prompt_fields(prompt_token_ids, params, self.tokenizer,
                                                       self.config.scheduler.max_model_len,
                                                       self.config.arch.vocab_size)
        eos = self.config.arch.eos_token_ids
        # The n children differ only in their ids and seeds: one check covers them all.
        check_request(EngineCoreRequest(request_id, list(prompt_token_ids), params, eos,
                                        cache_salt=cache_salt, priority=priority,
                                        lora_request=lora_request, mm_features=mm_features),
                      self.config)
        parent = ParentRequest(request_id, prompt, list(prompt_token_ids), params)
        child_ids = self.output_processor.add_request(parent)
        try:  # the scheduler still refuses a duplicate id or a grammar it cannot compile
            for index, child_id in enumerate(child_ids):
                child_params = params
                if params.n > 1 and params.seed is not None:
                    child_params = params.clone(seed=params.seed + index)
                self._add_core_request(EngineCoreRequest(child_id, parent.prompt_token_ids,
                                                         child_params, eos,
                                                         cache_salt=cache_salt,
                                                         priority=priority,
                                                         lora_request=lora_request,
                                                         mm_features=mm_features))
        except ValueError:
            self.core.abort_requests(child_ids)
            for child_id in child_ids:
                self.output_processor.children.pop(child_id, None)
            raise
        return request_id

    def _add_core_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)
        if self.stats is not None:
            self.stats.on_add(request)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        step_start = time.time()
        core_outputs = self.core.step()
        # Nothing consumes the block pool's KV events offline (a scheduler service ships
        # them): drop them each step so the list does not grow for the engine's lifetime.
        self.core.take_kv_events()
        if self.stats is not None:
            self.stats.on_step(self.core, step_start, core_outputs)
        failed = {**self.core.take_rejected(), **self.core.take_invalid()}
        for request_id, why in failed.items():  # they end "abort"
            logger.warning("request %s failed: %s", request_id, why)
        pooled = self._pooled_outputs(core_outputs)
        finished, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.core.scheduler.finish_requests(to_abort, FinishReason.STOP)
        return pooled + finished

    def _pooled_outputs(self, core_outputs) -> list[PoolingRequestOutput]:
        """The pooling requests that finished (an aborted one has no vector: dropped)."""
        results = []
        for out in core_outputs:
            if out.request_id not in self._pooling or not out.finished:
                continue
            prompt_token_ids, params = self._pooling.pop(out.request_id)
            if out.pooling_output is not None:
                data = torch.tensor(out.pooling_output)
                if params.task in TOKEN_TASKS:  # one row per prompt token
                    data = data.reshape(len(prompt_token_ids), -1)
                results.append(PoolingRequestOutput(
                    out.request_id, PoolingOutput(data), prompt_token_ids,
                    out.num_cached_tokens))
        return results

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or bool(self._pooling)

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_metrics(self) -> list[Metric]:
        """vLLM's metric objects, from this engine's own stats (`log_stats`)."""
        if self.stats is None:
            raise ValueError("Stat logging is disabled: create the LLM with "
                             "disable_log_stats=False to read its metrics.")
        return get_metrics_snapshot(self.stats_registry)


def make_stats_recorder(config, registry: CollectorRegistry) -> EngineStatsRecorder:
    """vLLM's metrics for one offline engine, in `registry` (several engines in one
    process never share series), set up as the scheduler service sets up its own."""
    metrics = EngineMetrics(config.served_model_name[0], config.scheduler.max_model_len,
                            registry=registry)
    metrics.log_cache_config(config.cache.block_size, config.cache.num_blocks,
                             config.cache.enable_prefix_caching,
                             config.cache.gpu_memory_utilization)
    if config.lora is not None:
        metrics.log_lora_config(config.lora.max_loras)
    spec = config.scheduler.speculative_config
    if spec is not None:
        metrics.log_spec_config(spec.num_speculative_tokens)
    return EngineStatsRecorder(metrics)


def apply_prompt_fields(prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                        max_model_len: int, vocab_size: int) -> tuple[list[int], SamplingParams]:
    """What the gateway does where it tokenizes, done here for offline requests:
    `truncate_prompt_tokens` keeps the prompt's last tokens, `bad_words` become
    `bad_words_token_ids` (`check_request` then checks the request once)."""
    prompt_token_ids = truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens,
                                       max_model_len)
    if params.bad_words and params.bad_words_token_ids is None:
        params = params.clone(bad_words_token_ids=bad_words_token_ids(
            params.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False),
            vocab_size) or None)
    return prompt_token_ids, params

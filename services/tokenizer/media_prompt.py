"""The tokenizer service as the cluster's processor: a chat's media -> features.

`MediaPreprocessor.process` loads a rendered chat's media (URLs through
`pagoda.multimodal.media`, in a thread pool of VLLM_MEDIA_LOADING_THREAD_COUNT so one
request's images load in parallel; image_embeds with `torch.load(weights_only=True)`)
and runs the engine library's `process_prompt`, the function the offline LLM calls:
so served and offline prompts expand and hash identically.

A text-only model refuses media before anything is fetched. Every failure is a
ValueError (a `MediaError` for loading), which the servicer answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagoda import envs
from pagoda.multimodal.media import MediaConnector, MediaLimits
from pagoda.multimodal.processing import (ProcessedPrompt, ProcessorCache, check_mm_limits,
                                          process_prompt, text_only_error)
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services.tokenizer.metrics import tokenizer_metrics


class LockedProcessorCache(ProcessorCache):
    """The library's processor cache behind a lock: the service's RPC threads share it."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._lock = threading.Lock()

    def get(self, identifier: str):
        with self._lock:
            return super().get(identifier)

    def put(self, identifier: str, data) -> None:
        with self._lock:
            super().put(identifier, data)


class MediaPreprocessor:
    """Loads media and runs the model's processor. `processor` None: a text-only model."""

    def __init__(self, processor: Any, architecture: str | Callable[[], str], model: str,
                 limits: MediaLimits | None = None,
                 limit_mm_per_prompt: Mapping[str, int] | None = None,
                 cache_gb: float = 4.0,
                 default_kwargs: Mapping[str, Any] | None = None) -> None:
        self.processor = processor
        self._architecture = architecture
        self.model = model
        self.limit_mm_per_prompt = dict(limit_mm_per_prompt or {})
        # --mm-processor-kwargs, under each request's own (the offline LLM's merge, so
        # the items' identifiers agree between served and offline).
        self.default_kwargs = dict(default_kwargs or {})
        metrics = tokenizer_metrics()
        self.connector = MediaConnector(limits, observer=metrics.observe_media_fetch)
        capacity = int(cache_gb * 2**30) if cache_gb and cache_gb > 0 else 0
        self.cache = LockedProcessorCache(capacity) if capacity and processor else None
        self._pool = ThreadPoolExecutor(envs.get("PAGODA_MEDIA_LOADING_THREAD_COUNT"),
                                        thread_name_prefix="media")

    @property
    def architecture(self) -> str:
        """The model's architecture; given as a callable (a text-only model's, named only
        in its refusal of media), looked up on first use: the lookup imports every model
        class and torch, seconds of CPU a tokenizer replica would spend at start-up."""
        if callable(self._architecture):
            self._architecture = self._architecture()
        return self._architecture

    def process(self, prompt: str, media: Sequence[pb.MediaInput],
                mm_processor_kwargs: Mapping[str, Any] | None, add_special_tokens: bool
                ) -> ProcessedPrompt:
        """Expanded prompt ids + one feature per item (ValueError for bad input)."""
        if self.processor is None:
            raise text_only_error(self.architecture, self.model)
        by_modality: dict[str, list[pb.MediaInput]] = {}
        for item in media:
            by_modality.setdefault(item.modality, []).append(item)
        check_mm_limits(by_modality, self.limit_mm_per_prompt)  # before fetching any
        loaded = {modality: list(self._pool.map(self._load, items))
                  for modality, items in by_modality.items()}
        before = (self.cache.hits, self.cache.queries) if self.cache else (0, 0)
        kwargs = {**self.default_kwargs, **(mm_processor_kwargs or {})}
        processed = process_prompt(self.processor, prompt, loaded, kwargs,
                                   add_special_tokens=add_special_tokens,
                                   limit_mm_per_prompt=self.limit_mm_per_prompt,
                                   cache=self.cache, architecture=self.architecture)
        if self.cache is not None:
            tokenizer_metrics().observe_processor_cache(self.cache.hits - before[0],
                                                        self.cache.queries - before[1])
        return processed

    def _load(self, item: pb.MediaInput) -> Any:
        if item.WhichOneof("source") == "url":
            return self.connector.load_image(item.url)
        embeds = load_embeds(item.embeds, self.connector.limits.max_bytes)
        if item.image_grid_thw:  # the processor checks the rows against the grid
            return {"image_embeds": embeds,
                    "image_grid_thw": load_embeds(item.image_grid_thw,
                                                  self.connector.limits.max_bytes)}
        return embeds


def load_embeds(data: bytes, max_bytes: int) -> Any:
    """An image_embeds part's tensor (torch.save bytes), loaded without running code."""
    import torch  # lazy: the service's CLI parses flags without torch
    if len(data) > max_bytes:
        raise ValueError(f"image_embeds are larger than the limit of {max_bytes} bytes.")
    try:
        tensor = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # pickle and zip errors alike: the client's bytes
        raise ValueError(f"image_embeds could not be loaded as a tensor saved with "
                         f"torch.save ({type(exc).__name__}).") from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("image_embeds must hold one tensor.")
    return tensor.float() if tensor.dtype == torch.float64 else tensor

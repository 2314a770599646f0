"""The offline `LLM`'s media: prompts with `multi_modal_data` and chats with image parts,
processed by the same function the tokenizer service runs (`process_prompt`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.config import EngineConfig
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.multimodal.processing import (MultiModalProcessor, ProcessorCache, load_mm_processor,
                                          process_prompt, text_only_error)

# (text, token ids, cache salt) as `normalize_prompt` gives, plus the media items.
MediaPrompt = tuple[str | None, list[int], str | None, list[MultiModalFeature]]


class OfflineMedia:
    """One LLM's processor (loaded on first use) and processor cache.

    Invariant: every prompt with media leaves here with expanded token ids and its
    features; a model that takes no media refuses such a prompt by name."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._processor: MultiModalProcessor | None = None
        mm = config.multimodal
        self.cache = ProcessorCache.from_gb(mm.mm_processor_cache_gb) if mm else None

    @property
    def processor(self) -> MultiModalProcessor:
        if self.config.multimodal is None:
            raise text_only_error(self.config.arch.architecture, self.config.model)
        if self._processor is None:
            self._processor = load_mm_processor(self.config.model, self.tokenizer)
        return self._processor

    def process(self, prompt: str | list[int], mm_data: Mapping[str, Any],
                mm_processor_kwargs: Mapping[str, Any] | None, salt: str | None,
                add_special_tokens: bool = True) -> MediaPrompt:
        mm = self.config.multimodal
        processor = self.processor
        kwargs = {**(mm.mm_processor_kwargs if mm else {}), **(mm_processor_kwargs or {})}
        processed = process_prompt(processor, prompt, mm_data, kwargs,
                                   add_special_tokens=add_special_tokens,
                                   limit_mm_per_prompt=mm.limit_mm_per_prompt, cache=self.cache,
                                   architecture=self.config.arch.architecture)
        text = prompt if isinstance(prompt, str) else None
        return text, processed.prompt_token_ids, salt, processed.mm_features

    def from_prompt_dict(self, prompt: Mapping[str, Any]) -> MediaPrompt:
        """A generate() prompt dict with `multi_modal_data` (vLLM's form)."""
        source = (list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt
                  else prompt.get("prompt"))
        if source is None:
            raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        return self.process(source, prompt["multi_modal_data"],
                            prompt.get("mm_processor_kwargs"), prompt.get("cache_salt"))

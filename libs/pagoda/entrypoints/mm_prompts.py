"""The offline `LLM`'s media: prompts with `multi_modal_data` and chats with image parts,
processed by the same function the tokenizer service runs (`process_prompt`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.config import EngineConfig
from pagoda.multimodal.chat_parts import (extract_media, flatten_placeholders,
                                          template_reads_parts)
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

    def split_chat(self, messages: list[dict[str, Any]]):
        """(the conversation the chat template renders, its media refs in prompt order).
        A conversation without media parts comes back unchanged with no refs."""
        mm = self.config.multimodal
        chat = extract_media(messages, mm.limit_mm_per_prompt if mm else None, allow_pil=True)
        if not chat.media:
            return messages, []
        processor = self.processor  # a text-only model refuses here, by name
        conversation = chat.messages
        if not template_reads_parts(getattr(self.tokenizer, "chat_template", None)):
            texts = {m: self.tokenizer.convert_ids_to_tokens(t)
                     for m, t in processor.placeholder_token_ids.items()}
            conversation = flatten_placeholders(conversation, texts)
        return conversation, chat.media

    def load_media(self, refs) -> dict[str, list[Any]]:
        """modality -> items: PIL images as given, URLs through `pagoda.multimodal.media`
        (data: URLs decode locally; http(s) and file:// follow its default allow-lists).
        image_embeds parts are refused: offline, pass the tensor to generate() as
        multi_modal_data."""
        from pagoda.multimodal.media import MediaConnector  # lazy: httpx, only for URLs
        items: dict[str, list[Any]] = {}
        connector = None
        for ref in refs:
            if ref.source == "pil":
                value = ref.value
            elif ref.source == "url":
                connector = connector or MediaConnector()
                value = connector.load_image(ref.value)
            else:
                raise ValueError(f"{ref.where}: image_embeds parts are not taken by LLM.chat; "
                                 "pass the tensor to LLM.generate as multi_modal_data "
                                 "{'image': {'image_embeds': tensor}}")
            items.setdefault(ref.modality, []).append(value)
        return items

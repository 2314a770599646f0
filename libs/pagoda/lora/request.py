"""vLLM's `LoRARequest` (`vllm.lora.request`): which adapter a request runs with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`).

    Invariant: `lora_int_id` >= 1 names one adapter for the life of an engine (0 means
    "no adapter" in vLLM and is refused); two requests with the same id must carry the
    same path. `lora_name` is what the OpenAI API calls the model. The prefix cache
    keys blocks by `cache_key` (name and id; vLLM uses the name alone): an adapter
    reloaded under its old name with a new id never hits the old weights' blocks.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_key(self) -> str:
        return f"{self.lora_name}:{self.lora_int_id}"

    @property
    def adapter_id(self) -> int:  # vLLM's alias
        return self.lora_int_id

    @property
    def name(self) -> str:  # vLLM's alias
        return self.lora_name

    @property
    def path(self) -> str:  # vLLM's alias
        return self.lora_path


def loras_per_prompt(lora: LoRARequest | Sequence[LoRARequest | None] | None,
                     n: int) -> list[LoRARequest | None]:
    """vLLM's rule: one LoRARequest for every prompt, or a list with one per prompt."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"Got {len(lora)} LoRA requests for {n} prompts.")
    return lora

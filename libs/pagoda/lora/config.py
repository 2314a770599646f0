"""vLLM's LoRA engine settings: `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM accepts only these ranks for --max-lora-rank.
SUPPORTED_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    """Invariant: 1 <= max_loras <= max_cpu_loras; every loaded adapter's rank is at
    most `max_lora_rank` (the device stacks are sized by it).

    max_loras: adapters resident on the device at once (the distinct adapters one step
        may use); max_cpu_loras: adapters kept loaded in host memory (LRU).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in SUPPORTED_MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank ({self.max_lora_rank}) must be one of "
                             f"{SUPPORTED_MAX_LORA_RANKS}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

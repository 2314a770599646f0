"""Custom logits processors for the tests, importable by name (--logits-processors)."""

from __future__ import annotations

import torch

from pagoda.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


class BanTokenProcessor(LogitsProcessor):
    """Bans `extra_args["ban_token_id"]` in the rows of requests that set it (vLLM's
    DummyLogitsProcessor shape): per-row state kept by persistent index."""

    instances: list["BanTokenProcessor"] = []

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.banned: dict[int, int] = {}
        self.updates: list[BatchUpdate] = []
        BanTokenProcessor.instances.append(self)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        value = (sampling_params.extra_args or {}).get("ban_token_id")
        if value is not None and not isinstance(value, int):
            raise ValueError(f"ban_token_id must be an integer, got {value!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.updates.append(batch_update)
        for index in batch_update.removed:
            self.banned.pop(index, None)
        for index, params, _, _ in batch_update.added:
            token = (params.extra_args or {}).get("ban_token_id")
            if token is None:
                self.banned.pop(index, None)
            else:
                self.banned[index] = token
        for a, b, direction in batch_update.moved:
            a_value, b_value = self.banned.pop(a, None), self.banned.pop(b, None)
            if a_value is not None:
                self.banned[b] = a_value
            if direction == MoveDirectionality.SWAP and b_value is not None:
                self.banned[a] = b_value

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, token in self.banned.items():
            logits[row, token] = float("-inf")
        return logits


class BatchSizeRecorder(LogitsProcessor):
    """Argmax-invariant: checks that batch_size always equals the logits' rows."""

    mismatches: list[tuple[int, int]] = []
    applied = 0

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.size = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        if batch_update is not None:
            self.size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        BatchSizeRecorder.applied += 1
        if logits.shape[0] != self.size:
            BatchSizeRecorder.mismatches.append((logits.shape[0], self.size))
        return logits

"""Sleep mode on one rank (vLLM's `LLM.sleep` / `wake_up`): give back the memory of
the KV cache and of the weights while the engine is idle, and take it again.

- level 1: the KV cache is freed; the weights leave the device for a host copy
  (on a CUDA rank a copy in CPU memory; on a CPU rank the device *is* the host, so the
  host copy is the weights' own storage, kept aside). `wake_up` puts them back: the
  model computes exactly what it did before.
- level 2: the KV cache and the weights are freed. `wake_up(["weights"])` allocates the
  weights again with undefined contents; they must be loaded (`update_weights`, or
  `reload_weights` from the checkpoint) before the engine serves again.

Invariant: while a tag is asleep, no tensor of it holds storage on the device:
every parameter's `.data` is an empty tensor (the modules keep their Parameter
objects, so tied weights and layers' references stay valid), and `runner.kv_caches`
is empty. Buffers (rotary tables) are small and stay.
"""

from __future__ import annotations

import gc

import torch

from pagoda.worker import cpu_allocator

TAGS = ("weights", "kv_cache")


class SleepState:
    """What one rank put to sleep, and how to bring it back."""

    def __init__(self) -> None:
        self.level = 0  # of the last `sleep`; 0: never slept
        self.asleep: set[str] = set()  # tags whose memory is given back
        # level 2 woke the weights up as fresh, undefined storage: load them first
        self.weights_need_loading = False
        self._num_blocks: int | None = None
        self._host: dict[str, torch.Tensor] = {}  # level 1: name -> host copy
        self._meta: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}

    def sleep(self, runner, level: int) -> None:
        """Free the KV cache and (level 1) offload or (level 2) discard the weights.
        Sleeping while asleep is refused: the first sleep's level decides what waking
        up restores."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise RuntimeError("The engine is already sleeping; call wake_up() first")
        # Not kv_caches[0]'s length: a hybrid model's first layer may be a state pool.
        self._num_blocks = runner.num_kv_blocks if runner.kv_caches else None
        runner.kv_caches = []
        runner.cuda_graphs = None  # captured over the freed cache
        if runner.drafter is not None:
            runner.drafter.kv_caches = []
        self._meta, self._host = {}, {}
        for name, param in runner.model.named_parameters():
            data = param.data
            self._meta[name] = (data.shape, data.dtype, data.device)
            if level == 1:
                self._host[name] = data if data.device.type == "cpu" else data.to("cpu")
            param.data = torch.empty(0, dtype=data.dtype, device=data.device)
        data = None  # the last parameter's storage: not kept alive here
        self.level, self.asleep = level, set(TAGS)
        _release(runner.device)

    def wake_up(self, runner, tags: list[str] | None = None) -> None:
        """Take back the memory of `tags` (default: both); a tag already awake is left
        alone. The KV cache comes back zeroed (its contents were lost)."""
        tags = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"Unknown wake_up tags {unknown}; expected any of {list(TAGS)}")
        if "weights" in tags and "weights" in self.asleep:
            for name, param in runner.model.named_parameters():
                shape, dtype, device = self._meta[name]
                host = self._host.pop(name, None)
                param.data = (host.to(device) if host is not None
                              else torch.empty(shape, dtype=dtype, device=device))
            self.weights_need_loading = self.level == 2
            self._host, self._meta = {}, {}
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            if self._num_blocks is not None:
                runner.initialize_kv_cache(self._num_blocks)
            self.asleep.discard("kv_cache")

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:  # a freed tensor may sit in the heap's free lists, not yet given back
        cpu_allocator.give_back_free_memory()

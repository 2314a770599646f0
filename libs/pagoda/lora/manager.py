"""The worker's adapters: a host-memory LRU of loaded adapters and a device LRU of slots.

    LoRARequest --load (max_cpu_loras, LRU)--> LoRAModel --activate (max_loras)--> slot s
                                                                     writes every layer's stacks

`prepare_step` maps each row of the step to its adapter's slot (activating adapters not
resident, evicting the least recently used one the step does not need) and publishes the
`LoRABatch` every adapted layer reads. Rows without an adapter get -1 and run the base
model unchanged.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagoda.lora.adapter import LoRAModel, load_lora_model
from pagoda.lora.config import LoRAConfig
from pagoda.lora.layers import LoRAContext, LoRALinear
from pagoda.lora.ops import LoRABatch
from pagoda.lora.request import LoRARequest
from pagoda.model.parallel_layers import ColumnParallelLinear, RowParallelLinear
from pagoda.model.weight_names import packed_modules

# The projections PEFT adapts in Llama-family models, by our (fused) module names.
SUPPORTED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAModelManager:
    """Invariant: `slots` maps at most `max_loras` adapter ids to distinct slots, and each
    slot's stacks hold that adapter's weights in every adapted layer; `cpu_cache` holds
    at most `max_cpu_loras` loaded adapters."""

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.device, self.dtype = device, dtype
        self.packed = packed_modules(model)
        self.context = LoRAContext()
        self.layers: dict[str, LoRALinear] = {}
        for name, module in model.named_modules():
            if (name.rsplit(".", 1)[-1] in SUPPORTED_MODULES
                    and isinstance(module, (ColumnParallelLinear, RowParallelLinear))):
                module.lora = LoRALinear(module, self.context, config.max_loras,
                                         config.max_lora_rank, device, dtype)
                self.layers[name] = module.lora
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()
        self.paths: dict[int, str] = {}
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first

    # ------------------------------------------------------------------ host memory
    def add_adapter(self, request: LoRARequest) -> LoRAModel:
        """Load (or touch) an adapter in the host cache, evicting the LRU one beyond
        `max_cpu_loras` (never one resident in a slot)."""
        known = self.paths.get(request.lora_int_id)
        if known is not None and request.lora_path and known != request.lora_path:
            raise ValueError(f"LoRA id {request.lora_int_id} is already {known!r}, not "
                             f"{request.lora_path!r}")
        if request.lora_int_id in self.cpu_cache:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return self.cpu_cache[request.lora_int_id]
        lora = load_lora_model(request.lora_int_id, request.lora_path, self.packed,
                               self.config.max_lora_rank, self.dtype)
        unknown = [m for m in lora.weights if m.rsplit(".", 1)[-1] not in SUPPORTED_MODULES]
        if unknown:
            raise ValueError(f"LoRA {request.lora_name}: unsupported target modules "
                             f"{sorted({m.rsplit('.', 1)[-1] for m in unknown})}")
        self.cpu_cache[request.lora_int_id] = lora
        self.paths[request.lora_int_id] = request.lora_path
        while len(self.cpu_cache) > self.config.max_cpu_loras:
            victim = next((i for i in self.cpu_cache if i not in self.slots), None)
            if victim is None:
                break
            del self.cpu_cache[victim]
        return lora

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (host and device). False if it was not loaded."""
        found = self.cpu_cache.pop(lora_int_id, None) is not None
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.set_slot(slot, None)
        self.paths.pop(lora_int_id, None)
        return found or slot is not None

    def list_adapters(self) -> list[int]:
        return list(self.cpu_cache)

    # ------------------------------------------------------------------ device slots
    def activate(self, request: LoRARequest, pinned: set[int]) -> int:
        """The slot of `request`'s adapter, writing it into the LRU free slot if absent.
        `pinned` adapters (the step's others) are never evicted."""
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return self.slots[lora_id]
        used = set(self.slots.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slots if i not in pinned), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than max_loras={self.config.max_loras} "
                                   f"adapters")
            slot = self.slots.pop(victim)
        # Loaded after the eviction, so the evicted adapter may leave the host cache too.
        lora = self.add_adapter(request)
        for name, layer in self.layers.items():
            layer.set_slot(slot, lora.weights.get(name))
        self.slots[lora_id] = slot
        return slot

    def prepare_step(self, row_requests: list[tuple[LoRARequest | None, int]]) -> None:
        """Publish the step's row -> slot map: `row_requests` lists, in row order, each
        request's adapter (or None) and its number of rows this step."""
        pinned = {r.lora_int_id for r, _ in row_requests if r is not None}
        slots: list[int] = []
        for request, num_rows in row_requests:
            slot = -1 if request is None else self.activate(request, pinned)
            slots.extend([slot] * num_rows)
        self.context.batch = None if not pinned else LoRABatch.from_slots(slots, self.device)

"""Pack a loaded model's bf16 CPU linear weights for oneDNN (see `cpu_packed_weights`).

Kept apart from `cpu_packed_weights`, which the linear methods and the LM head call on
every product: walking a model needs the layer classes, which import those methods.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagoda.model.cpu_packed_weights import pack
from pagoda.model.parallel_layers import ParallelLMHead
from pagoda.model.quantization.base import UnquantizedLinearMethod
from pagoda.model.quantization.gguf_int4 import logits_head

logger = logging.getLogger(__name__)


def _packable(weight: object) -> bool:
    return (isinstance(weight, torch.Tensor) and not weight.is_mkldnn and weight.dim() == 2
            and weight.device.type == "cpu" and weight.dtype == torch.bfloat16)


def _multiplies_plain_weight(method: object) -> bool:
    """The layer's method ends in `UnquantizedLinearMethod.apply` (directly, or as the
    large-step half of GGUF's small-step int4 method)."""
    return type(method) is UnquantizedLinearMethod \
        or type(getattr(method, "base", None)) is UnquantizedLinearMethod


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every unquantized bf16 CPU linear layer of `model` and its LM head (the
    invariants are in `cpu_packed_weights`' docstring); returns the number of tensors
    packed (0 the second time)."""
    packed = 0
    for module in model.modules():
        if _multiplies_plain_weight(getattr(module, "quant_method", None)) \
                and _packable(getattr(module, "weight", None)):
            module.weight = nn.Parameter(pack(module.weight), requires_grad=False)
            packed += 1
    head = logits_head(model)
    if head is not None and _packable(head.weight) and "packed_weight" not in head._buffers:
        if _reads_plain_table(head):
            head.register_buffer("packed_weight", pack(head.weight), persistent=False)
        else:
            head.weight = nn.Parameter(pack(head.weight), requires_grad=False)
        packed += 1
    logger.info("CPU bf16: %d weights prepacked for oneDNN", packed)
    return packed


def _reads_plain_table(head: nn.Module) -> bool:
    """The head also looks tokens up (a tied embedding); a `ParallelLMHead`, untied or
    a last pipeline stage's copy of the tied embedding, is only multiplied by."""
    return not isinstance(head, ParallelLMHead)

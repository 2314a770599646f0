"""What one pipeline stage hands the next (vLLM's `IntermediateTensors`).

Shared by every architecture, the model runner (profiling a later stage on zeros)
and the pipeline runner (send/recv between stages), so it lives apart from any model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class IntermediateTensors(NamedTuple):
    """The residual stream leaving a stage, not yet summed.

    Invariant: `hidden` and `residual` have the same shape [T, hidden_size] and dtype;
    the next stage's first norm adds them (the fused residual add of `RMSNorm`).
    """

    hidden: torch.Tensor  # [T, hidden_size]
    residual: torch.Tensor  # [T, hidden_size]

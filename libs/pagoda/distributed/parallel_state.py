"""Where a rank sits in its worker group: tensor- and pipeline-parallel coordinates.

A group of `T x P` ranks serves one model replica. Ranks are numbered stage by
stage, tensor-parallel ranks contiguous (vLLM's layout)::

    rank = pp_rank * T + tp_rank          T=2, P=2:   stage 0: ranks 0 1
                                                      stage 1: ranks 2 3

Stage s runs the contiguous layer range `stage_layer_range(L, P, s)`; the first
stage embeds tokens, the last applies the final norm and the LM head. Rank 0 is
the driver: it serves the scheduler's step calls and broadcasts each plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.config import ModelArchConfig


@dataclass(frozen=True)
class ParallelContext:
    """One rank's coordinates and the process groups it talks through.

    Invariant: `tp_group` is set exactly when `tp_size > 1` and `pp_group` exactly
    when `pp_size > 1`; with both sizes 1 no collective is ever issued, so the
    single-device path is the plain model. `pp_group` spans the whole world
    (stage-to-stage sends address global ranks). `enable_expert_parallel` (vLLM's
    flag) places a mixture-of-experts layer's experts whole on the TP ranks instead
    of splitting every expert across them (`expert_range`).
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's TP ranks
    pp_group: Any = None  # world group for point-to-point sends between stages
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        """The rank whose step result goes back to the scheduler: last stage, TP rank 0."""
        return (self.pp_size - 1) * self.tp_size

    @property
    def prev_rank(self) -> int:
        """Same TP rank in the previous stage (first stage: undefined)."""
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        """Same TP rank in the next stage (last stage: undefined)."""
        return self.rank + self.tp_size


SINGLE = ParallelContext()


def expert_range(num_experts: int, parallel: ParallelContext) -> tuple[int, int]:
    """[start, end) of the experts this rank holds whole (all of them without expert
    parallelism). Split as evenly as possible, the first `E % T` ranks one more."""
    if not parallel.enable_expert_parallel:
        return 0, num_experts
    return stage_layer_range(num_experts, parallel.tp_size, parallel.tp_rank)


def rank_coordinates(rank: int, tp_size: int) -> tuple[int, int]:
    """Global rank -> (pp_rank, tp_rank)."""
    return rank // tp_size, rank % tp_size


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Contiguous [start, end) of decoder layers for stage `pp_rank`.

    Layers are split as evenly as possible; the first `num_layers % pp_size` stages
    take one extra layer, since the last stage also runs the LM head and sampler.
    """
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def num_local_heads(arch: ModelArchConfig, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) one TP rank holds. With fewer KV heads than ranks,
    each rank holds one KV head, replicated across `tp_size // num_kv_heads` ranks."""
    return (arch.num_attention_heads // tp_size,
            max(1, arch.num_key_value_heads // tp_size))


def kv_head_start(num_kv_heads: int, tp_size: int, tp_rank: int) -> int:
    """Index of the first KV head of the checkpoint that `tp_rank` holds."""
    num_kv = num_kv_heads
    if num_kv >= tp_size:
        return tp_rank * (num_kv // tp_size)
    return tp_rank // (tp_size // num_kv)


def validate_parallel_config(arch: ModelArchConfig, tp_size: int, pp_size: int,
                             enable_expert_parallel: bool = False) -> None:
    """Reject a split the model cannot take, before any process starts (vLLM's wording)."""
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tensor_parallel_size ({tp_size}) and pipeline_parallel_size "
                         f"({pp_size}) must be positive.")
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % tp_size:
        raise ValueError(f"Total number of attention heads ({heads}) must be divisible by "
                         f"tensor parallel size ({tp_size}).")
    if kv_heads >= tp_size and kv_heads % tp_size:
        raise ValueError(f"Total number of key-value heads ({kv_heads}) must be divisible by "
                         f"tensor parallel size ({tp_size}).")
    if kv_heads < tp_size and tp_size % kv_heads:
        raise ValueError(f"Tensor parallel size ({tp_size}) must be divisible by the total "
                         f"number of key-value heads ({kv_heads}).")
    if arch.intermediate_size % tp_size:
        raise ValueError(f"Intermediate size ({arch.intermediate_size}) must be divisible by "
                         f"tensor parallel size ({tp_size}).")
    moe_inter = arch.moe.intermediate_size if arch.moe else 0
    if moe_inter and not enable_expert_parallel and moe_inter % tp_size:
        raise ValueError(f"MoE intermediate size ({moe_inter}) must be divisible by tensor "
                         f"parallel size ({tp_size}) without expert parallelism.")
    # With expert parallelism every rank needs an expert. On a dense model vLLM ignores
    # the flag; Pagoda refuses it, so a command line never claims a split it does not do.
    if enable_expert_parallel and arch.moe is None:
        raise ValueError(f"--enable-expert-parallel: {arch.architecture} is a dense model, "
                         "with no MoE experts to place on ranks; drop the flag (it applies "
                         "to MoE architectures: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, "
                         "gpt-oss)")
    num_experts = arch.moe.num_experts if arch.moe else 0
    if enable_expert_parallel and 0 < num_experts < tp_size:
        raise ValueError(f"Number of experts ({num_experts}) must be at least the "
                         f"tensor parallel size ({tp_size}).")
    if pp_size > arch.num_hidden_layers:
        raise ValueError(f"Pipeline parallel size ({pp_size}) must not exceed the number of "
                         f"hidden layers ({arch.num_hidden_layers}).")

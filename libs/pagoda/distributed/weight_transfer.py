"""Weight transfer for RL loops: a trainer broadcasts named tensors to every rank
of an inference engine (vLLM's NCCL weight-transfer protocol, with gloo on CPU).

    trainer (rank 0) ──broadcast, one tensor per name, in order──► engine ranks
                                                                   rank_offset .. rank_offset+N-1

Both sides join one process group on the trainer's TCPStore at
`master_address:master_port` (the trainer hosts it): the trainer with
`trainer_init`, the engine with `LLM.init_weight_transfer_engine({"init_info":
{master_address, master_port, rank_offset, world_size}})`, at the same time (each
blocks until the whole group has joined). Then each round: the engine's
`update_weights({"update_info": {names, dtype_names, shapes}})` and the trainer's
`trainer_send_weights` over the same tensors in the same order.

The backend is NCCL for CUDA tensors and gloo for CPU ones (`backend` below).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Iterable

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
_PREFIX = "pagoda-weight-transfer"
DEFAULT_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class WeightTransferInitInfo:
    """vLLM's NCCLWeightTransferInitInfo: where the trainer's store listens, this
    engine's first rank in the group, and the group's size (trainer included)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int

    @classmethod
    def parse(cls, raw: dict) -> "WeightTransferInitInfo":
        return cls(**_fields(cls, raw, "init_info"))


@dataclasses.dataclass(frozen=True)
class WeightTransferUpdateInfo:
    """vLLM's NCCLWeightTransferUpdateInfo: the tensors of one round, in the order the
    trainer sends them. `packed` (batched buffers) is vLLM's NCCL optimisation, not
    implemented: False only."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False

    @classmethod
    def parse(cls, raw: dict) -> "WeightTransferUpdateInfo":
        info = cls(**_fields(cls, raw, "update_info"))
        if not (len(info.names) == len(info.dtype_names) == len(info.shapes)):
            raise ValueError("update_info: names, dtype_names and shapes must have the same "
                             f"length (got {len(info.names)}, {len(info.dtype_names)}, "
                             f"{len(info.shapes)})")
        if info.packed:
            raise ValueError("update_info.packed: packed transfer is not supported; send "
                             "each tensor on its own (packed=False)")
        for name, dtype in zip(info.names, info.dtype_names):
            torch_dtype(dtype, f"update_info.dtype_names ({name})")
        return info


def _fields(cls, raw: dict, what: str) -> dict:
    if not isinstance(raw, dict):
        raise TypeError(f"{what} must be a dict, got {type(raw).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; expected {sorted(names)}")
    return raw


def torch_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """"float32" or "torch.float32" -> torch.float32; ValueError naming `what` else."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what}: unknown dtype {name!r}")
    return dtype


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def join(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
         is_master: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> "TransferGroup":
    """One member of the transfer group; blocks until all `world_size` have joined.
    The trainer (rank 0) hosts the store."""
    if backend not in BACKENDS:
        raise ValueError(f"weight transfer backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=is_master,
                          timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(_PREFIX, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return TransferGroup(group, store)


@dataclasses.dataclass
class TransferGroup:
    """The trainer's and engine ranks' process group, and the store it was formed on
    (kept alive with it)."""

    group: Any
    store: Any


def broadcast(tensor: torch.Tensor, group: TransferGroup, src: int = 0) -> torch.Tensor:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.group.broadcast([tensor], opts).wait()
    return tensor


def receive_weights(info: WeightTransferUpdateInfo, group, device) -> Iterable[tuple[str, torch.Tensor]]:
    """The engine's side of one round: (name, tensor) as each arrives from rank 0."""
    for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes):
        out = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=device)
        yield name, broadcast(out, group)


def trainer_init(init_info: dict, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S):
    """The trainer's side of `init_weight_transfer_engine` (vLLM's
    `NCCLWeightTransferEngine.trainer_init`): host the store and join as rank 0.
    `init_info`: master_address, master_port, world_size."""
    return join(init_info["master_address"], int(init_info["master_port"]), 0,
                int(init_info["world_size"]), backend, is_master=True, timeout_s=timeout_s)


def trainer_send_weights(iterator: Iterable[tuple[str, torch.Tensor]], group, src: int = 0) -> None:
    """The trainer's side of one `update_weights` round: broadcast each tensor, in the
    order of the round's `names`."""
    for _, tensor in iterator:
        broadcast(tensor.detach().contiguous(), group, src)


def update_info_for(named: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """The `update_info` describing `named` tensors, in order."""
    named = list(named)
    return {"names": [n for n, _ in named],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}

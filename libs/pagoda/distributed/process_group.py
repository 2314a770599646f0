"""Joining a worker group: one TCPStore at the driver, explicit process groups per rank.

The groups are built directly from a store (no `init_process_group`, no global
state), so a process can drive one group, drop it, and build another:

    control   gloo over all ranks, CPU tensors: plans and results. It waits without
              a deadline, since followers sit in it while the replica is idle; a
              dead peer still fails it at once (gloo sees the socket close).
    world     gloo on CPU, NCCL on CUDA: stage-to-stage hidden states (P > 1).
    tp<s>     the same backend over stage s's T ranks: all-reduce, all-gather (T > 1).

A rank that fails writes its traceback under `error/<rank>` in the store before it
exits, so the driver can say what went wrong, not only that a peer vanished.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagoda.distributed.parallel_state import ParallelContext, rank_coordinates

# Followers wait in the control group between steps for as long as the replica is idle.
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class GroupInit:
    """What every rank needs to join: where the driver's store listens, and the shape."""

    master_addr: str
    master_port: int
    tp_size: int
    pp_size: int
    device_type: str  # "cpu" -> gloo, "cuda" -> NCCL for tensor traffic
    timeout_s: float = 600.0  # one collective's deadline (a dead peer fails it sooner)
    # The group's life: 0 at start-up, one more each time the driver rebuilds it after
    # a failure (each life has its own store and port, so no rank of an old life joins).
    generation: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


@dataclass
class GroupHandles:
    """A rank's membership: its coordinates with the tensor groups, plus the control group."""

    parallel: ParallelContext
    control: object  # gloo backend over all ranks


def create_master_store(addr: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The driver's store on a free port of `addr`, and of `addr` only (read the port
    back from `.port`). TCPStore would listen on every interface; so the listening
    socket is bound here, to the one address the ranks are told, and handed over."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((addr, 0))
        sock.listen(max(128, world_size))
        port = sock.getsockname()[1]
        store = dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store


def connect_store(init: GroupInit) -> dist.TCPStore:
    return dist.TCPStore(init.master_addr, init.master_port, init.world_size, is_master=False,
                         timeout=init.timeout)


def _backend(store, prefix: str, rank: int, size: int, device_type: str,
             timeout: datetime.timedelta):
    store = dist.PrefixStore(prefix, store)
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def pair_group(store, name: str, rank: int, device_type: str,
               timeout: datetime.timedelta):
    """A two-rank group on `store` under `name` (NCCL on CUDA, gloo on CPU), outside
    any worker group: what two gpu-workers move KV blocks through
    (PagodaDistConnector). Blocks until the other rank has joined or `timeout`."""
    return _backend(store, name, rank, 2, device_type, timeout)


def join_group(store, init: GroupInit, rank: int) -> GroupHandles:
    """Build this rank's groups; blocks until every rank of each group has joined."""
    pp_rank, tp_rank = rank_coordinates(rank, init.tp_size)
    store.set(f"joined/{rank}", "1")
    control = _backend(store, "control", rank, init.world_size, "cpu", _CONTROL_TIMEOUT)
    tp_group = pp_group = None
    if init.tp_size > 1:
        tp_group = _backend(store, f"tp{pp_rank}", tp_rank, init.tp_size, init.device_type,
                            init.timeout)
    if init.pp_size > 1:
        pp_group = _backend(store, "world", rank, init.world_size, init.device_type, init.timeout)
    parallel = ParallelContext(init.tp_size, tp_rank, init.pp_size, pp_rank, tp_group, pp_group)
    return GroupHandles(parallel, control)


def leave_group(parallel: ParallelContext, control) -> None:
    """Abort this rank's groups (after a peer failed): nothing of them is used again,
    and an NCCL communicator with a dead peer must be aborted, not destroyed while
    it waits. Best effort: a group that cannot abort is dropped all the same."""
    for group in (parallel.tp_group, parallel.pp_group, control):
        if group is not None:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - already broken; nothing more to release
                pass


def joined_ranks(store, world_size: int) -> list[int]:
    return [r for r in range(world_size) if store.check([f"joined/{r}"])]


def record_error(store, rank: int, text: str) -> None:
    """Best effort: the store may already be gone with the driver."""
    try:
        store.set(f"error/{rank}", text[-8000:])
    except Exception:  # noqa: BLE001 - nothing more to do for a dying rank
        pass


def recorded_errors(store, world_size: int) -> dict[int, str]:
    errors = {}
    for r in range(world_size):
        key = f"error/{r}"
        try:
            if store.check([key]):
                errors[r] = store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            break
    return errors


# What gloo raises at a rank whose peer died: the consequence of a failure, not its cause.
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_peer_loss(text: str) -> bool:
    return any(marker in text for marker in _PEER_LOSS)


def brief_error(text: str) -> str:
    """The last line of a traceback, without gloo's source location and advice."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else text
    line = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", line)
    return line.split(". This is typically")[0]


def configure_device(device_type: str, local_index: int, world_size: int) -> None:
    """Pin a rank to its device: its GPU, or its share of the CPU cores."""
    if device_type == "cuda":
        torch.cuda.set_device(local_index)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

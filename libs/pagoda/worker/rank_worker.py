"""One rank of a worker group, and the loop a follower rank runs.

Rank 0 lives in the driver's process (`pagoda.executor.group`); ranks 1..N-1 run
`serve_follower` in a Ray actor or in a child process (`pagoda.executor.multiproc`).
Every call reaches every rank in the same order: the driver broadcasts
`(method, args)` on the control group, then runs the method itself; each follower
receives it and runs it too.
Methods are collective: whatever a result needs from other ranks travels inside
the method (the smallest KV capacity, the output rank's step result), so only
rank 0's return value matters.

A follower that fails records its traceback in the store and exits at once: its
sockets close, so every peer's pending collective fails within moments instead
of waiting for a timeout, and the driver can report the cause.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import sys
import traceback
import typing

import torch

from pagoda.config import EngineConfig
from pagoda.kv_transfer.block_shares import (as_bytes, assemble, block_heads, rank_share,
                                             read_share, runner_geometry, runner_share,
                                             write_share)
from pagoda.messages import ModelRunnerOutput, SchedulerOutput
from pagoda.distributed.communication import (broadcast_bytes, min_over, recv_object,
                                              recv_tensor, send_object, send_tensor)
from pagoda.distributed.wire_codec import WireError, dump, from_json, load, to_json
from pagoda.distributed.process_group import (GroupInit, brief_error, configure_device,
                                              connect_store, is_peer_loss, join_group,
                                              record_error)
import pagoda.fault_injection as fault_injection
from pagoda.parent_death import set_parent_death_signal
from pagoda.worker.parallel_runner import ParallelModelRunner
from pagoda.worker.worker_ops import WorkerOps, rpc_outcome

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
_RESULT_TAG = 7  # control-group tag of the output rank's step result
# What the driver may ask a follower to run: RankWorker's collective methods. A call's
# arguments travel typed by the method's own annotations (wire_codec), never pickled.
CALLS = ("load_model", "determine_num_blocks", "initialize_kv_cache", "reset",
         "execute_model", "memory_report", "export_kv_blocks", "import_kv_blocks",
         "collective_rpc")
_KV_TAG = 8  # control-group tag of a rank's share of exported KV blocks
_RPC_TAG = 9  # control-group tag of a rank's collective_rpc result
MemoryReport = dict[str, int]


class RankWorker:
    """Invariant: the methods below are called on every rank with the same arguments
    in the same order (the driver's broadcast guarantees it)."""

    def __init__(self, config: EngineConfig, rank: int, init: GroupInit, store,
                 local_device_index: int) -> None:
        configure_device(init.device_type, local_device_index, init.world_size)
        self.rank = rank
        self.store = store
        self.generation = init.generation
        self.steps = 0  # execute_model calls since it joined (an injected fault names it)
        handles = join_group(store, init, rank)
        self.parallel = handles.parallel
        self.control = handles.control
        self.runner = ParallelModelRunner(config, self.parallel)
        self.ops = WorkerOps(self.runner, rank)
        # Rank 0 only: the bytes `import_kv_blocks` broadcasts, set by the driver just
        # before the call (KV bytes never travel as a call's typed arguments).
        self.kv_payload: bytes | None = None

    def load_model(self) -> None:
        """Load this rank's share; returns once every rank has (so a rank that cannot
        load fails the group's start-up rather than its first step)."""
        self.runner.load_model()
        min_over(0, self.control)

    def determine_num_blocks(self) -> int:
        """The group's KV capacity: the smallest any rank can hold."""
        return min_over(self.runner.determine_num_blocks(), self.control)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.reset()  # a (re)starting scheduler knows none of the previous requests

    def reset(self) -> None:
        self.runner.reset()

    def execute_model(self, scheduler_output: SchedulerOutput,
                      sampled_token_ids: dict[str, list[int]] | None) -> ModelRunnerOutput | None:
        """Rank 0 returns the step's result, fetched from the output rank if need be."""
        self.steps += 1
        if fault_injection.check("rank.step", rank=self.rank,
                                 generation=self.generation) == "fail":
            raise fault_injection.InjectedFault(
                f"injected fault in rank {self.rank}'s step {self.steps} "
                f"(generation {self.generation}, {fault_injection.ENV})")
        output = self.runner.execute_model(scheduler_output, sampled_token_ids)
        output_rank = self.parallel.output_rank
        if output_rank == 0:
            return output
        if self.rank == output_rank:
            send_object(output, self.control, 0, ModelRunnerOutput, _RESULT_TAG)
        elif self.rank == 0:
            return recv_object(self.control, output_rank, ModelRunnerOutput, _RESULT_TAG)
        return None

    def memory_report(self) -> list[dict[str, int]] | None:
        """Per rank (at rank 0): bytes of parameters and of KV cache it holds."""
        mine = {"rank": self.rank,
                "parameter_bytes": _bytes(self.runner.model.parameters()),
                "kv_cache_bytes": _bytes(t for pair in self.runner.kv_caches for t in pair)}
        if self.rank != 0:
            send_object(mine, self.control, 0, MemoryReport, _RESULT_TAG)
            return None
        world = self.parallel.world_size
        return [mine] + [recv_object(self.control, r, MemoryReport, _RESULT_TAG)
                         for r in range(1, world)]

    def collective_rpc(self, method: str, payload: str) -> list[dict] | None:
        """`method` (a worker_ops name or `callable:module:qualname`) with the JSON
        `payload` {"args", "kwargs"} on every rank. At rank 0: each rank's outcome in
        rank order, {"ok": result} or {"error": why}. A rank's error never fails the
        group (it is the caller's): it is reported, the group goes on."""
        mine = rpc_outcome(self.ops, method, payload, encode=self.rank != 0)
        if self.rank != 0:
            send_object(mine, self.control, 0, str, _RPC_TAG)
            return None
        return [mine] + [json.loads(recv_object(self.control, r, str, _RPC_TAG))
                         for r in range(1, self.parallel.world_size)]

    def export_kv_blocks(self, block_ids: list[int]) -> bytes | None:
        """At rank 0: whole blocks (pagoda.kv_transfer.block_shares), assembled from
        every rank's share, which the others send it on the control group."""
        mine = read_share(self.runner.kv_caches, block_ids).cpu()
        if self.rank != 0:
            send_tensor(mine.contiguous().view(torch.uint8).reshape(-1), self.control, 0,
                        _KV_TAG).wait()
            return None
        shape, _ = runner_geometry(self.runner)
        arch, parallel = self.runner.config.arch, self.parallel
        shares = [(runner_share(self.runner), mine)]
        for rank in range(1, parallel.world_size):
            share = rank_share(arch.num_hidden_layers, block_heads(arch),
                               parallel.tp_size, parallel.pp_size, rank)
            dims = (len(block_ids), share.layer_end - share.layer_start, shape.num_parts,
                    shape.block_size, share.num_heads, shape.head_dim)
            nbytes = math.prod(dims) * mine.element_size()
            raw = recv_tensor((nbytes,), torch.uint8, "cpu", self.control, rank, _KV_TAG)
            shares.append((share, raw.view(shape.dtype).view(dims)))
        return as_bytes(assemble(shape, shares, len(block_ids)))

    def import_kv_blocks(self, block_ids: list[int]) -> None:
        """Every rank writes its share of the whole blocks rank 0 broadcasts."""
        data = broadcast_bytes(self.kv_payload if self.rank == 0 else None, self.control, 0,
                               self.rank)
        self.kv_payload = None
        shape, _ = runner_geometry(self.runner)
        write_share(self.runner.kv_caches, block_ids, shape.blocks(data, len(block_ids)),
                    runner_share(self.runner))


def _argument_types(method: str) -> list:
    hints = typing.get_type_hints(getattr(RankWorker, method))
    hints.pop("return", None)
    return list(hints.values())


def broadcast_call(method: str, args: tuple, control) -> None:
    """The driver's side: every follower runs `method(*args)` next."""
    types = [] if method == SHUTDOWN else _argument_types(method)
    broadcast_bytes(dump({"method": method,
                          "args": [to_json(a, t) for a, t in zip(args, types, strict=True)]}),
                    control, 0, 0)


def receive_call(control, rank: int) -> tuple[str, tuple]:
    """A follower's side: the next (method, args); WireError for anything but a call
    of a known method with arguments of its declared types."""
    raw = load(broadcast_bytes(None, control, 0, rank))
    if not (isinstance(raw, dict) and set(raw) == {"method", "args"}
            and (raw["method"] in CALLS or raw["method"] == SHUTDOWN)
            and isinstance(raw["args"], list)):
        raise WireError("not a worker call")
    method = raw["method"]
    types = [] if method == SHUTDOWN else _argument_types(method)
    if len(raw["args"]) != len(types):
        raise WireError(f"{method} takes {len(types)} arguments")
    return method, tuple(from_json(a, t) for a, t in zip(raw["args"], types))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def serve_follower(config: EngineConfig, rank: int, init: GroupInit,
                   local_device_index: int) -> None:
    """A follower's whole life: join, then run each broadcast call until shutdown.
    Any failure is recorded in the store and ends the process (see module doc)."""
    store = None
    try:
        store = connect_store(init)
        worker = RankWorker(config, rank, init, store, local_device_index)
        while True:
            method, args = receive_call(worker.control, rank)
            if method == SHUTDOWN:
                return
            getattr(worker, method)(*args)
    except BaseException as exc:  # noqa: BLE001 - a rank that cannot go on must not linger
        text = traceback.format_exc()
        if is_peer_loss(str(exc)):  # another rank (or the driver) went first: not the cause
            logger.warning("rank %d lost its group (%s); exiting", rank, brief_error(text))
        else:
            logger.error("rank %d failed:\n%s", rank, text)
        if store is not None:
            record_error(store, rank, text)
        os._exit(1)


def _main() -> None:
    """`python -m pagoda.worker.rank_worker PARENT_PID`: a follower of the mp
    backend, whose (config, rank, init, device index) arrive pickled on stdin. It
    dies with its driver: the parent-death signal is set before it reads or joins
    anything (a driver that died while this module was importing is caught by the
    parent-pid check, see `pagoda.parent_death`)."""
    set_parent_death_signal(int(sys.argv[1]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s rank-worker "
                                                   "%(name)s: %(message)s")
    config, rank, init, device_index = pickle.load(sys.stdin.buffer)
    serve_follower(config, rank, init, device_index)


if __name__ == "__main__":
    _main()

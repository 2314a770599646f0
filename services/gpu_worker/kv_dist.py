"""PagodaDistConnector: KV blocks over a torch.distributed pair group between two
gpu-workers — NCCL on CUDA (device to device, no host copy for a single-rank
worker), gloo on CPU. gRPC carries only the control messages:

    decode worker                                 prefill worker (holds the blocks)
      OpenDistGroup(group_id, epoch)  ──────────►  store on its host, joins as rank 0
      joins as rank 1 through the store ◄───────   (answers the store's port)
      one-byte warm-up recv (tag 0)  ◄─────────   one-byte warm-up send (tag 0)
      recv(tensor, tag) posted, then
      SendBlocks(group_id, ids, tag)  ──────────►  exports the blocks, send(tensor, tag)
      ◄═════════ one tensor of whole blocks (pair group: NCCL / gloo) ═════════

One pair per (source worker, epoch), opened on the first pull and reused; one
transfer at a time per pair (NCCL matches sends and receives by order, not tag).

Failure: a pair whose transfer failed or timed out (a peer died, a stall past the
pull's time limit) is retired and a later pull opens a new one; the failed pull
aborts (UNAVAILABLE, DEADLINE_EXCEEDED) and the decode replica computes the prompt
itself, as with the gRPC transport. A restarted source has a new epoch: pairs of
the old one are never used again (and OpenDistGroup/SendBlocks refuse a stale
epoch). Retired groups are kept referenced, not destroyed: tearing down a group
with a receive still posted may block, and a handful of idle groups costs little.
Integrity rests on the link (TCP checksums for gloo, the fabric's CRC for NCCL);
the gRPC transport adds its own CRC-32 per block.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch
import torch.distributed as dist

from pagoda.distributed.process_group import create_master_store, pair_group
from pagoda.kv_transfer.block_shares import BlockShape
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb

MAX_PAIRS = 64  # groups served or used at once; the oldest idle one is retired first
MAX_RETIRED = 16
SEND_BATCH = 64  # blocks per tensor (~24 MB of SmolLM2's bf16 KV)
logger = logging.getLogger(__name__)


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class _Pair:
    """The decode side's pair with one source worker incarnation."""

    def __init__(self, group, group_id: str) -> None:
        self.group = group
        self.group_id = group_id
        self.lock = threading.Lock()  # one transfer at a time
        self.tags = itertools.count(1)


class DistTransport:
    """Invariant: a pair is used by one transfer at a time, and a pair that failed
    once is never used again."""

    def __init__(self, device: torch.device, bind_host: str) -> None:
        self.device = device
        self.device_type = device.type
        self.bind_host = bind_host
        self._joining = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-dist-join")
        self._served: dict[str, tuple[object, Future]] = {}  # group_id -> (store, group)
        self._pairs: dict[tuple[str, str], _Pair] = {}  # (source address, epoch) -> pair
        self._retired: list[object] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------ serving side
    def open(self, request: pb.OpenDistGroupRequest) -> pb.OpenDistGroupResponse:
        """Start a store and join the pair as rank 0 in the background (joining
        blocks until the caller joins too, so it cannot run in the RPC)."""
        timeout = datetime.timedelta(seconds=request.timeout_s or 30.0)
        store = create_master_store(self.bind_host, 2, timeout.total_seconds())
        joined = self._joining.submit(_join_warm, store, request.group_id, 0,
                                      self.device, timeout)
        with self._lock:
            if len(self._served) >= MAX_PAIRS:
                oldest = next(iter(self._served))
                self._retire(self._served.pop(oldest))
            self._served[request.group_id] = (store, joined)
        return pb.OpenDistGroupResponse(store_port=store.port,
                                        backend=backend_for(self.device_type))

    def send(self, request: pb.SendBlocksRequest, blocks: torch.Tensor) -> int:
        """Send `blocks` on the pair `request.group_id`; LookupError for an unknown
        group, TimeoutError/RuntimeError when the peer does not take them."""
        with self._lock:
            served = self._served.get(request.group_id)
        if served is None:
            raise LookupError(f"no pair group {request.group_id!r} here")
        timeout = request.timeout_s or 30.0
        group = served[1].result(timeout=timeout)
        data = _wire(blocks, self.device_type)
        try:
            group.send([data], 1, request.tag).wait(datetime.timedelta(seconds=timeout))
        except Exception:
            with self._lock:
                if self._served.pop(request.group_id, None) is not None:
                    self._retire(served)
            raise
        return data.numel()

    # ------------------------------------------------------------ pulling side
    def pair(self, source_address: str, source_epoch: str, stub,
             timeout_s: float) -> _Pair:
        """The pair with this source incarnation, opened now if need be."""
        key = (source_address, source_epoch)
        with self._lock:
            pair = self._pairs.get(key)
        if pair is not None:
            return pair
        group_id = f"kv-{uuid.uuid4().hex}"
        reply = stub.OpenDistGroup(pb.OpenDistGroupRequest(
            group_id=group_id, epoch=source_epoch, timeout_s=timeout_s), timeout=timeout_s)
        if reply.backend != backend_for(self.device_type):
            raise ValueError(f"the source moves blocks with {reply.backend}, this worker "
                             f"with {backend_for(self.device_type)}")
        host = source_address.rpartition(":")[0].strip("[]")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, reply.store_port, 2, is_master=False, timeout=timeout)
        pair = _Pair(_join_warm(store, group_id, 1, self.device, timeout), group_id)
        with self._lock:
            if len(self._pairs) >= MAX_PAIRS:
                self._retire(self._pairs.pop(next(iter(self._pairs))).group)
            self._pairs[key] = pair
        return pair

    def receive(self, pair: _Pair, stub, request: pb.FetchBlocksRequest, remote_ids: list[int],
                shape: BlockShape, deadline: float) -> torch.Tensor:
        """Whole blocks `remote_ids` from the source, as a tensor on this worker's
        device. TimeoutError past `deadline` (time.monotonic()); the pair is retired
        on any failure."""
        count = len(remote_ids)
        buffer = torch.empty(count * shape.nbytes, dtype=torch.uint8,
                             device=self.device if self.device_type == "cuda" else "cpu")
        with pair.lock:
            try:
                tag = next(pair.tags)
                work = pair.group.recv([buffer], 0, tag)
                remaining = max(deadline - time.monotonic(), 0.001)
                sent = stub.SendBlocks.future(pb.SendBlocksRequest(
                    group_id=pair.group_id, block_ids=remote_ids, epoch=request.source_epoch,
                    lease_id=request.lease_id, tag=tag, timeout_s=remaining), timeout=remaining)
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                sent.result(timeout=max(deadline - time.monotonic(), 0.001))
            except BaseException:
                self._drop(pair)
                raise
        return buffer.view(shape.dtype).view(shape.dims(count))

    def _drop(self, pair: _Pair) -> None:
        with self._lock:
            for key, known in list(self._pairs.items()):
                if known is pair:
                    del self._pairs[key]
            self._retire(pair.group)

    def _retire(self, group) -> None:
        """Keep a failed or evicted group alive (see the module doc), boundedly."""
        self._retired.append(group)
        del self._retired[:-MAX_RETIRED]


def _join_warm(store, group_id: str, rank: int, device: torch.device,
               timeout: datetime.timedelta):
    """Join the pair as `rank`, then exchange one byte (tag 0; transfers use tags from 1)
    so both ranks' point-to-point communicator exists before any transfer.

    Why: NCCL creates a pair's communicator lazily, inside the first send or recv, and
    the receiving rank blocks there until the other rank's first operation. The pulling
    side posts its recv before it asks for the send (SendBlocks), so without this
    exchange the first pull on every new NCCL pair waited out its whole timeout and
    recomputed. Rank 0 runs this on the joining thread, rank 1 in `pair`, so the two
    halves meet. Gloo does not need it; it costs one byte there."""
    group = pair_group(store, group_id, rank, device.type, timeout)
    probe = torch.zeros(1, dtype=torch.uint8, device=device)
    work = group.send([probe], 1, 0) if rank == 0 else group.recv([probe], 0, 0)
    work.wait(timeout)
    return group


def _wire(blocks: torch.Tensor, device_type: str) -> torch.Tensor:
    """The bytes of `blocks` as a flat uint8 tensor where the backend wants them."""
    data = blocks.contiguous().view(torch.uint8).reshape(-1)
    return data.cuda() if device_type == "cuda" else data.cpu()


def status_of(exc: BaseException) -> grpc.StatusCode:
    """How a failed dist pull is reported to the scheduler (it recomputes either way)."""
    if isinstance(exc, grpc.RpcError):
        return exc.code()
    if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() \
            or "timeout" in str(exc).lower():
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.UNAVAILABLE

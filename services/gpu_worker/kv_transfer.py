"""The gpu-worker's KV transport (`KvTransferService`, PagodaConnector): blocks move
worker to worker over a gRPC stream, one checksummed chunk per block.

    decode worker ──FetchBlocks(source, ids)──► itself ──PullBlocks(ids)──► prefill worker
                  ◄── written into its cache ◄── stream of BlockChunk{index, data, crc32}

gRPC's flow control paces the stream: the sender blocks while the receiver's window
is full, so neither side buffers more than a window. A block travels whole (every layer and KV
head of the model, pagoda.kv_transfer.block_shares) whatever either side's tensor-
and pipeline-parallel shape, so a TP=1 prefill worker feeds a TP=2 decode group.

A single-rank worker reads and writes blocks while steps run: the blocks served are
pinned under a lease and the blocks written belong to no running request, so a step
never reads or writes either. A worker group's export and import are collective
calls on its ranks, like a step: they take `step_lock` (one call at a time), 16
blocks per call, so a long pull interleaves with steps instead of stalling them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
import zlib

import grpc
import torch

import pagoda.fault_injection as fault_injection
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc
from pagoda.services.common import grpc_channels
from pagoda.services.common.kv_transfer_metrics import kv_transfer_metrics
from pagoda.services.common.tracing import intercept
from pagoda.kv_transfer.block_shares import BlockShape, as_bytes
from pagoda.kv_transfer.config import DIST_CONNECTOR
from pagoda.services.gpu_worker.kv_dist import SEND_BATCH, DistTransport, status_of

SERVICE_NAME = "pagoda.kv_transfer.v1.KvTransferService"
IMPORT_BATCH = 16  # blocks per export or import call (~6 MB of SmolLM2's KV)
MAX_SOURCE_CHANNELS = 64
# A fetch writes a batch only while its scheduler still waits this long for it: once the
# scheduler's deadline passed, it has handed the target blocks to other requests (a
# fetch can start late, its thread pool busy, or wait on step_lock), and a batch's
# write takes milliseconds.
WRITE_MARGIN_S = 1.0
CALLER_GONE = "the scheduler stopped waiting for this fetch: nothing more is written"
logger = logging.getLogger(__name__)


class KvTransferServicer(pb_grpc.KvTransferServiceServicer):
    """Invariant: blocks are served only under the KV cache's current `epoch`, and a
    fetch writes a block only after its checksum matched and only while its caller
    still waits for it (after that, the caller's pool has the target blocks back). The
    epoch is renewed (`renew_epoch`) before the cache is set up again and when a step
    fails midway, so a block read across either is never served under the epoch it was
    asked for."""

    def __init__(self, executor, model: str, tensor_parallel_size: int,
                 prefix_hash_seed: str, step_lock=None, connector: str = "PagodaConnector",
                 device: str = "cpu", bind_host: str = "127.0.0.1") -> None:
        self.executor = executor
        self.connector = connector
        self.device_type = torch.device(device).type
        # Both sides of PagodaDistConnector; served whatever this worker's own connector
        # (a pair needs both workers on it, which the gateway's handshake checks).
        self.dist = DistTransport(torch.device(device), bind_host)
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size
        self.prefix_hash_seed = prefix_hash_seed
        self.step_lock = step_lock if step_lock is not None else contextlib.nullcontext()
        self.epoch = uuid.uuid4().hex
        self._channels: dict[str, grpc.Channel] = {}  # source address -> channel, reused
        self._channels_lock = threading.Lock()
        # Exported (at 0) from start-up, not from the first pull: a rate over the blocks
        # pulled needs a sample from before them (the dashboards' "KV pulled" panel).
        kv_transfer_metrics()

    def renew_epoch(self) -> None:
        """The KV cache's contents are lost (a step failed midway, or the cache is
        being set up again as zeros): refuse every transfer naming the old epoch."""
        self.epoch = uuid.uuid4().hex
        logger.info("KV epoch renewed: %s", self.epoch)

    def _channel(self, address: str) -> grpc.Channel:
        """One channel per source worker for the life of this process (a pull reuses
        its connection instead of a TCP and HTTP/2 handshake each time)."""
        with self._channels_lock:
            channel = self._channels.get(address)
            if channel is None:
                if len(self._channels) >= MAX_SOURCE_CHANNELS:
                    oldest = next(iter(self._channels))
                    self._channels.pop(oldest).close()
                channel = self._channels[address] = intercept(grpc_channels.channel(address))
            return channel

    def _geometry(self, context):
        """(BlockShape, num_blocks); aborts when this worker cannot transfer KV yet."""
        try:
            geometry = self.executor.kv_cache_geometry()
        except NotImplementedError as exc:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        if geometry is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the KV cache is not allocated")
        return geometry

    def _export(self, block_ids: list[int]) -> bytes:
        with self.step_lock:
            return as_bytes(self.executor.export_kv_blocks(block_ids))

    def _import(self, shape: BlockShape, block_ids, datas: list[bytes], context) -> None:
        if block_ids:
            blocks = shape.blocks(b"".join(datas), len(block_ids))
            with self.step_lock:
                _check_caller_waits(context)
                self.executor.import_kv_blocks(list(block_ids), blocks)

    def GetKvLayout(self, request, context) -> pb.KvLayout:
        shape, num_blocks = self._geometry(context)
        return pb.KvLayout(model=self.model, tensor_parallel_size=self.tensor_parallel_size,
                           prefix_hash_seed=self.prefix_hash_seed, epoch=self.epoch,
                           kv_dtype=str(shape.dtype).removeprefix("torch."),
                           block_size=shape.block_size, num_layers=shape.num_layers,
                           num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                           layout=shape.layout, num_blocks=num_blocks,
                           device_type=self.device_type)

    def _check_epoch(self, epoch: str, context) -> None:
        if epoch != self.epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale epoch {epoch!r}: this worker is {self.epoch!r}")

    def _check_ids(self, block_ids, num_blocks: int, context) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < num_blocks:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no block {block_id}")

    def OpenDistGroup(self, request: pb.OpenDistGroupRequest, context
                      ) -> pb.OpenDistGroupResponse:
        self._check_epoch(request.epoch, context)
        if not request.group_id or request.timeout_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a group id and a timeout >= 0")
        return self.dist.open(request)

    def SendBlocks(self, request: pb.SendBlocksRequest, context) -> pb.SendBlocksResponse:
        self._check_epoch(request.epoch, context)
        _, num_blocks = self._geometry(context)
        self._check_ids(request.block_ids, num_blocks, context)
        with self.step_lock:
            blocks = self.executor.export_kv_blocks(list(request.block_ids))
        self._check_epoch(request.epoch, context)  # still the KV that was asked for
        try:
            sent = self.dist.send(request, blocks)
        except LookupError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # noqa: BLE001 - the peer left or stalled: its pull fails
            context.abort(status_of(exc), f"sending to the pair failed: {exc}")
        return pb.SendBlocksResponse(num_bytes=sent)

    def PullBlocks(self, request: pb.PullBlocksRequest, context):
        if fault_injection.check("kv_pull.start") == "fail":
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: pull refused")
        self._check_epoch(request.epoch, context)
        shape, num_blocks = self._geometry(context)
        ids = list(request.block_ids)
        self._check_ids(ids, num_blocks, context)
        size = shape.nbytes
        for start in range(0, len(ids), IMPORT_BATCH):
            batch = ids[start:start + IMPORT_BATCH]
            data = b""
            for j in range(len(batch)):
                # Before block j is sent and, for j == 0, before its batch is read.
                fault = fault_injection.check("kv_pull.block")
                if fault == "fail":
                    context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: stream broke")
                if fault == "truncate":
                    return
                if j == 0:
                    data = self._export(batch)
                    self._check_epoch(request.epoch, context)  # read before any re-allocation
                block = data[j * size:(j + 1) * size]
                yield pb.BlockChunk(index=start + j, data=block, crc32=zlib.crc32(block))

    def FetchBlocks(self, request: pb.FetchBlocksRequest, context) -> pb.FetchBlocksResponse:
        shape, _ = self._geometry(context)
        if len(request.remote_block_ids) != len(request.local_block_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "remote and local ids differ in length")
        if self.connector == DIST_CONNECTOR:
            return self._fetch_dist(request, context, shape)
        fault_injection.check("kv_fetch.start")
        if not _caller_waits(context):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, CALLER_GONE)
        started = time.perf_counter()
        num_bytes = 0
        received = 0
        call = pb_grpc.KvTransferServiceStub(self._channel(request.source_address)).PullBlocks(
            pb.PullBlocksRequest(block_ids=request.remote_block_ids,
                                 epoch=request.source_epoch, lease_id=request.lease_id),
            timeout=request.timeout_s or None)
        pending: list[bytes] = []  # checked blocks not yet written, IMPORT_BATCH at most
        local = request.local_block_ids
        try:
            for chunk in call:
                if chunk.index != received or zlib.crc32(chunk.data) != chunk.crc32:
                    call.cancel()
                    context.abort(grpc.StatusCode.DATA_LOSS,
                                  f"block {chunk.index}: checksum or order mismatch")
                if request.timeout_s and time.perf_counter() - started > request.timeout_s:
                    # gRPC's own deadline fires on a timer, which a fast local stream can
                    # outrun: the pull's time limit is kept here, block by block.
                    call.cancel()
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"the pull took more than {request.timeout_s:g} s")
                pending.append(chunk.data)
                num_bytes += len(chunk.data)
                received += 1
                if len(pending) == IMPORT_BATCH:
                    self._import(shape, local[received - len(pending):received], pending,
                                 context)
                    pending = []
            self._import(shape, local[received - len(pending):received], pending, context)
        except grpc.RpcError as exc:
            context.abort(exc.code(), f"pull from {request.source_address}: {exc.details()}")
        except ValueError as exc:  # a block of another size (layouts differ), a bad id
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            call.cancel()  # ended here (the caller left): the source stops (no-op if done)
        if received != len(local):
            context.abort(grpc.StatusCode.DATA_LOSS, f"got {received} of {len(local)} blocks")
        return _counted(received, num_bytes, started)

    def _fetch_dist(self, request: pb.FetchBlocksRequest, context,
                    shape: BlockShape) -> pb.FetchBlocksResponse:
        """FetchBlocks over a pair group (kv_dist.py), SEND_BATCH blocks per tensor."""
        started = time.perf_counter()
        timeout = request.timeout_s or 30.0
        deadline = time.monotonic() + timeout
        stub = pb_grpc.KvTransferServiceStub(self._channel(request.source_address))
        remote, local = list(request.remote_block_ids), list(request.local_block_ids)
        num_bytes = 0
        try:
            pair = self.dist.pair(request.source_address, request.source_epoch, stub, timeout)
            for start in range(0, len(remote), SEND_BATCH):
                blocks = self.dist.receive(pair, stub, request, remote[start:start + SEND_BATCH],
                                           shape, deadline)
                with self.step_lock:
                    if not _caller_waits(context):
                        raise TimeoutError(CALLER_GONE)
                    self.executor.import_kv_blocks(local[start:start + SEND_BATCH], blocks)
                num_bytes += blocks.numel() * blocks.element_size()
        except ValueError as exc:  # another backend or block shape: layouts differ
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # noqa: BLE001 - peer gone, stalled, refused: recompute
            context.abort(status_of(exc), f"pull from {request.source_address} over "
                                          f"{DIST_CONNECTOR}: {exc}")
        return _counted(len(local), num_bytes, started)


def _caller_waits(context) -> bool:
    """Whether the scheduler still waits for this fetch, with WRITE_MARGIN_S to spare."""
    remaining = context.time_remaining()
    return context.is_active() and (remaining is None or remaining > WRITE_MARGIN_S)


def _check_caller_waits(context) -> None:
    if not _caller_waits(context):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, CALLER_GONE)


def _counted(num_blocks: int, num_bytes: int, started: float) -> pb.FetchBlocksResponse:
    metrics = kv_transfer_metrics()
    metrics.blocks.inc(num_blocks)
    metrics.bytes.inc(num_bytes)
    metrics.seconds.observe(time.perf_counter() - started)
    return pb.FetchBlocksResponse(num_blocks=num_blocks, num_bytes=num_bytes)

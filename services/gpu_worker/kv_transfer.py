"""The gpu-worker's KV transport (`KvTransferService`, PagodaConnector): blocks move
worker to worker over a gRPC stream, one checksummed chunk per block.

    decode worker ──FetchBlocks(source, ids)──► itself ──PullBlocks(ids)──► prefill worker
                  ◄── written into its cache ◄── stream of BlockChunk{index, data, crc32}

gRPC's flow control paces the stream: the sender blocks while the receiver's window
is full, so neither side buffers more than a window. Blocks are read and written
while steps run: the blocks served are pinned under a lease and the blocks written
belong to no running request, so a step never reads or writes either.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib

import grpc

from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc
from pagoda.services.common import grpc_channels
from pagoda.services.common.kv_transfer_metrics import kv_transfer_metrics
from pagoda.services.common.tracing import intercept
from pagoda.worker.kv_blocks import export_block, import_blocks, kv_layout

SERVICE_NAME = "pagoda.kv_transfer.v1.KvTransferService"
IMPORT_BATCH = 16  # blocks written per indexed copy (~6 MB of SmolLM2's KV)
MAX_SOURCE_CHANNELS = 64
logger = logging.getLogger(__name__)


class KvTransferServicer(pb_grpc.KvTransferServiceServicer):
    """Invariant: blocks are served only under this process's `epoch`, and a fetch
    writes a block only after its checksum matched."""

    def __init__(self, executor, model: str, tensor_parallel_size: int,
                 prefix_hash_seed: str) -> None:
        self.executor = executor
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size
        self.prefix_hash_seed = prefix_hash_seed
        self.epoch = uuid.uuid4().hex
        self._channels: dict[str, grpc.Channel] = {}  # source address -> channel, reused
        self._channels_lock = threading.Lock()

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

    def _kv_caches(self, context):
        runner = getattr(self.executor, "runner", None)
        if runner is None or self.tensor_parallel_size != 1:
            context.abort(grpc.StatusCode.UNIMPLEMENTED,
                          "KV transfer needs a single-rank worker (tensor-parallel size 1)")
        if not runner.kv_caches:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the KV cache is not allocated")
        return runner.kv_caches

    def GetKvLayout(self, request, context) -> pb.KvLayout:
        layout = kv_layout(self._kv_caches(context))
        return pb.KvLayout(model=self.model, tensor_parallel_size=self.tensor_parallel_size,
                           prefix_hash_seed=self.prefix_hash_seed, epoch=self.epoch, **layout)

    def PullBlocks(self, request: pb.PullBlocksRequest, context):
        if request.epoch != self.epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale epoch {request.epoch!r}: this worker is {self.epoch!r}")
        caches = self._kv_caches(context)
        num_blocks = caches[0][0].shape[0]
        for index, block_id in enumerate(request.block_ids):
            if not 0 <= block_id < num_blocks:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no block {block_id}")
            data = export_block(caches, block_id)
            yield pb.BlockChunk(index=index, data=data, crc32=zlib.crc32(data))

    def FetchBlocks(self, request: pb.FetchBlocksRequest, context) -> pb.FetchBlocksResponse:
        caches = self._kv_caches(context)
        if len(request.remote_block_ids) != len(request.local_block_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "remote and local ids differ in length")
        started = time.perf_counter()
        num_bytes = 0
        received = 0
        call = pb_grpc.KvTransferServiceStub(self._channel(request.source_address)).PullBlocks(
            pb.PullBlocksRequest(block_ids=request.remote_block_ids,
                                 epoch=request.source_epoch, lease_id=request.lease_id),
            timeout=request.timeout_s or None)
        pending: list[bytes] = []  # checked blocks not yet written, IMPORT_BATCH at most
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
                    import_blocks(caches, request.local_block_ids[received - len(pending):
                                                                  received], pending)
                    pending = []
            import_blocks(caches, request.local_block_ids[received - len(pending):received],
                          pending)
        except grpc.RpcError as exc:
            context.abort(exc.code(), f"pull from {request.source_address}: {exc.details()}")
        except ValueError as exc:  # a block of another size: layouts differ
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if received != len(request.local_block_ids):
            context.abort(grpc.StatusCode.DATA_LOSS,
                          f"got {received} of {len(request.local_block_ids)} blocks")
        metrics = kv_transfer_metrics()
        metrics.blocks.inc(received)
        metrics.bytes.inc(num_bytes)
        metrics.seconds.observe(time.perf_counter() - started)
        return pb.FetchBlocksResponse(num_blocks=received, num_bytes=num_bytes)

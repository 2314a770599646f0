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
import time
import uuid
import zlib

import grpc

from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc
from pagoda.services.common import grpc_channels
from pagoda.services.common.kv_transfer_metrics import kv_transfer_metrics
from pagoda.services.common.tracing import intercept
from pagoda.worker.kv_blocks import export_block, import_block, kv_layout

SERVICE_NAME = "pagoda.kv_transfer.v1.KvTransferService"
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
        with grpc_channels.channel(request.source_address) as channel:
            call = pb_grpc.KvTransferServiceStub(intercept(channel)).PullBlocks(
                pb.PullBlocksRequest(block_ids=request.remote_block_ids,
                                     epoch=request.source_epoch, lease_id=request.lease_id),
                timeout=request.timeout_s or None)
            try:
                for chunk in call:
                    if chunk.index != received or zlib.crc32(chunk.data) != chunk.crc32:
                        call.cancel()
                        context.abort(grpc.StatusCode.DATA_LOSS,
                                      f"block {chunk.index}: checksum or order mismatch")
                    import_block(caches, request.local_block_ids[chunk.index], chunk.data)
                    num_bytes += len(chunk.data)
                    received += 1
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

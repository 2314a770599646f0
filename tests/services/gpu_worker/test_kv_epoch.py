"""The gpu-worker's KV epoch names the contents of its KV cache: it is renewed when a
step fails midway and before the cache is allocated again (as zeros), so a pull that
names the old epoch, or one that read blocks across the re-allocation, is refused
(FAILED_PRECONDITION: the decode side counts stale_epoch and recomputes)."""

from __future__ import annotations

import grpc
import pytest
import torch

from pagoda.kv_transfer.block_shares import BlockShape
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
from pagoda.services.gpu_worker.kv_transfer import KvTransferServicer
from pagoda.services.gpu_worker.servicer import WorkerServicer

SHAPE = BlockShape(num_layers=1, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


class Executor:
    """A one-rank KV cache of 4 blocks; `during_export` runs inside each export (a
    re-allocation landing in the middle of a pull)."""

    def __init__(self) -> None:
        self.num_inits = 0
        self.during_export = lambda: None

    def kv_cache_geometry(self):
        return SHAPE, 4

    def export_kv_blocks(self, block_ids):
        self.during_export()
        return torch.ones((len(block_ids), *SHAPE.dims(1)[1:]))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_inits += 1

    def reset(self) -> None:
        pass


def pair() -> tuple[Executor, WorkerServicer, KvTransferServicer]:
    executor = Executor()
    worker = WorkerServicer(executor, "m", "float32", "cpu")
    transfer = KvTransferServicer(executor, "m", 1, "seed")
    worker.on_kv_lost = transfer.renew_epoch  # as `pagoda gpu-worker` wires them
    return executor, worker, transfer


def pull(transfer: KvTransferServicer, epoch: str) -> list:
    return list(transfer.PullBlocks(kpb.PullBlocksRequest(block_ids=[1, 2], epoch=epoch),
                                    Context()))


def test_a_reallocated_kv_cache_refuses_pulls_naming_the_old_epoch():
    executor, worker, transfer = pair()
    worker.InitializeKvCache(wpb.InitializeKvCacheRequest(num_blocks=4), Context())
    epoch = transfer.GetKvLayout(kpb.GetKvLayoutRequest(), Context()).epoch
    assert len(pull(transfer, epoch)) == 2
    worker.InitializeKvCache(wpb.InitializeKvCacheRequest(num_blocks=4), Context())  # zeros
    assert executor.num_inits == 2
    with pytest.raises(Aborted) as refused:
        pull(transfer, epoch)
    assert refused.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    new = transfer.GetKvLayout(kpb.GetKvLayoutRequest(), Context()).epoch
    assert new != epoch and len(pull(transfer, new)) == 2


def test_a_pull_reading_across_a_reallocation_is_refused():
    executor, worker, transfer = pair()
    worker.InitializeKvCache(wpb.InitializeKvCacheRequest(num_blocks=4), Context())
    epoch = transfer.epoch
    executor.during_export = transfer.renew_epoch  # the cache is set up again meanwhile
    with pytest.raises(Aborted) as refused:
        pull(transfer, epoch)
    assert refused.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION


class TrailingContext(Context):
    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = dict(metadata)


@pytest.mark.parametrize("failure", ["rebuilt", "crash loop"])
def test_a_worker_group_rebuilt_after_a_failed_step_renews_the_epoch(failure):
    """A TP/PP group whose rank failed is rebuilt and raises StepFailed (its KV is gone):
    the scheduler is told the step failed midway (it recomputes and sets the KV cache
    up again) and old pulls are refused. A crash loop is final: UNAVAILABLE."""
    from pagoda.executor.base import StepFailed, WorkerGroupFailed
    from pagoda.services.common.protocol.worker import STEP_FAILED_KEY

    executor, worker, transfer = pair()
    error = (StepFailed("rank 1 died; the group was rebuilt") if failure == "rebuilt"
             else WorkerGroupFailed("rank 1: ...; a crash loop"))

    def execute_model(plan):
        raise error

    executor.execute_model = execute_model
    worker.InitializeKvCache(wpb.InitializeKvCacheRequest(num_blocks=4), Context())
    epoch, context = transfer.epoch, TrailingContext()
    with pytest.raises(Aborted) as aborted:
        worker.ExecuteModel(wpb.ExecuteModelRequest(step_id=0), context)
    if failure == "rebuilt":
        assert aborted.value.args[0] == grpc.StatusCode.INTERNAL
        assert STEP_FAILED_KEY in context.trailing
        assert transfer.epoch != epoch
    else:
        assert aborted.value.args[0] == grpc.StatusCode.UNAVAILABLE

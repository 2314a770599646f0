"""The decode side of disaggregation: before a remotely prefilled request enters the
engine, get the prompt's blocks here, then let it find them as a prefix-cache hit.

    Generate(do_remote_prefill, blocks, lease) ─► plan (engine thread): held blocks
        referenced, the rest allocated ─► own gpu-worker FetchBlocks(prefill worker)
        ─► ReleaseLease at the prefill scheduler (valid?) ─► commit (engine thread):
        pulled blocks cached under their hashes ─► request submitted: prefix hit

The params may cover only the prompt's leading blocks: a prefix pull (the gateway's
--kv-prefix-pull) leases another replica's cached prefix for a request with no output
yet, and the engine computes the rest of the prompt after the hit as usual.

Whatever fails (the pull times out or breaks, the checksum, the lease expired, the
prefill replica restarted: another epoch), the pulled blocks are discarded and the
request is submitted anyway: the engine computes what it does not find, so the
client sees no error; the failure is counted by reason and the fallback by kind. (A
prompt whose images came without pixels, the prefill side having encoded them, cannot
be computed here: its scheduler refuses it, `pagoda.core.media_guard`, and the gateway
sends it again with the pixels.) Block hashes include the images' identifiers, as the
engine's and the prefill side's do.
A worker that answers with fewer blocks written than asked is such a failure too.
This replica's own KV may be reset while a pull runs (a failed step: EngineCore sets
the worker's cache up again as zeros and calls its kv_reset_listeners): the blocks
written before the reset are zeros, so a plan made before a reset is never committed
(`kv_epoch`, bumped by `on_kv_reset`, is compared on the engine thread, where plans,
commits and resets all run, so none can slip between the check and the commit).
A request that ends before its pull did (the client left: the handler cancelled) has
its lease released at once, not at the prefill side's --kv-lease-timeout.
The plan's references are dropped when the request's stream ends (by then the
request holds its own), so no step can evict the blocks before it is admitted.
Plans are made, kept and dropped on the engine thread only, in call order: a client
that leaves while its plan is being made (the handler cancelled mid-await) still has
the plan dropped, since the drop is queued behind the making.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

import pagoda.tracing as tracing
from pagoda.core.block_hash import DEFAULT_HASH_ALGO, hash_request_tokens, request_keys
from pagoda.kv_transfer.imports import ImportPlan, commit_import, plan_import, release_import
from pagoda.messages import EngineCoreRequest
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc
from pagoda.services.common import grpc_channels
from pagoda.services.common.kv_transfer_metrics import kv_transfer_metrics

logger = logging.getLogger(__name__)
# Extra seconds the scheduler waits on its worker beyond the worker's own pull
# deadline: the worker's answer (after its last write) normally comes first.
FETCH_GRACE_S = 5.0
_REASONS = {grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.DATA_LOSS: "checksum",
            grpc.StatusCode.FAILED_PRECONDITION: "stale_epoch",
            grpc.StatusCode.UNAVAILABLE: "unavailable"}


class KvConsumer:
    """Invariant: every plan made by `prepare` is committed or discarded before the
    request is submitted, and released exactly once (`finish`); `_plans` is touched
    on the engine thread only."""

    def __init__(self, producer_like_engine, pool, info, worker_address: str,
                 transfer_timeout_s: float) -> None:
        self.engine = producer_like_engine  # EngineLoop
        self.pool = pool
        self.info = info
        self.transfer_timeout_s = transfer_timeout_s
        self.worker = pb_grpc.KvTransferServiceStub(grpc_channels.aio_channel(worker_address))
        self._lease_stubs: dict[str, pb_grpc.KvLeaseServiceStub] = {}
        self._plans: dict[str, ImportPlan] = {}
        self._releasing: set[asyncio.Task] = set()  # _release_soon's, held till done
        # Resets of this replica's KV cache seen (on the engine thread); a plan made
        # under an older count names blocks that were zeroed since.
        self.kv_epoch = 0
        self._plan_epochs: dict[int, int] = {}  # id(plan) -> kv_epoch when it was made
        kv_transfer_metrics()  # exported (at 0) from start-up, not from the first failure

    def on_kv_reset(self) -> None:
        """EngineCore's kv_reset_listener (engine thread): every block was zeroed."""
        self.kv_epoch += 1

    async def on_engine(self, fn):
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def call() -> None:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 (handed to the awaiting handler)
                # Bound now: `exc` is unset once this block ends, before the loop runs it.
                loop.call_soon_threadsafe(lambda e=exc: done.done() or done.set_exception(e))
                return
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

        self.engine.call_soon(call)
        return await asyncio.shield(done)

    async def prepare(self, request: EngineCoreRequest) -> None:
        """Pull the blocks `kv_transfer_params` name (a remote prefill's, or another
        replica's cached prefix) that this replica lacks, if any."""
        params = request.kv_transfer_params
        request.kv_transfer_params = None
        if params is None or not params.do_remote_prefill or not params.block_hashes:
            return
        metrics = kv_transfer_metrics()
        hashes = hash_request_tokens(request.prompt_token_ids, self.info.block_size,
                                     self.info.prefix_hash_seed,
                                     request_keys(request.cache_salt, request.lora_key),
                                     algo=self.info.prefix_caching_hash_algo or DEFAULT_HASH_ALGO,
                                     mm_features=request.mm_features)  # the engine's keys
        if list(params.block_hashes) != hashes[:len(params.block_hashes)]:
            metrics.failures.labels("hash_mismatch").inc()
            metrics.fallbacks.labels("recompute").inc()
            await self._release_lease(params)
            return
        prompt = list(request.prompt_token_ids)
        rid = request.request_id
        try:
            plan = await self.on_engine(lambda: self._make_plan(rid, params.block_hashes,
                                                                prompt))
        except asyncio.CancelledError:  # the client left: free the prefill side's blocks
            self._release_soon(params)
            raise
        reason = await self._pull(plan, params)
        if reason is not None:
            logger.warning("request %s: KV pull from %s failed (%s); computing the prompt here",
                           request.request_id, params.remote_instance_id, reason)
            metrics.failures.labels(reason).inc()
            metrics.fallbacks.labels("recompute").inc()

    async def _pull(self, plan: ImportPlan, params) -> str | None:
        """Fetch the planned blocks, release the lease, commit or discard the plan:
        None when the blocks are in, else the failure's reason."""
        reason = None if plan.block_hashes else "no_room"
        fetch = None
        completed = False
        try:
            if plan.targets:
                if time.time() >= params.lease_expiry:
                    reason = "lease_expired"
                else:
                    with _pull_span(plan, params) as span:
                        fetch = asyncio.ensure_future(self._fetch(params, plan))
                        reason = await asyncio.shield(fetch)
                        if span is not None:
                            span.set_attribute("pagoda.kv_transfer.result", reason or "ok")
            valid = await self._release_lease(params)
            if plan.targets and reason is None and not valid:
                reason = "lease_expired"
            completed = True
        finally:
            if not completed:  # cancelled (client gone): free the prefill side's blocks
                self._release_soon(params)  # now (what arrives is discarded anyway)
            if fetch is not None and not fetch.done():  # let the worker stop writing first
                await asyncio.wait([fetch])
            ok = completed and reason is None
            if not await self.on_engine(lambda: self._commit(plan, ok)) and ok:
                reason = "kv_reset"
        return reason

    def _commit(self, plan: ImportPlan, ok: bool) -> bool:
        """Commit (ok) or discard the plan; whether it was committed. A plan made
        before this replica's KV was reset is discarded: its blocks hold zeros."""
        made_in = self._plan_epochs.pop(id(plan), None)  # None: dropped, never commit
        ok = ok and made_in == self.kv_epoch
        commit_import(self.pool, plan, ok)
        return ok

    def _release_soon(self, params) -> None:
        """Release the lease without waiting (the request ended before its pull did)."""
        task = asyncio.ensure_future(self._release_lease(params))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _fetch(self, params, plan: ImportPlan) -> str | None:
        """None when every planned block arrived, else the failure's reason."""
        remote_ids = [params.remote_block_ids[i] for i in plan.remote_indices]
        try:
            reply = await self.worker.FetchBlocks(pb.FetchBlocksRequest(
                source_address=params.remote_worker_address,
                source_epoch=params.remote_worker_epoch, remote_block_ids=remote_ids,
                local_block_ids=[b.block_id for b in plan.targets],
                timeout_s=self.transfer_timeout_s, lease_id=params.lease_id),
                timeout=self.transfer_timeout_s + FETCH_GRACE_S)
        except grpc.RpcError as exc:
            logger.info("FetchBlocks: %s %s", exc.code().name, exc.details())
            return _REASONS.get(exc.code(), "error")
        if reply.num_blocks != len(plan.targets):  # written part-way: never commit
            logger.info("FetchBlocks wrote %d of %d blocks", reply.num_blocks,
                        len(plan.targets))
            return "error"
        return None

    async def _release_lease(self, params) -> bool:
        """Tell the prefill replica it may free the blocks; whether its lease was live."""
        address = params.remote_scheduler_address
        stub = self._lease_stubs.get(address)
        if stub is None:
            stub = pb_grpc.KvLeaseServiceStub(grpc_channels.aio_channel(address))
            self._lease_stubs[address] = stub
        try:
            reply = await stub.ReleaseLease(pb.ReleaseLeaseRequest(
                lease_id=params.lease_id, epoch=params.remote_epoch), timeout=5.0)
        except grpc.RpcError:
            return False  # the prefill replica is gone: its blocks may be anything now
        return reply.valid

    def finish(self, request_id: str) -> None:
        """The request's stream ended: drop the plan's references (queued behind the
        plan's making and commit, on the engine thread)."""
        self.engine.call_soon(lambda: self._drop_plan(request_id))

    def _make_plan(self, request_id: str, block_hashes, prompt: list[int]) -> ImportPlan:
        plan = plan_import(self.pool, block_hashes, prompt)
        self._plans[request_id] = plan
        self._plan_epochs[id(plan)] = self.kv_epoch
        return plan

    def _drop_plan(self, request_id: str) -> None:
        plan = self._plans.pop(request_id, None)
        if plan is not None:
            self._plan_epochs.pop(id(plan), None)  # a plan never pulled (client gone)
            release_import(self.pool, plan)


@contextlib.contextmanager
def _pull_span(plan: ImportPlan, params):
    """`kv_transfer.pull` around one request's pull (its FetchBlocks call, and the
    worker-to-worker PullBlocks under it, are children); yields None while tracing
    is off."""
    if not tracing.is_enabled():
        yield None
        return
    with tracing.get_tracer().start_as_current_span("kv_transfer.pull", attributes={
            "pagoda.kv_transfer.blocks": len(plan.targets),
            "pagoda.kv_transfer.blocks_held": len(plan.held),
            "pagoda.kv_transfer.source": params.remote_instance_id}) as span:
        yield span

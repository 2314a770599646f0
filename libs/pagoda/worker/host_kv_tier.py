"""The worker's host-memory KV tier: the bytes behind the scheduler's index
(`pagoda.core.kv_offload`), vLLM's --kv-offloading-size with the native backend.

    device cache (per layer)            host tier (per layer, same layout)
    k[num_blocks, bs, heads, kd]  --offload-->  k[num_slots, bs, heads, kd]
    v[num_blocks, bs, heads, vd]  <--onload---  v[num_slots, bs, heads, vd]

Each layer's tensors are mirrored whatever the architecture's cache layout
(`kv_cache.layer_cache_spec`: K/V heads, or a latent with an empty value tensor), so a
slot is one whole block of this rank's share. On CUDA the tier is pinned host memory
(the copies are DMA); on the CPU it is a second pool in the same memory.

Per slot the tier records the hash it holds and a CRC-32 of its bytes, taken when it
was written. An onload whose slot holds another hash (never written, overwritten, the
worker restarted) or whose bytes no longer match the CRC is not copied: the request
is recomputed from that block in the same step (`apply`), so the answer is the same.
Runs on the step thread, before the forward.

With a disk tier below (`disk_kv_tier.py`, --kv-offloading-disk-path) the plan also
spills slots to disk and onloads blocks from it (`KVOnload.medium == "disk"`); a step
runs spills, disk drops, offloads, then onloads, and a disk onload that fails its
checks is recomputed the same way.

Asynchronous onloads (`plan.kv_async_onloads`) are started after the step's offloads
and run on a background thread (`kv_onload_async.py`), by the same verified copies
(`onload_blocks`); the step's forward does not wait for them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

import pagoda.fault_injection as fault_injection
from pagoda.config import EngineConfig
from pagoda.core.kv_disk_index import num_disk_records
from pagoda.messages import KVOnload, KVSpill, SchedulerOutput
from pagoda.model.kv_cache import kv_cache_bytes_per_block, kv_cache_torch_dtype
from pagoda.kv_transfer.block_shares import LAYOUT
from pagoda.worker.disk_kv_tier import DiskKVTier, layout_identity
from pagoda.worker.kv_onload_async import AsyncOnloader

logger = logging.getLogger(__name__)
GIB = 1024 ** 3


def host_tier_slots(config: EngineConfig) -> tuple[int, int]:
    """(slots of the host tier, bytes of one whole block) for `config`; 0 slots: off.
    The scheduler's index and every worker rank size the tier by this rule."""
    size = config.cache.kv_offloading_size
    if size <= 0 or config.runner != "generate":
        return 0, 0
    dtype = kv_cache_torch_dtype(config.kv_cache_dtype, getattr(torch, config.dtype))
    block_bytes = kv_cache_bytes_per_block(config.arch, config.cache.block_size, dtype)
    return int(size * GIB) // block_bytes, block_bytes


def disk_tier_records(config: EngineConfig) -> int:
    """Whole-block records the disk tier holds under `config` (0: no disk tier). The
    scheduler's index and every worker rank size it by this rule."""
    num_slots, block_bytes = host_tier_slots(config)
    if num_slots <= 0 or not config.cache.kv_offloading_disk_path:
        return 0
    return num_disk_records(config.cache.kv_offloading_disk_size, block_bytes)


def make_disk_tier(config: EngineConfig, kv_caches, parallel) -> DiskKVTier | None:
    """This rank's disk tier under --kv-offloading-disk-path, None when off. Its
    identity is what the P/D handshake compares (`KvLayout`), with this rank's share."""
    num_records = disk_tier_records(config)
    if num_records <= 0:
        return None
    identity = layout_identity((
        config.model, config.cache.prefix_hash_seed, config.cache.block_size, LAYOUT,
        HostKVTier._layout(kv_caches), parallel.tp_size, parallel.pp_size, parallel.rank))
    return DiskKVTier(config.cache.kv_offloading_disk_path, num_records, identity,
                      parallel.rank)


def has_tier_ops(plan: SchedulerOutput) -> bool:
    """Whether the plan carries any copy for the KV tiers."""
    return bool(plan.kv_offloads or plan.kv_onloads or plan.kv_spills or plan.kv_disk_drops
                or plan.kv_async_onloads)


@dataclass
class HostTierStats:
    """Cumulative worker-side counters (blocks, bytes, seconds)."""

    offloaded_blocks: int = 0
    onloaded_blocks: int = 0
    offloaded_bytes: int = 0
    onloaded_bytes: int = 0
    failed_onloads: int = 0  # hash or checksum mismatch: recomputed instead
    onload_seconds: float = 0.0
    offload_seconds: float = 0.0
    async_onload_seconds: float = 0.0  # the background thread's time (not the steps')


class HostKVTier:
    """`num_slots` blocks of host memory shaped like `kv_caches`' blocks."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_slots: int,
                 disk: DiskKVTier | None = None) -> None:
        pin = kv_caches[0][0].device.type == "cuda"
        self.num_slots = num_slots
        # Slot-major: one row of bytes per slot (`rows`), each layer's tensors views into
        # it in layer order, so a slot's CRC-32 is one call over one contiguous row (the
        # same value as chained over the pieces in order: the disk record's) and the
        # loader thread (asynchronous onloads) makes few calls that hold the GIL.
        sizes = [t[0].numel() * t.element_size() for pair in kv_caches for t in pair]
        self.rows = torch.empty((num_slots, sum(sizes)), dtype=torch.uint8, pin_memory=pin)
        self.tensors, offset = [], 0
        for pair in kv_caches:
            views = []
            for t in pair:
                n = t[0].numel() * t.element_size()
                if n == 0:  # a latent cache's empty value tensor
                    views.append(torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype,
                                             pin_memory=pin))
                else:
                    views.append(self.rows[:, offset:offset + n].view(t.dtype)
                                 .view(num_slots, *t.shape[1:]))
                offset += n
            self.tensors.append(tuple(views))
        self._rows_np = self.rows.numpy()
        # The layout identity the slots were written under: onloads into another cache
        # shape (a reconfigured worker) are refused.
        self.layout = self._layout(kv_caches)
        self._hash: list[bytes | None] = [None] * num_slots
        self._crc: list[int] = [0] * num_slots
        self.stats = HostTierStats()
        self.disk = disk
        self.block_bytes = sum(t[0].numel() * t.element_size() for pair in self.tensors for t in pair)
        self.onloader = AsyncOnloader(self)

    @staticmethod
    def _layout(kv_caches) -> tuple:
        return tuple((tuple(t.shape[1:]), t.dtype) for pair in kv_caches for t in pair)

    def holds(self, slot: int, block_hash: bytes) -> bool:
        return 0 <= slot < self.num_slots and self._hash[slot] == block_hash

    def _checksum(self, slot: int) -> int:
        return zlib.crc32(self._rows_np[slot])

    def _checksums(self, slots: list[int]) -> list[int]:
        """Each slot's CRC-32, in order; on several threads where the host has cores
        to spare (zlib releases the GIL on large buffers). Why: the CRC is most of a
        block's copy time. The first GPU run measured 1.6 ms per 2 MiB block (8B
        shapes) to offload or onload, a CRC-32 running at about 1.8 GB/s. That is
        slower than recomputing the block on an H200."""
        pool = _checksum_pool()
        if pool is None or len(slots) < 2:
            return [self._checksum(slot) for slot in slots]
        return list(pool.map(self._checksum, slots))

    # ------------------------------------------------------------------ copies
    def offload(self, kv_caches, ops) -> None:
        """Device blocks -> slots (one indexed copy per tensor), then each slot's CRC."""
        if not ops:
            return
        start = time.perf_counter()
        device = kv_caches[0][0].device
        slots, block_ids = [op.slot for op in ops], [op.block_id for op in ops]
        if device.type == "cpu":
            for dev_pair, host_pair in zip(kv_caches, self.tensors):
                for dev, host in zip(dev_pair, host_pair):
                    _copy_blocks(host, slots, dev, block_ids)
        else:
            _offload_from_device(self.tensors, kv_caches, slots, block_ids, device)
        crcs = dict(zip(slots, self._checksums(list(dict.fromkeys(slots)))))
        for op in ops:  # a later op on the same slot wins, as in the scheduler's index
            self._hash[op.slot] = op.block_hash
            self._crc[op.slot] = crcs[op.slot]
        self.stats.offloaded_blocks += len(ops)
        self.stats.offloaded_bytes += len(ops) * self.block_bytes
        self.stats.offload_seconds += time.perf_counter() - start

    def spill(self, kv_caches, ops: list[KVSpill]) -> None:
        """Slots (or device blocks) -> disk records. A slot is written only if it still
        holds its hash and matches its CRC (a bad slot is not: its block is recomputed
        later)."""
        if self.disk is None or not ops:
            return
        start = time.perf_counter()
        for op in ops:
            if op.block_id >= 0:
                pieces = [t[op.block_id].cpu().contiguous().view(torch.uint8).numpy()
                          for pair in kv_caches for t in pair if t.shape[-1]]
                crc = 0
                for piece in pieces:
                    crc = zlib.crc32(piece, crc)
                self.disk.write(op.block_hash, pieces, crc)
                continue
            if not self.holds(op.slot, op.block_hash):
                continue
            pieces = [t[op.slot].view(torch.uint8).numpy() for pair in self.tensors
                      for t in pair if t.shape[-1]]
            crc = 0
            for piece in pieces:
                crc = zlib.crc32(piece, crc)
            if crc == self._crc[op.slot]:
                self.disk.write(op.block_hash, pieces, crc)
        self.disk.stats.write_seconds += time.perf_counter() - start

    def onload_disk(self, kv_caches, ops: list[KVOnload]) -> list[KVOnload]:
        """Verified disk records -> device blocks; the ops that failed (not copied)."""
        if not ops:
            return []
        start = time.perf_counter()
        failed, good, payloads = [], [], []
        same_layout = self._layout(kv_caches) == self.layout
        for op in ops:
            payload = self.disk.read(op.block_hash, self.block_bytes) \
                if self.disk is not None and same_layout else None
            if payload is None:
                failed.append(op)
                continue
            good.append(op)
            payloads.append(payload)
        if good and self.block_bytes:
            # The verified records side by side in rows like the slots', then one
            # indexed copy per tensor (not one per tensor and block).
            staging = torch.empty((len(good), self.block_bytes), dtype=torch.uint8)
            for i, payload in enumerate(payloads):
                staging[i].copy_(torch.frombuffer(payload, dtype=torch.uint8))
            dst = [op.block_id for op in good]
            offset = 0
            for dev_pair, host_pair in zip(kv_caches, self.tensors):
                for dev, host in zip(dev_pair, host_pair):
                    n = host[0].numel() * host.element_size()
                    if n:
                        src = staging[:, offset:offset + n].view(host.dtype).view(
                            len(good), *host.shape[1:])
                        _scatter_blocks(dev, dst, src)
                    offset += n
        if self.disk is not None:  # the blocks and failures are counted in disk.stats
            self.disk.stats.read_seconds += time.perf_counter() - start
        return failed

    def onload_blocks(self, kv_caches, ops: list[KVOnload]) -> set[int]:
        """The asynchronous path (the loader thread, on its stream): verified slots and
        records -> device blocks, with no device-wide synchronize; the device block ids
        that failed (not copied)."""
        failed = self.onload(kv_caches, [op for op in ops if op.medium != "disk"], sync=False)
        failed += self.onload_disk(kv_caches, [op for op in ops if op.medium == "disk"])
        return {op.block_id for op in failed}

    def add_async_seconds(self, seconds: float) -> None:
        self.stats.async_onload_seconds += seconds

    def poll(self, agree=None, wait_s: float = 0.0) -> tuple[set[str], set[int]]:
        """The asynchronous onloads every rank finished (`AsyncOnloader.poll`)."""
        return self.onloader.poll(agree, wait_s)

    def onload(self, kv_caches, ops: list[KVOnload], sync: bool = True) -> list[KVOnload]:
        """Verified slots -> device blocks; the ops that failed (not copied). `sync`:
        wait for the copies on the whole device (the step path)."""
        if not ops:
            return []
        start = time.perf_counter()
        same_layout = self._layout(kv_caches) == self.layout
        held = [same_layout and self.holds(op.slot, op.block_hash) for op in ops]
        crcs = iter(self._checksums([op.slot for op, h in zip(ops, held) if h]))
        good, failed = [], []
        for op, h in zip(ops, held):  # crcs holds one value per held op, in order
            ok = h and next(crcs) == self._crc[op.slot] \
                and fault_injection.check("kv_onload.block") != "fail"
            (good if ok else failed).append(op)
        if failed:
            logger.warning("KV host tier: %d of %d onloaded blocks failed their hash or "
                           "checksum; recomputing them", len(failed), len(ops))
        if good:
            device = kv_caches[0][0].device
            for dev_pair, host_pair in zip(kv_caches, self.tensors):
                for dev, host in zip(dev_pair, host_pair):
                    _copy_blocks(dev, [op.block_id for op in good], host,
                                 [op.slot for op in good])
            if device.type == "cuda" and sync:
                torch.cuda.synchronize(device)
        self.stats.onloaded_blocks += len(good)
        self.stats.onloaded_bytes += len(good) * self.block_bytes
        self.stats.failed_onloads += len(failed)
        self.stats.onload_seconds += time.perf_counter() - start
        return failed

    def apply(self, kv_caches, plan: SchedulerOutput, block_size: int,
              agree=None) -> SchedulerOutput:
        """Run the plan's copies (offloads, then onloads); the plan the forward runs:
        a request with a failed onload starts at its first failed block instead, its
        tokens from there on scheduled this step (recomputed, so the answer holds).

        `agree` (a worker group's ranks, each holding its own share of every block):
        given one 0/1 failure flag per `plan.kv_onloads` entry, the flags of every rank
        OR-ed together, so every rank recomputes what any rank could not onload and
        the ranks run the same plan."""
        self.spill(kv_caches, plan.kv_spills)
        if self.disk is not None:
            for block_hash in plan.kv_disk_drops:
                self.disk.drop(block_hash)
            self.disk.trim()
        self.offload(kv_caches, plan.kv_offloads)
        failed = self.onload(kv_caches, [op for op in plan.kv_onloads if op.medium != "disk"])
        failed += self.onload_disk(kv_caches, [op for op in plan.kv_onloads
                                               if op.medium == "disk"])
        if plan.kv_async_onloads:  # after the offloads: a slot this step wrote is ready
            self.onloader.submit(kv_caches, plan.kv_async_onloads)
        if agree is not None and plan.kv_onloads:
            bad = {(op.req_id, op.block_index) for op in failed}
            flags = agree([int((op.req_id, op.block_index) in bad) for op in plan.kv_onloads])
            failed = [op for op, flag in zip(plan.kv_onloads, flags) if flag]
        if not failed:
            return plan
        restart: dict[str, int] = {}
        for op in failed:
            restart[op.req_id] = min(restart.get(op.req_id, op.block_index), op.block_index)
        new_reqs, scheduled = [], dict(plan.num_scheduled_tokens)
        for data in plan.scheduled_new_reqs:
            if data.req_id in restart:
                start = restart[data.req_id] * block_size
                scheduled[data.req_id] += data.num_computed_tokens - start
                data = dataclasses.replace(data, num_computed_tokens=start)
            new_reqs.append(data)
        return dataclasses.replace(plan, scheduled_new_reqs=new_reqs,
                                   num_scheduled_tokens=scheduled,
                                   total_num_scheduled_tokens=sum(scheduled.values()))


def _copy_blocks(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor,
                 src_ids: list[int]) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]]. Host to device: one host gather, one copy
    (from pageable memory: staged before it returns, so the temporary may go) and one
    device scatter per tensor, on the current stream (the caller synchronizes). Device
    to host goes through `_offload_from_device`, never here. Host to
    host: one numpy fancy-index copy per tensor (single-threaded, the GIL released):
    on a busy CPU torch's multithreaded index ops were 5-25x slower than one slice copy
    per block, and the numpy copy as fast as those or faster with 60x fewer calls
    (64 blocks x 60 tensors of 12 KiB: 31-46 ms against 56-66 ms, load average 9),
    which matters on the loader thread of asynchronous onloads (each call it makes may
    hold the GIL the step's thread needs)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        _numpy_bytes(dst)[dst_ids] = _numpy_bytes(src)[src_ids]
        return
    assert src.device.type == "cpu", "device-to-host copies go through _offload_from_device"
    src_index = torch.tensor(src_ids, dtype=torch.long, device=src.device)
    dst_index = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
    dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(dst.device, non_blocking=True))


_POOL: list = []  # [ThreadPoolExecutor | None], made on first use


def _checksum_pool():
    """A pool for slot checksums with half the host's cores (at most 8); None on a host
    of under 4 cores, where the threads would take cores from the model's own step."""
    if not _POOL:
        cores = os.cpu_count() or 1
        _POOL.append(ThreadPoolExecutor(max_workers=min(8, cores // 2),
                                        thread_name_prefix="kv-tier-crc")
                     if cores >= 4 else None)
    return _POOL[0]


def _offload_from_device(host_tensors, kv_caches, slots: list[int], block_ids: list[int],
                         device: torch.device) -> None:
    """host[slots[i]] = dev[block_ids[i]] for every (device, host) tensor pair: each
    tensor's blocks gathered on the device and copied to pinned staging asynchronously,
    ONE synchronize, then the host scatters. Invariant: no host read of a staged tensor
    before the synchronize. A non-blocking device-to-host copy's result is filled later,
    and scattering it at once (as this code did until the first GPU run) stored stale
    bytes under a checksum computed from them: a silent wrong answer on onload."""
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    staged = [(host, dev.index_select(0, index).to("cpu", non_blocking=True))
              for dev_pair, host_pair in zip(kv_caches, host_tensors)
              for dev, host in zip(dev_pair, host_pair)]
    torch.cuda.synchronize(device)
    for host, part in staged:
        _numpy_bytes(host)[slots] = _numpy_bytes(part)


def _numpy_bytes(t: torch.Tensor):
    """A numpy view of `t`'s bytes, blocks along the first axis (bf16 has no numpy dtype)."""
    return t.detach().view(torch.uint8).numpy()


def _scatter_blocks(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor) -> None:
    """dst[dst_ids[i]] = src[i] (src on the host)."""
    if dst.device.type == "cpu":
        _numpy_bytes(dst)[dst_ids] = _numpy_bytes(src)
        return
    index = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
    dst.index_copy_(0, index, src.to(dst.device))

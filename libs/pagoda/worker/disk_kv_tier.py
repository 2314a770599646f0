"""The worker's disk KV tier: the records behind the scheduler's disk index
(`pagoda.core.kv_disk_index`), below the host tier (`host_kv_tier.py`).

    <--kv-offloading-disk-path>/rank<R>/.lock             flock: one worker per rank dir
    <--kv-offloading-disk-path>/rank<R>/epoch-<E>/<name>  one record per block hash

Replicas given the same path each claim a directory of their own (`rank<R>.1`, ...);
the records of one are never read by another.

A record is one whole block of this rank's share (every layer's tensors, in the host
tier's order), behind a header:

    magic "PGKVDSK1" | identity (32) | epoch (16) | hash length (u32) |
    payload length (u64) | CRC-32 of the payload (u32) | block hash | zeros | payload

the payload starting at a multiple of 64 bytes (aligned copies whatever the hash length).

The identity is a digest of what the P/D handshake compares (`KvLayout`: the model,
the KV dtype, the block size, the layout and this rank's tensor shapes, the prefix
hash seed, the TP/PP shape and this rank). A record is onloaded only if its magic,
identity, epoch, hash, length and CRC all match; anything else (a missing file, a
short or corrupt one, another model's) is a failed onload, recomputed by the caller.

Restart: the tier is dropped by epoch. Each start takes a new epoch directory and
deletes the older ones: the scheduler's index of them died with the replica (or is
unknown to a new one), the records carry no token ids to re-verify a prefix with, and
not re-indexing is what lets writes skip fsync (a record lost to a crash is never read).

Writes go to a temporary file renamed into place, so a reader never sees half a record.
A write that fails (a full disk, a read-only directory, the fault point
"kv_disk.write") is logged and counted; its block is simply not on disk, and a later
onload of it fails and recomputes. Runs on the step thread; asynchronous onloads
read records on the loader thread (`kv_onload_async.py`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import struct
import threading
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import pagoda.fault_injection as fault_injection

logger = logging.getLogger(__name__)
MAGIC = b"PGKVDSK1"
_HEADER = struct.Struct("<8s32s16sIQI")
ALIGN = 64


def _payload_start(hash_len: int) -> int:
    return -(-(_HEADER.size + hash_len) // ALIGN) * ALIGN


@dataclass
class DiskTierStats:
    """Cumulative worker-side counters (blocks, bytes, seconds)."""

    written_blocks: int = 0
    written_bytes: int = 0
    failed_writes: int = 0  # the disk refused the record: it is not there
    read_blocks: int = 0
    read_bytes: int = 0
    failed_reads: int = 0  # missing, corrupt or foreign: recomputed instead
    dropped_blocks: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0


def layout_identity(fields: tuple) -> bytes:
    """32 bytes naming the model and cache layout a record was written under."""
    return hashlib.sha256(repr(fields).encode()).digest()


MAX_SHARERS = 64  # workers of one rank (replicas) that may share one --kv-offloading-disk-path


def _claim(root: Path, rank: int):
    """The first directory of `rank` under `root` no live worker holds (`rank<R>`, then
    `rank<R>.1`, ...: replicas started with the same path each get their own), and its
    lock, held for the life of the tier (the OS releases it when the process dies)."""
    for i in range(MAX_SHARERS):
        rank_dir = root / (f"rank{rank}" if i == 0 else f"rank{rank}.{i}")
        rank_dir.mkdir(parents=True, exist_ok=True)
        lock = open(rank_dir / ".lock", "a+b")  # noqa: SIM115 (held for life)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return rank_dir, lock
    raise RuntimeError(f"--kv-offloading-disk-path {root}: {MAX_SHARERS} workers of rank "
                       f"{rank} hold it already")


class DiskKVTier:
    """At most `num_records` block records of this rank under `root`."""

    def __init__(self, root: str | os.PathLike, num_records: int, identity: bytes,
                 rank: int = 0) -> None:
        if num_records <= 0:
            raise ValueError("the disk KV tier needs room for one block")
        self.num_records = num_records
        self.identity = identity
        rank_dir, self._lock = _claim(Path(root), rank)
        for stale in rank_dir.glob("epoch-*"):  # an earlier start's records: dropped
            shutil.rmtree(stale, ignore_errors=True)
        self.epoch = uuid.uuid4().bytes
        self.path = rank_dir / f"epoch-{self.epoch.hex()}"
        self.path.mkdir()
        self._records: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        # The step thread writes and drops, the loader thread (asynchronous onloads,
        # kv_onload_async.py) reads: the bookkeeping of `_records` is shared.
        self._records_lock = threading.Lock()
        self.stats = DiskTierStats()

    def _file(self, block_hash: bytes) -> Path:
        return self.path / hashlib.blake2b(block_hash, digest_size=20).hexdigest()

    # ------------------------------------------------------------------ write
    def write(self, block_hash: bytes, pieces: list, crc: int) -> bool:
        """Store `pieces` (buffers, in order) as the record of `block_hash`, whose
        payload's CRC-32 the caller computed; False when the disk refused it."""
        length = sum(memoryview(p).nbytes for p in pieces)
        header = _HEADER.pack(MAGIC, self.identity, self.epoch, len(block_hash), length, crc)
        target = self._file(block_hash)
        tmp = target.with_suffix(".tmp")
        try:
            if fault_injection.check("kv_disk.write") == "fail":
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(block_hash)
                f.write(bytes(_payload_start(len(block_hash)) - _HEADER.size - len(block_hash)))
                for piece in pieces:
                    f.write(piece)
            os.replace(tmp, target)
        except OSError as exc:
            self.stats.failed_writes += 1
            logger.warning("KV disk tier: writing a block failed (%s); it will be "
                           "recomputed when needed", exc)
            self._forget(block_hash, target)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        with self._records_lock:
            self._records[block_hash] = None
            self._records.move_to_end(block_hash)
        self.stats.written_blocks += 1
        self.stats.written_bytes += length
        return True

    def trim(self) -> None:
        """Delete the least recently used records beyond `num_records`. Called after a
        step's drops (a step's spills may overshoot until its drops run); with the
        scheduler's index in step nothing is left to trim, it only bounds the disk when
        the index forgot records (a scheduler restarted, reset_prefix_cache)."""
        while len(self._records) > self.num_records:
            with self._records_lock:
                victim = next(iter(self._records), None)
            if victim is None:
                return
            self.drop(victim)

    # ------------------------------------------------------------------ read
    def read(self, block_hash: bytes, length: int) -> memoryview | None:
        """The verified payload (`length` bytes) of `block_hash`'s record; None when it
        is missing, short, corrupt or written under another identity or epoch."""
        target = self._file(block_hash)
        try:
            with open(target, "rb") as f:  # writable: the caller's torch.frombuffer
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data):]
        except OSError:
            self.stats.failed_reads += 1
            with self._records_lock:
                self._records.pop(block_hash, None)
            return None
        view = memoryview(data)
        ok = len(data) >= _HEADER.size
        if ok:
            magic, identity, epoch, hash_len, payload_len, crc = _HEADER.unpack_from(view)
            start = _payload_start(hash_len)
            ok = (magic == MAGIC and identity == self.identity and epoch == self.epoch
                  and view[_HEADER.size:_HEADER.size + hash_len] == block_hash
                  and payload_len == length
                  and len(data) == start + length
                  and zlib.crc32(view[start:]) == crc)
        if not ok:
            self.stats.failed_reads += 1
            logger.warning("KV disk tier: a record failed its checks (corrupt, short or "
                           "foreign); recomputing its block")
            self._forget(block_hash, target)
            return None
        with self._records_lock:
            if block_hash in self._records:
                self._records.move_to_end(block_hash)
        self.stats.read_blocks += 1
        self.stats.read_bytes += length
        return view[start:]

    # ------------------------------------------------------------------ drop
    def drop(self, block_hash: bytes) -> None:
        """Delete `block_hash`'s record (the scheduler's index evicted it)."""
        self._forget(block_hash, self._file(block_hash))
        self.stats.dropped_blocks += 1

    def _forget(self, block_hash: bytes, target: Path) -> None:
        with self._records_lock:
            self._records.pop(block_hash, None)
        try:
            target.unlink(missing_ok=True)
        except OSError:
            pass

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        """Delete this epoch's records and release the directory."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock.close()

"""vLLM-format KV cache events over ZMQ (`--kv-events-config`), for llm-d's indexer.

The scheduler's engine thread hands every step's KV events to both publishers:
the kv-cache-manager's (Pagoda's Redis index) and this one. They are the same list,
drained from the block pool once per step (`EngineCore.take_kv_events`), so the
two views can never disagree on order or content: there is no second bookkeeping.

Wire format (vLLM's `vllm.distributed.kv_events`, msgspec array-like tagged
structs encoded as msgpack), one multipart message per step with events:

    [topic, seq (8 bytes, big-endian), payload]
    payload = [ts, [event, ...], data_parallel_rank]
    event   = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
               lora_id, medium, lora_name]
            | ["BlockRemoved", block_hashes, medium]
            | ["AllBlocksCleared"]

A block hash is the integer of its digest's last 8 bytes read big-endian (vLLM's
default; PAGODA_/VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends the digest bytes).
`medium` is "GPU", vLLM's name for the engine's own KV cache (also on a CPU run), "CPU"
for the host tier (as vLLM's OffloadingConnector publishes it), "DISK" for the disk tier;
Pagoda's events carry no adapter, so `lora_id` and `lora_name` are null.

Replay (`replay_endpoint`, a ROUTER socket): a client sends [b"", start_seq (8
bytes big-endian)] from a DEALER (or REQ) socket and gets back every buffered
batch from that sequence number on, as [b"", seq, payload], then [b"", -1, b""].
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from pagoda import envs
from pagoda.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagoda.services.scheduler.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_hash(digest: bytes, as_int: bool) -> int | bytes:
    """A block hash as vLLM publishes it (its `maybe_convert_block_hash`)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1) if as_int else bytes(digest)


def event_to_wire(event: KVEvent, int_hashes: bool) -> list:
    if isinstance(event, BlockStored):
        parent = (None if event.parent_block_hash is None
                  else external_hash(event.parent_block_hash, int_hashes))
        return ["BlockStored", [external_hash(h, int_hashes) for h in event.block_hashes],
                parent, list(event.token_ids), event.block_size, None, event.medium, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [external_hash(h, int_hashes) for h in event.block_hashes],
                event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: list[KVEvent], int_hashes: bool,
                 data_parallel_rank: int = 0) -> bytes:
    """One `KVEventBatch` as msgpack bytes."""
    return msgpack.packb([ts, [event_to_wire(e, int_hashes) for e in events],
                          data_parallel_rank], use_bin_type=True)


class ZmqKvEventPublisher:
    """Invariant: batches leave in the order `publish` was called, numbered 0, 1, ...
    (per process); the last `buffer_steps` of them stay available for replay. The
    engine thread never blocks: past `max_queue_size` waiting batches a batch is
    dropped (counted, logged), which a subscriber sees as missing blocks only."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.int_hashes = envs.get("PAGODA_KV_EVENTS_USE_INT_BLOCK_HASHES")
        self.num_dropped_batches = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:  # bind a wildcard or local address, connect to a remote one (vLLM's rule)
            endpoint = config.endpoint
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open the endpoint "
                             f"{config.endpoint!r} / replay_endpoint "
                             f"{config.replay_endpoint!r}: {exc}") from None
        self._last_drop_log = 0.0
        self._thread = threading.Thread(target=self._run, name="zmq-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing vLLM-format KV events on %s (replay: %s, topic %r)",
                    config.endpoint, config.replay_endpoint, config.topic)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (engine thread; never blocks)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), list(events)))
        except queue.Full:
            self.num_dropped_batches += 1
            now = time.monotonic()
            if now - self._last_drop_log > 30:
                self._last_drop_log = now
                logger.warning("KV event queue full (max_queue_size %d): batch dropped",
                               self.config.max_queue_size)

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self.int_hashes, self.data_parallel_rank)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
            except Exception:  # noqa: BLE001 - one bad batch must not end the thread
                logger.exception("could not publish a KV event batch")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("invalid KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

"""A KV event subscriber written from vLLM's documented schema, as llm-d's indexer is.

It knows only the wire format: a multipart ZMQ message [topic, seq (8 bytes
big-endian), msgpack KVEventBatch], the batch an array [ts, events,
data_parallel_rank], each event an array tagged by its class name
(["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]).
It decodes with plain msgpack (never Pagoda's encoder) and recomputes block hashes
with its own canonical-CBOR encoder and sha256, the first parent being vLLM's
NONE_HASH = sha256(cbor(seed string)): what `sha256_cbor` means to vLLM and llm-d.
"""

from __future__ import annotations

import hashlib

import msgpack
import zmq


def cbor(obj) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic) of None, ints >= 0, bytes, str, tuples."""
    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n < 1 << (8 * size):
                return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
        raise ValueError(n)
    if obj is None:
        return b"\xf6"
    if isinstance(obj, int):
        return head(0, obj)
    if isinstance(obj, bytes):
        return head(2, len(obj)) + obj
    if isinstance(obj, str):
        return head(3, len(obj.encode())) + obj.encode()
    if isinstance(obj, (tuple, list)):
        return head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(type(obj))


def none_hash(seed: str) -> bytes:
    return hashlib.sha256(cbor(seed)).digest()


def chain(tokens: list[int], block_size: int, parent: bytes) -> list[bytes]:
    """The sha256_cbor digests of every full block of `tokens` after `parent`."""
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(cbor((parent, tuple(tokens[i:i + block_size]), None))).digest()
        out.append(parent)
    return out


def low64(digest: bytes) -> int:
    """vLLM's integer form of a hash: the digest's last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def decode(frames: list[bytes], topic: bytes, block_size: int) -> tuple[int, list]:
    """(seq, events) of one message, checking each event against the schema."""
    got_topic, seq, payload = frames
    assert got_topic == topic
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and ts > 1e9 and dp_rank == 0
    for event in events:
        if event[0] == "BlockStored":
            _, hashes, parent, token_ids, size, lora_id, medium, lora_name = event
            assert size == block_size and len(token_ids) == block_size * len(hashes)
            assert lora_id is None and lora_name is None and medium == "GPU"
            assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
            assert parent is None or isinstance(parent, int)
        elif event[0] == "BlockRemoved":
            _, hashes, medium = event
            assert medium == "GPU" and hashes
        else:
            assert event == ["AllBlocksCleared"]
    return int.from_bytes(seq, "big"), events


def check_stored_hashes(events: list, block_size: int, seed: str) -> list[int]:
    """Recompute every BlockStored hash from its tokens and its parent's digest (which an
    earlier event must have announced); the stored hashes, in order."""
    digests: dict[int, bytes] = {}
    stored: list[int] = []
    for event in events:
        if event[0] != "BlockStored":
            continue
        _, hashes, parent, token_ids = event[:4]
        recomputed = chain(token_ids, block_size,
                           none_hash(seed) if parent is None else digests[parent])
        assert [low64(d) for d in recomputed] == hashes
        digests.update(zip(hashes, recomputed))
        stored += hashes
    return stored


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask vLLM's replay socket for every buffered batch from `start` on."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(20_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)

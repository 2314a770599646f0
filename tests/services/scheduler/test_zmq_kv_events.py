"""vLLM-format KV events (`--kv-events-config`) from a real engine, as llm-d sees them.

The subscriber (tests/vllm_kv_subscriber.py) knows only vLLM's documented wire
schema, decodes with plain msgpack and recomputes every block hash from the
published token ids with its own canonical-CBOR encoder: byte for byte what llm-d's
kv-cache indexer does with `sha256_cbor`.
"""

from __future__ import annotations

import socket
import threading

import pytest
import zmq
from vllm_kv_subscriber import chain, check_stored_hashes, low64, none_hash, replay
from vllm_kv_subscriber import decode as decode_message

from pagoda import LLM, SamplingParams
from pagoda.core.block_hash import hash_request_tokens
from pagoda.messages import EngineCoreRequest
from pagoda.services.scheduler.engine_loop import EngineLoop
from pagoda.services.scheduler.kv_events_config import parse_kv_events_config
from pagoda.services.scheduler.zmq_kv_events import ZmqKvEventPublisher

BS = 4
SEED = "0"  # what the vLLM pods / llm-d indexer would have as PYTHONHASHSEED
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPT_A = [1, 17, 23, 99, 5, 301, 8, 44, 12, 7, 7, 64, 65]  # 3 full blocks + 1
PROMPT_B = [2, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415]


def decode(frames: list[bytes]) -> tuple[int, list]:
    return decode_message(frames, b"kv", BS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ the engine side
@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # 7 blocks: PROMPT_B (5 with its output) evicts the last of PROMPT_A's cached blocks.
    return LLM(tiny_llama_dir, dtype="float32", block_size=BS, max_model_len=64,
               num_gpu_blocks_override=7, prefix_caching_hash_algo="sha256_cbor",
               prefix_cache_hash_seed=SEED)


def run(loop: EngineLoop, done: dict, request_id: str, prompt: list[int]) -> None:
    finished = done.setdefault(request_id, threading.Event())
    loop.submit(EngineCoreRequest(request_id, prompt, GREEDY), lambda error: None)
    assert finished.wait(60), f"{request_id} did not finish"


def test_kv_events_reach_a_vllm_subscriber_and_hash_like_llm_d(llm, tmp_path):
    core = llm.llm_engine.core
    core.take_kv_events()  # nothing from before this test
    # An ipc:// endpoint binds (vLLM's rule, as tcp://*:5557 does) and stays on this host.
    endpoint, replay_port = f"ipc://{tmp_path}/kv-events", free_port()
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv", '
        f'"endpoint": "{endpoint}", "replay_endpoint": "tcp://127.0.0.1:{replay_port}"}}')
    publisher = ZmqKvEventPublisher(config)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    done: dict[str, threading.Event] = {}

    def on_outputs(outputs) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                done.setdefault(out.request_id, threading.Event()).set()

    loop = EngineLoop(core, on_outputs, publisher.publish, lambda exc: None)
    loop.start()
    try:
        run(loop, done, "a", PROMPT_A)
        run(loop, done, "b", PROMPT_B)
        cleared = threading.Event()
        # As sleep mode resets it: between steps; the loop steps (and drains) after calls.
        loop.call_soon(lambda: (core.reset_prefix_cache(), cleared.set()))
        assert cleared.wait(30)
        live: dict[int, list] = {}
        while sub.poll(5000):  # until the clear arrives, or nothing more comes
            seq, events = decode(sub.recv_multipart())
            live[seq] = events
            if any(e[0] == "AllBlocksCleared" for e in events):
                break
        assert live, "no KV event batch arrived"
        # A subscriber that joined late asks the replay socket for what it missed.
        batches = dict(live)
        for seq, payload in replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0):
            got = decode([b"kv", seq.to_bytes(8, "big"), payload])[1]
            assert batches.setdefault(seq, got) == got  # replayed = what was published
        assert sorted(batches) == list(range(len(batches))), "sequence numbers have gaps"
        later = replay(ctx, f"tcp://127.0.0.1:{replay_port}", len(batches) - 1)
        assert [seq for seq, _ in later] == [len(batches) - 1]
    finally:
        loop.stop()
        publisher.stop()
        sub.close(linger=0)
        ctx.term()

    events = [e for seq in sorted(batches) for e in batches[seq]]
    tags = [e[0] for e in events]
    assert "BlockStored" in tags and "BlockRemoved" in tags and tags[-1] == "AllBlocksCleared"
    # Every stored block's hash, recomputed from its tokens and its parent's digest.
    stored = check_stored_hashes(events, BS, SEED)
    # Each prompt's full blocks, hashed from the prompt alone, were all announced.
    for prompt in (PROMPT_A, PROMPT_B):
        assert {low64(d) for d in chain(prompt, BS, none_hash(SEED))} <= set(stored)
    removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
    assert set(removed) <= set(stored)
    assert set(removed) & {low64(d) for d in chain(PROMPT_A, BS, none_hash(SEED))}


def test_the_engine_hash_is_vllms_sha256_cbor(llm):
    """The digests themselves (not only their low 64 bits), via the engine's own
    request hashing, equal the independent recomputation."""
    expected = chain(PROMPT_A, BS, none_hash(SEED))
    assert hash_request_tokens(PROMPT_A, BS, SEED, algo="sha256_cbor") == expected
    assert core_request_hashes(llm, PROMPT_A) == expected


def test_the_offline_engine_does_not_hoard_kv_events(llm):
    """LLM.generate has no event consumer: the pool's events are dropped every step."""
    llm.generate([{"prompt_token_ids": PROMPT_B}], GREEDY, use_tqdm=False)
    assert llm.llm_engine.core.take_kv_events() == []


def core_request_hashes(llm, prompt: list[int]) -> list[bytes]:
    request = llm.llm_engine.core.scheduler.add_request(EngineCoreRequest("h", prompt, GREEDY))
    try:
        return list(request.block_hashes)
    finally:
        llm.llm_engine.core.abort_requests(["h"])
        llm.llm_engine.core.take_kv_events()


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "publishr": "zmq"}', "unknown key(s) publishr"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of zmq"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
    ('{"buffer_steps": 0}', "buffer_steps must be at least 1"),
    ('{"endpoint": "localhost:5557"}', "endpoint must be a ZMQ address"),
])
def test_a_bad_kv_events_config_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match="--kv-events-config") as err:
        parse_kv_events_config(text)
    assert message in str(err.value)


def test_kv_events_config_defaults_are_vllms():
    on = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.replay_endpoint, on.buffer_steps, on.hwm,
            on.max_queue_size, on.topic) == ("zmq", "tcp://*:5557", None, 10_000, 100_000,
                                             100_000, "")
    assert on.publishes and not parse_kv_events_config('{"publisher": "null"}').publishes
    assert parse_kv_events_config(None) is None
    second = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5600"}').with_port_offset(1)
    assert (second.endpoint, second.replay_endpoint) == ("tcp://*:5558", "tcp://*:5601")


def test_a_taken_replay_endpoint_is_a_clear_error(tmp_path):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = parse_kv_events_config(
            f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{tmp_path}/kv", '
            f'"replay_endpoint": "tcp://127.0.0.1:{port}"}}')
        with pytest.raises(ValueError, match=f"cannot open .*127.0.0.1:{port}.*in use"):
            ZmqKvEventPublisher(config)
    finally:
        taken.close(linger=0)
        ctx.term()


def test_a_tier_block_goes_out_under_its_medium_as_vllm_sends_offloaded_blocks():
    from pagoda.core.kv_events import BlockRemoved as Removed, BlockStored as Stored
    from pagoda.services.scheduler.zmq_kv_events import event_to_wire

    digest = bytes(range(32))
    stored = event_to_wire(Stored([digest], None, [], BS, "CPU"), int_hashes=True)
    assert stored == ["BlockStored", [low64(digest)], None, [], BS, None, "CPU", None]
    assert event_to_wire(Removed([digest], "DISK"), True) == ["BlockRemoved", [low64(digest)],
                                                              "DISK"]
    assert event_to_wire(Removed([digest]), True)[2] == "GPU"

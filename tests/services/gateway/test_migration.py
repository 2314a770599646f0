"""Request migration over scripted replicas: a replica that goes away mid-stream, and the
choice continues on another one as if nothing happened (migration.py).

Each scripted replica plays one deterministic "model": output position p is SCRIPT[p],
whatever replica computes it, and a resumed request starts at its len(output_token_ids)
- so the text a client gets after a migration must equal the text without one.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest
from app_server import AppServer
from prometheus_client import REGISTRY

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.common import grpc_channels
from pagoda.services.common.protocol.scheduler import MIGRATION_REASON_KEY
from pagoda.services.gateway.app import create_app
from pagoda.services.gateway.serving_options import ServingOptions
from pagoda.services.tokenizer.servicer import TokenizerServicer

TEXT = (" One two three four five six seven eight nine ten eleven twelve thirteen fourteen"
        " fifteen sixteen seventeen eighteen nineteen twenty.")
EOS = 2


class ScriptReplica(spb_grpc.SchedulerServiceServicer):
    """Streams the script from the request's own position. `fail_at`: the output position
    at which the stream of a fresh request (and of a resumed one too, with
    `fail_resumed`) ends UNAVAILABLE, with `reason` as its migration reason if given."""

    def __init__(self, name: str, script: list[int], fail_at: int | None = None,
                 reason: str | None = None, fail_resumed: bool = False,
                 stall: bool = False) -> None:
        self.name, self.script = name, script
        self.fail_at, self.reason, self.fail_resumed = fail_at, reason, fail_resumed
        self.stall = stall  # at fail_at, go silent (a replica that stops answering)
        self.released = threading.Event()
        self.requests: list[spb.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        params = request.sampling_params
        position = len(request.output_token_ids)
        fails = self.fail_at is not None and (self.fail_resumed or not position)
        token = None
        while position < params.max_tokens:
            if fails and position >= self.fail_at:
                self._fail(context)
            token = self.script[position % len(self.script)]
            yield spb.GenerateResponse(chunk=spb.GenerateChunk(token_ids=[token]))
            position += 1
            if token == EOS and not params.ignore_eos:
                break
            time.sleep(0.002)
        if fails and position >= self.fail_at:  # after the last token, before `complete`
            self._fail(context)
        reason = cpb.FINISH_REASON_STOP if token == EOS else cpb.FINISH_REASON_LENGTH
        yield spb.GenerateResponse(complete=spb.GenerateComplete(finish_reason=reason))

    def _fail(self, context):
        if self.stall:
            self.released.wait(60)  # silent, connection open, until the test ends
        if self.reason:
            context.set_trailing_metadata(((MIGRATION_REASON_KEY, self.reason),))
        context.abort(grpc.StatusCode.UNAVAILABLE, "worker at 10.1.2.3:50053 died")

    def resumed(self) -> list[spb.GenerateRequest]:
        return [r for r in self.requests if r.output_token_ids]

    def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model="m", max_model_len=512, block_size=16,
                                        instance_id=self.name, served_model_name=["m"])

    def GetLoad(self, request, context):
        return spb.GetLoadResponse(serving=True)


@pytest.fixture
def script(smollm2_tokenizer) -> list[int]:
    return smollm2_tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture
def gateway(grpc_server_factory, smollm2_tokenizer):
    """start(replicas, **options) -> base URL of a gateway over them (round robin, so the
    first request lands on the first replica)."""
    servers = []

    def start(replicas, **options) -> str:
        tokenizer = grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                        TokenizerServicer(smollm2_tokenizer, "m", [EOS]))
        addresses = [grpc_server_factory(spb_grpc.add_SchedulerServiceServicer_to_server,
                                         r).address for r in replicas]
        app = create_app(tokenizer.address, addresses, router="round_robin",
                         options=ServingOptions(**options))
        servers.append(AppServer(app, ready=lambda url: _all_routable(url, len(replicas))))
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


def _all_routable(url: str, n: int) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200 and \
            len({httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                            timeout=10).headers.get("x-pagoda-instance")
                 for _ in range(2 * n)}) == n
    except httpx.HTTPError:
        return False


def stream(url: str, **body) -> tuple[str, list[dict], dict | None]:
    """(text, the chunks' choices, the usage chunk's usage) of one streamed completion."""
    reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": "Count", "stream": True, "stream_options": {"include_usage": True}, **body})
    assert reply.status_code == 200, reply.text
    events = [json.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert reply.text.rstrip().endswith("data: [DONE]")
    errors = [e for e in events if "error" in e]
    if errors:
        return "", [], errors[0]
    choices = [c for e in events for c in e["choices"]]
    usage = next((e["usage"] for e in events if e.get("usage") and not e["choices"]), None)
    return "".join(c["text"] for c in choices), choices, usage


def migrations(reason: str) -> float:
    return REGISTRY.get_sample_value("pagoda_gateway_migrations_total", {"reason": reason}) or 0


@pytest.mark.parametrize("reason", ["drain_timeout", "replica_failed", None])
def test_a_lost_replica_continues_on_another_with_the_same_text(gateway, script, reason):
    url = gateway([ScriptReplica("ok-a", script), ScriptReplica("ok-b", script)])
    expected, _, usage = stream(url, max_tokens=20)
    assert usage["completion_tokens"] == 20

    # Either replica fails a fresh request at token 7; a resumed one it serves.
    replicas = [ScriptReplica(name, script, fail_at=7, reason=reason) for name in "ab"]
    url = gateway(replicas)
    before = migrations(reason or "replica_lost")
    text, choices, usage = stream(url, max_tokens=20)
    assert text == expected and choices[-1]["finish_reason"] == "length"
    assert usage == {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": 20,
                     "total_tokens": usage["prompt_tokens"] + 20}  # every token once
    [resumed] = [r for replica in replicas for r in replica.resumed()]
    first = next(r for replica in replicas for r in replica.requests
                 if r.request_id == resumed.request_id.rsplit(".m", 1)[0])
    assert list(resumed.output_token_ids) == script[:7]
    assert resumed.prompt_token_ids == first.prompt_token_ids
    assert resumed.sampling_params == first.sampling_params  # same seed, same max_tokens
    assert migrations(reason or "replica_lost") == before + 1


def test_a_stop_string_across_the_migration_and_n_choices(gateway, script, smollm2_tokenizer):
    # The stop string starts in the first replica's tokens and ends in the second's.
    stop = smollm2_tokenizer.decode(script[4:9]).strip()
    replicas = [ScriptReplica(name, script, fail_at=6) for name in "ab"]
    url = gateway(replicas)
    _, choices, usage = stream(url, max_tokens=20, n=2, stop=[stop])
    per_choice = {i: "".join(c["text"] for c in choices if c["index"] == i) for i in (0, 1)}
    whole = smollm2_tokenizer.decode(script[:9])
    expected = whole[:whole.index(stop)]
    assert per_choice == {0: expected, 1: expected}
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop", "stop"]
    assert sum(len(r.resumed()) for r in replicas) == 2  # each choice migrated on its own


def test_the_migration_limit_ends_the_stream_with_an_error_event(gateway, script):
    url = gateway([ScriptReplica(name, script, fail_at=3) for name in "ab"], migration_limit=0)
    _, _, error = stream(url, max_tokens=20)
    assert error["error"]["code"] == 503
    message = error["error"]["message"]
    assert "10.1.2.3" not in message and "died" not in message  # no peer's words or address
    assert "--migration-limit" in message

    # Both replicas fail resumed requests too: one move, then nowhere left to go.
    url = gateway([ScriptReplica(name, script, fail_at=3, fail_resumed=True) for name in "ab"])
    _, _, error = stream(url, max_tokens=20)
    assert error["error"]["code"] == 503 and "stopped answering" in error["error"]["message"]


def test_a_replica_lost_after_the_last_token_ends_the_choice_without_moving_it(gateway, script):
    # Lost between its last token (EOS at position 5) and its `complete`.
    eos_script = script[:5] + [EOS]
    replicas = [ScriptReplica(name, eos_script, fail_at=6) for name in "ab"]
    url = gateway(replicas)
    _, choices, usage = stream(url, max_tokens=20)
    assert choices[-1]["finish_reason"] == "stop" and usage["completion_tokens"] == 6
    # Lost after max_tokens tokens.
    replicas = [ScriptReplica(name, script, fail_at=8) for name in "ab"]
    url = gateway(replicas)
    _, choices, usage = stream(url, max_tokens=8)
    assert choices[-1]["finish_reason"] == "length" and usage["completion_tokens"] == 8
    assert not any(r.resumed() for r in replicas)  # nothing was left to move


def test_a_replica_that_stops_answering_loses_its_choice_to_another(gateway, script,
                                                                    monkeypatch):
    """A replica that keeps its connection but sends nothing: the gateway's bounded read
    gives up on it (here after 1 s instead of 300) and the choice moves on."""
    monkeypatch.setattr(grpc_channels, "GENERATE_READ_TIMEOUT_S", 1.0)
    replicas = [ScriptReplica(name, script, fail_at=5, stall=True) for name in "ab"]
    try:
        url = gateway([ScriptReplica("ok-a", script), ScriptReplica("ok-b", script)])
        expected, _, _ = stream(url, max_tokens=12)
        url = gateway(replicas)
        before = migrations("replica_lost")
        text, choices, usage = stream(url, max_tokens=12)
        assert text == expected and usage["completion_tokens"] == 12
        assert migrations("replica_lost") == before + 1
    finally:
        for replica in replicas:
            replica.released.set()


class ImageTokenizer(TokenizerServicer):
    """The real servicer, with the media step scripted: a chat with an image becomes the
    rendered prompt plus a 4-token run carrying one small typed tensor (what the model's
    processor would return), so migration can be checked without a vision model."""

    def _encode_with_media(self, request):
        import torch  # lazy: only this scripted media step builds a tensor

        from pagoda.multimodal.inputs import MultiModalFeature
        ids = [5, 6] + [7] * 4 + [8]
        pixels = torch.arange(12, dtype=torch.float32).reshape(3, 2, 2)
        return "prompt", ids, [MultiModalFeature("image", "ab" * 32, 2, 4,
                                                 {"pixel_values": pixels})]


def test_a_migrated_request_carries_its_image_features(grpc_server_factory, smollm2_tokenizer,
                                                       script):
    tokenizer = grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                    ImageTokenizer(smollm2_tokenizer, "m", [EOS]))
    replicas = [ScriptReplica(name, script, fail_at=5, reason="replica_failed")
                for name in "ab"]
    addresses = [grpc_server_factory(spb_grpc.add_SchedulerServiceServicer_to_server,
                                     r).address for r in replicas]
    server = AppServer(create_app(tokenizer.address, addresses, router="round_robin"),
                       ready=lambda url: _all_routable(url, 2))
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "What is it?"}]}], "max_tokens": 12})
        assert reply.status_code == 200, reply.text
    finally:
        server.stop()
    [resumed] = [r for replica in replicas for r in replica.resumed()]
    first = next(r for replica in replicas for r in replica.requests
                 if r.request_id == resumed.request_id.rsplit(".m", 1)[0])
    assert len(first.mm_features) == 1
    assert len(first.mm_features[0].data.tensors["pixel_values"].data) == 48  # 12 float32
    assert list(resumed.mm_features) == list(first.mm_features)  # pixels, run, identifier

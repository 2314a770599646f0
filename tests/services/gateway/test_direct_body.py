"""Streamed body chunks skip the middleware only where every middleware lets them
through (services/gateway/web/direct_body.py); the response's start and end never do."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pagoda.services.gateway.app import create_app
from pagoda.services.gateway.web.direct_body import DirectStreamingResponse, GatewayApp

CHUNKS = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]


class _Recorder:
    """Records what its `send` sees: (type, more_body) per message."""

    passes_body_through = True
    seen: list[tuple[str, bool]] = []

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def recording_send(message) -> None:
            _Recorder.seen.append((message["type"], message.get("more_body", False)))
            await send(message)

        await self.app(scope, receive, recording_send)


class _Upper:
    """Rewrites body chunks (as gzip would change them): says nothing of passing them."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def upper_send(message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": message.get("body", b"").upper()}
            await send(message)

        await self.app(scope, receive, upper_send)


def _app(*middleware) -> GatewayApp:
    app = GatewayApp()

    async def chunks():
        for chunk in CHUNKS:
            yield chunk

    @app.get("/stream")
    async def stream():
        return DirectStreamingResponse(chunks(), media_type="text/event-stream")

    for cls in middleware:
        app.add_middleware(cls)
    return app


def test_chunks_skip_middleware_that_let_them_through():
    _Recorder.seen = []
    app = _app(_Recorder)
    reply = TestClient(app).get("/stream")
    assert reply.status_code == 200 and reply.content == b"".join(CHUNKS)
    assert app.direct_body
    # The start and the end went through it, none of the chunks between.
    assert _Recorder.seen == [("http.response.start", False), ("http.response.body", False)]


def test_one_middleware_that_may_change_bodies_sends_every_chunk_through_the_stack():
    _Recorder.seen = []
    app = _app(_Recorder, _Upper)
    reply = TestClient(app).get("/stream")
    assert not app.direct_body
    assert reply.content == b"".join(CHUNKS).upper()
    assert _Recorder.seen.count(("http.response.body", True)) == len(CHUNKS)


def test_the_gateway_app_streams_past_its_middleware():
    """Every middleware the gateway adds says it lets body chunks through; one that is
    added without saying so (or a new one) would turn the skip off, and fail here."""
    app = create_app("127.0.0.1:1", ["127.0.0.1:2"])
    app.build_middleware_stack()
    assert app.direct_body, [m.cls.__name__ for m in app.user_middleware]

"""The scheduler serves once its structured-output backend is built, but a backend that
fails or hangs never keeps the replica from serving."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from pagoda.services.scheduler import server


def test_waits_for_a_backend_that_is_still_loading():
    ready = concurrent.futures.Future()
    threading.Timer(0.3, lambda: ready.set_result("backend")).start()
    start = time.monotonic()
    server.wait_for_grammar_backend(ready)
    assert ready.done() and time.monotonic() - start >= 0.25


def test_a_failed_backend_is_logged_and_serving_goes_on(caplog):
    ready = concurrent.futures.Future()
    ready.set_exception(OSError("no tokenizer here"))
    with caplog.at_level(logging.WARNING):
        server.wait_for_grammar_backend(ready)
    assert "no tokenizer here" in caplog.text


def test_a_hung_backend_is_waited_for_only_so_long(monkeypatch, caplog):
    monkeypatch.setattr(server, "GRAMMAR_WARM_UP_WAIT_S", 0.2)
    ready = concurrent.futures.Future()
    with caplog.at_level(logging.WARNING):
        server.wait_for_grammar_backend(ready)
    assert not ready.cancelled() and not ready.done()  # it keeps loading behind
    assert "still loading" in caplog.text

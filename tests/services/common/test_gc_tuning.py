"""The collector's serving settings (gc_tuning.py), and that the streaming services use
them: a 220k-object tokenizer heap left unfrozen cost a ~300 ms gen-2 pass mid-stream
(every stream it detokenizes waits), measured at 15 ms steps and 256 streams."""

import argparse
import gc

import pytest

from pagoda.services.common import gc_tuning
from pagoda.services.tokenizer import server as tokenizer_server


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_prepare_freezes_the_heap_and_raises_gen0(restore_gc):
    gc.unfreeze()
    kept = [{"i": i} for i in range(1000)]  # tracked containers alive now
    gc_tuning.prepare_gc_for_serving()
    assert gc.get_freeze_count() >= len(kept)
    assert gc.get_threshold()[0] == gc_tuning.GEN0_THRESHOLD


def test_the_tokenizer_freezes_its_loaded_heap_before_serving(monkeypatch, restore_gc):
    """Order matters: frozen after the tokenizer is loaded (so its vocabulary and
    templates are in the frozen set), before the server takes requests."""
    events = []
    monkeypatch.setattr(tokenizer_server, "template_limits_from_args", lambda args: None)
    monkeypatch.setattr(tokenizer_server, "build_servicer",
                        lambda *a, **k: events.append("loaded") or argparse.Namespace())
    monkeypatch.setattr(tokenizer_server, "build_media", lambda servicer, args: None)
    monkeypatch.setattr(tokenizer_server, "prepare_gc_for_serving",
                        lambda: events.append("frozen"))
    monkeypatch.setattr(tokenizer_server, "serve_sync", lambda *a, **k: events.append("serving"))
    args = argparse.Namespace(model="m", tokenizer=None, prefix_cache_hash_seed=None,
                              chat_template=None, revision=None, tokenizer_revision=None,
                              download_dir=None, prefix_caching_hash_algo="sha256")
    assert tokenizer_server.main(args) == 0
    assert events == ["loaded", "frozen", "serving"]

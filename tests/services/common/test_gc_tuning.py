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


def test_the_gpu_worker_freezes_its_model_before_serving(monkeypatch, restore_gc):
    """After the model is loaded (its modules in the frozen set), before steps run."""
    from types import SimpleNamespace

    from pagoda.services.gpu_worker import server as worker_server

    events = []
    config = SimpleNamespace(model="m", dtype="float32", device="cpu", lora=None,
                             world_size=1, cache=SimpleNamespace(block_size=16,
                                                                num_state_checkpoints=0),
                             arch=SimpleNamespace(vocab_size=10),
                             scheduler=SimpleNamespace(max_model_len=64))
    engine_args = SimpleNamespace(create_engine_config=lambda: config)
    monkeypatch.setattr(worker_server, "EngineArgs",
                        SimpleNamespace(from_cli_args=lambda args: engine_args))
    monkeypatch.setattr(worker_server, "make_executor",
                        lambda cfg: events.append("loaded") or SimpleNamespace(shutdown=None))
    monkeypatch.setattr(worker_server, "kv_transfer_servicer",
                        lambda *a: (None, SimpleNamespace(renew_epoch=None), None))
    monkeypatch.setattr(worker_server, "prepare_gc_for_serving",
                        lambda: events.append("frozen"))
    monkeypatch.setattr(worker_server, "serve_sync", lambda *a, **k: events.append("serving"))
    assert worker_server.main(argparse.Namespace()) == 0
    assert events == ["loaded", "frozen", "serving"]

"""PAGODA_LOAD_THREADS: fewer torch threads while a model loads, the same weights, and
torch's own count back afterwards (pagoda.worker.load_threads)."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.loader import default_model_path
from pagoda.worker.load_threads import load_threads
from pagoda.worker.model_runner import ModelRunner


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_the_count_is_capped_inside_and_given_back_after(monkeypatch, two_threads):
    monkeypatch.setenv("PAGODA_LOAD_THREADS", "1")
    with load_threads():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="boom"), load_threads():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2  # given back on error too


@pytest.mark.parametrize("value", [None, "2", "8"])
def test_unset_or_not_below_torchs_count_changes_nothing(monkeypatch, two_threads, value):
    if value is None:
        monkeypatch.delenv("PAGODA_LOAD_THREADS", raising=False)
    else:
        monkeypatch.setenv("PAGODA_LOAD_THREADS", value)
    with load_threads():
        assert torch.get_num_threads() == 2  # never raised above torch's own count


def test_a_bad_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PAGODA_LOAD_THREADS", "0")
    with pytest.raises(ValueError, match="PAGODA_LOAD_THREADS"), load_threads():
        pass


def _loaded_tensors(monkeypatch, threads: str | None) -> dict[str, torch.Tensor]:
    if threads is None:
        monkeypatch.delenv("PAGODA_LOAD_THREADS", raising=False)
    else:
        monkeypatch.setenv("PAGODA_LOAD_THREADS", threads)
    # The default GGUF in bf16 without prepacking: the dequantizing, casting and int4
    # re-packing the window covers, with every packed buffer readable as a tensor.
    monkeypatch.setenv("PAGODA_CPU_PACKED_WEIGHTS", "0")
    config = EngineArgs(model=default_model_path(), dtype="bfloat16", max_model_len=256,
                        num_gpu_blocks_override=16).create_engine_config()
    assert config.gguf_int4
    runner = ModelRunner(config)
    runner.load_model()
    return {**dict(runner.model.named_parameters()),
            **dict(runner.model.named_buffers())}


def test_one_thread_loads_bit_equal_weights(monkeypatch, two_threads):
    """The default model's weights and int4 buffers are the same bits loaded with one
    thread (what `pagoda serve` gives a worker on a small machine) as with two."""
    capped = _loaded_tensors(monkeypatch, "1")
    assert torch.get_num_threads() == 2
    full = _loaded_tensors(monkeypatch, None)
    assert capped.keys() == full.keys()
    assert any(name.endswith("int4_weight") for name in full)
    for name, tensor in full.items():
        assert torch.equal(_bits(capped[name]), _bits(tensor)), name


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (a NaN equals itself)."""
    same_size = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                 torch.float32: torch.int32}
    return tensor.view(same_size[tensor.dtype]) if tensor.dtype in same_size else tensor

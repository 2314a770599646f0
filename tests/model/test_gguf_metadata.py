"""The vocabulary-free GGUF metadata reader agrees with gguf's own GGUFReader."""

from __future__ import annotations

import struct

import pytest
from gguf import GGUFReader

from pagoda.model import gguf_loader
from pagoda.model.gguf_metadata import MAX_ARRAY_KEPT, GGUFMetadata


@pytest.fixture(scope="module")
def both(smollm2_gguf_path):
    return GGUFMetadata(smollm2_gguf_path), GGUFReader(smollm2_gguf_path)


def test_every_field_reads_as_gguf_reads_it(both):
    mine, theirs = both
    assert list(mine.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    long_arrays = 0
    for key, field in mine.fields.items():
        assert len(field.data) == len(theirs.fields[key].data), key
        if field.value is None:  # a long array: its length only
            long_arrays += 1
            assert len(theirs.fields[key].data) > MAX_ARRAY_KEPT
            with pytest.raises(ValueError, match="gguf_reader"):
                field.contents()
        else:
            assert field.contents() == theirs.fields[key].contents(), key
    assert long_arrays >= 2  # the vocabulary and merges were skipped, not read


def test_every_tensor_is_listed_as_gguf_lists_it(both):
    mine, theirs = both
    assert [(t.name, t.tensor_type, tuple(t.shape)) for t in mine.tensors] == \
        [(t.name, t.tensor_type, tuple(int(d) for d in t.field.parts[3])) for t in theirs.tensors]


def test_every_tensor_has_gguf_readers_data(both):
    import numpy as np

    mine, theirs = both
    for a, b in zip(mine.tensors, theirs.tensors):
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_the_model_config_is_the_same_either_way(smollm2_gguf_path, monkeypatch):
    fast = gguf_loader.arch_config_from_gguf(smollm2_gguf_path)
    gguf_loader.gguf_metadata.cache_clear()
    monkeypatch.setattr(gguf_loader, "GGUFMetadata", lambda path: (_ for _ in ()).throw(
        ValueError("force the whole reader")))
    try:
        slow = gguf_loader.arch_config_from_gguf(smollm2_gguf_path)
    finally:
        gguf_loader.gguf_metadata.cache_clear()
    assert fast == slow


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + struct.pack("<I", 3))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFMetadata(str(path))

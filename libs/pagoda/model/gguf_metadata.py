"""A GGUF file's metadata and tensor directory, read without its vocabulary.

`gguf.GGUFReader` builds a numpy view for every part of every field: for a 49k-token
vocabulary and its merges that is ~150k arrays and seconds of CPU, paid by every
process that only wants the model's configuration (the tokenizer service, the
scheduler, the gpu-worker before it loads weights). This reader walks the same bytes
(GGUF v2/v3, little-endian) with `struct`, keeps scalar and short array values, and for
long arrays only their length; tensors keep name, type and shape (no data).

The interface is the part of GGUFReader's that the loaders read:
`fields[key].contents()`, `len(fields[key].data)` (an array's length) and
`tensors[i].name / .tensor_type / .shape / .data` (the data: a view of the memory-mapped
file, made on first use, shaped as GGUFReader shapes it).

Invariant: for every scalar field, string field and array of at most
`MAX_ARRAY_KEPT` items, `contents()` equals GGUFReader's; tensors come in file order
with the same names, types, shapes and data (checked in tests/model/test_gguf_metadata.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAX_ARRAY_KEPT = 64  # longer arrays (vocabularies, merges, scores) keep their length only
_MAGIC = b"GGUF"
# GGUFValueType: struct format of each scalar type.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Sized:
    """Stands for a long array's items: only its length is known."""

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length


@dataclass
class MetadataField:
    value: Any  # a scalar, a str, a list (short arrays) or None (long arrays)
    data: Any  # sized like GGUFReader's field.data: one entry per array item

    def contents(self) -> Any:
        if self.value is None:
            raise ValueError("a long GGUF array's items are not read by gguf_metadata; "
                             "use gguf_loader.gguf_reader")
        return self.value


# Unquantized tensor types and their numpy items (the rest are bytes, as in GGUFReader).
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUFReader reports it: GGUF's order (innermost first)
    offset: int = 0  # from the start of the file
    _file: GGUFMetadata | None = field(default=None, repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as GGUFReader gives them: plain types as their numpy dtype
        in numpy's (outermost-first) shape, quantized types as uint8 rows of blocks."""
        elements = int(np.prod(self.shape))
        dims = tuple(reversed(self.shape))
        if self.tensor_type in _PLAIN:
            dtype, count = _PLAIN[self.tensor_type], elements
        else:
            block, type_size = GGML_QUANT_SIZES[self.tensor_type]
            dtype, count = np.uint8, elements * type_size // block
            dims = quant_shape_to_byte_shape(dims, self.tensor_type)
        mapped = self._file.mapped()
        return np.ndarray((count,), dtype=dtype, buffer=mapped, offset=self.offset).reshape(dims)


class GGUFMetadata:
    """`fields` (key -> MetadataField) and `tensors` (TensorInfo, in file order)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map: np.memmap | None = None
        with open(path, "rb") as f:
            self._buf = f.read(_header_bytes(f))
        self._pos = 0
        if self._take(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here")
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, MetadataField] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        self.tensors: list[TensorInfo] = []
        offsets = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            kind = GGMLQuantizationType(self._unpack("<I"))
            offsets.append(self._unpack("<Q"))  # from the (aligned) start of the data
            self.tensors.append(TensorInfo(name, kind, dims, _file=self))
        alignment = self.fields["general.alignment"].value \
            if "general.alignment" in self.fields else 32
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: invalid alignment {alignment}")
        start = -(-self._pos // alignment) * alignment
        for tensor, offset in zip(self.tensors, offsets):
            tensor.offset = start + offset
        del self._buf

    def mapped(self) -> np.memmap:
        """The file, memory-mapped read-only (once)."""
        if self._map is None:
            self._map = np.memmap(self.path, mode="r")
        return self._map

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            raise EOFError("GGUF header longer than read")
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += size
        return value

    def _string(self) -> str:
        return self._take(self._unpack("<Q")).decode("utf-8")

    def _skip_string(self) -> None:
        length = self._unpack("<Q")  # (not `_pos += _unpack()`: that reads _pos first)
        self._pos += length

    def _value(self, kind: int) -> MetadataField:
        if kind in _SCALARS:
            value = self._unpack(_SCALARS[kind])
            return MetadataField(value, [value])
        if kind == _STRING:
            value = self._string()
            return MetadataField(value, [value])
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = self._unpack("<I"), self._unpack("<Q")
        if count <= MAX_ARRAY_KEPT:
            items = [self._value(item_kind).value for _ in range(count)]
            return MetadataField(items, items)
        if item_kind == _STRING:
            for _ in range(count):
                self._skip_string()
        elif item_kind in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[item_kind])
        else:  # arrays of arrays: walk them
            for _ in range(count):
                self._value(item_kind)
        return MetadataField(None, _Sized(count))


def _header_bytes(f) -> int:
    """How much of the file to read: the whole metadata and tensor directory sit before
    the (aligned) tensor data, which is what makes a file large; the header is at most
    tens of MiB even with a 256k vocabulary. Read it all, capped by the file size."""
    f.seek(0, 2)
    size = f.tell()
    f.seek(0)
    return min(size, 64 << 20)

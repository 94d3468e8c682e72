"""A GGUF file's header in one pass: metadata as Python values, tensors as views of its memory map.

The `gguf` package's GGUFReader builds numpy views of every metadata element (two for each
string: ~200k for a 49k-token vocabulary with its merges), seconds of every process's start-up
on a 2-core host, and each process that loads the default model pays them (API, engine core,
router). This reads the same header with `struct` over the mapped bytes, in tens of
milliseconds, and hands out the same `ReaderTensor` views, so the dequantisers and the block
loader read them unchanged. Little-endian files only: what llama.cpp writes; a byte-swapped
file is refused by name.

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata: key (u64 length + utf-8) | value type u32 | value
    tensor infos: name | n_dims u32 | dims u64 x n_dims (fastest first) | type u32 | offset u64
    padding to `general.alignment` (32) | tensor data
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_V = GGUFValueType
# Fixed-size value types: their struct code (little-endian).
_SCALAR_CODES: dict[GGUFValueType, str] = {
    _V.UINT8: "B", _V.INT8: "b", _V.UINT16: "H", _V.INT16: "h", _V.UINT32: "I", _V.INT32: "i",
    _V.FLOAT32: "f", _V.UINT64: "Q", _V.INT64: "q", _V.FLOAT64: "d", _V.BOOL: "?",
}  # fmt: skip
# Tensor types stored as typed elements; every other (block-quantised) type is handed out as bytes.
_ELEMENT_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]  # key -> int / float / bool / str, or a list of them
    tensors: list[ReaderTensor]  # in file order; `data` views the memory map (read-only)
    data_offset: int  # where the tensor data starts


def read_gguf(path: Path | str) -> GGUFFile:
    """Parse `path`'s header (ValueError naming the file if it is not a GGUF file we can read)."""
    path = Path(path)
    mapped = np.memmap(path, mode="r")
    # A plain ndarray view: slicing an np.memmap pays for its bookkeeping on every slice.
    data = np.asarray(mapped)
    try:
        return _Parser(path, data).file()
    except (struct.error, UnicodeDecodeError, KeyError, IndexError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: truncated or corrupt header ({exc})") from exc


class _Parser:
    def __init__(self, path: Path, data: np.ndarray) -> None:
        self.path = path
        self.data = data
        self.view = memoryview(data)  # type: ignore[arg-type]  # uint8 ndarray: bytes
        self.offset = 0

    def file(self) -> GGUFFile:
        if bytes(self.view[:4]) != GGUF_MAGIC:
            raise ValueError(
                f"{self.path} is not a readable GGUF file: magic {bytes(self.view[:4])!r}, expected {GGUF_MAGIC!r}"
            )
        self.offset = 4
        version = self._unpack("I")
        if version & 0xFFFF == 0:
            raise ValueError(f"{self.path} is a byte-swapped (big-endian) GGUF file, which servelm does not read")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"{self.path} is GGUF version {version}; servelm reads versions {SUPPORTED_VERSIONS}")
        num_tensors, num_metadata = self._unpack("Q"), self._unpack("Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_metadata):
            key = self._string()
            if key in metadata:
                raise ValueError(f"{self.path} repeats the metadata key {key!r}")
            metadata[key] = self._value(GGUFValueType(self._unpack("I")))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        data_offset = -(-self.offset // alignment) * alignment
        tensors = [self._tensor(info, data_offset) for info in infos]
        if len({t.name for t in tensors}) != len(tensors):
            raise ValueError(f"{self.path} names a tensor twice")
        return GGUFFile(self.path, version, metadata, tensors, data_offset)

    def _unpack(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.view, self.offset)
        self.offset += struct.calcsize(code)
        return value

    def _string(self) -> str:
        length = self._unpack("Q")
        start, self.offset = self.offset, self.offset + length
        return str(self.view[start : self.offset], "utf-8")

    def _value(self, value_type: GGUFValueType) -> Any:
        if value_type == _V.STRING:
            return self._string()
        if value_type in _SCALAR_CODES:
            return self._unpack(_SCALAR_CODES[value_type])
        if value_type == _V.ARRAY:
            item_type, count = GGUFValueType(self._unpack("I")), self._unpack("Q")
            return self._array(item_type, count)
        raise ValueError(f"{self.path}: unknown metadata value type {value_type}")

    def _array(self, item_type: GGUFValueType, count: int) -> list[Any]:
        if item_type in _SCALAR_CODES:  # one unpack for the whole array
            code = f"<{count}{_SCALAR_CODES[item_type]}"
            values = list(struct.unpack_from(code, self.view, self.offset))
            self.offset += struct.calcsize(code)
            return values
        read: Callable[[], Any] = self._string if item_type == _V.STRING else lambda: self._value(item_type)
        return [read() for _ in range(count)]

    def _tensor_info(self) -> tuple[int, str, tuple[int, ...], GGMLQuantizationType, int]:
        field_offset = self.offset
        name = self._string()
        num_dims = self._unpack("I")
        dims = tuple(self._unpack("Q") for _ in range(num_dims))
        tensor_type = GGMLQuantizationType(self._unpack("I"))
        return field_offset, name, dims, tensor_type, self._unpack("Q")

    def _tensor(
        self, info: tuple[int, str, tuple[int, ...], GGMLQuantizationType, int], data_offset: int
    ) -> ReaderTensor:
        field_offset, name, dims, tensor_type, relative_offset = info
        num_elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        num_bytes = num_elements * type_size // block_size
        start = data_offset + relative_offset
        if start + num_bytes > len(self.data):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated download?)")
        torch_order = tuple(reversed(dims))  # GGUF lists dimensions fastest first
        dtype = _ELEMENT_DTYPES.get(tensor_type)
        if dtype is None:  # blocks: rows of bytes
            values = self.data[start : start + num_bytes].reshape(quant_shape_to_byte_shape(torch_order, tensor_type))
        else:
            values = self.data[start : start + num_bytes].view(dtype).reshape(torch_order)
        return ReaderTensor(
            name=name,
            tensor_type=tensor_type,
            shape=np.array(dims, dtype=np.uint64),
            n_elements=num_elements,
            n_bytes=num_bytes,
            data_offset=start,
            data=values,
            field=ReaderField(field_offset, name),
        )

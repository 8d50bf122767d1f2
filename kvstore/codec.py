"""Wire codec: one layer of one or many blocks as a fixed binary header plus raw tensor bytes.

Layout (little-endian): header, then `num_blocks` 16-byte keys, then every block's K, then
every block's V. The checksum is a CRC-32 over the header (checksum excluded), the keys and
a 64-bit word sum of each page: it catches truncation, bit flips, swapped pages and foreign
or stale data at memory speed, where a CRC over the payload would halve Redis throughput.
It is not a MAC. Decoding validates every field and never unpickles anything.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from halfmoon.kvstore.errors import CorruptRecord
from halfmoon.kvstore.keys import KEY_BYTES
from halfmoon.kvstore.layout import KvLayout, LayerKV, tensor_bytes

MAGIC = b"HMKV"
VERSION = 1
MAX_BLOCKS = 1 << 16
MAX_DIM = 1 << 16
# magic, version, dtype code, flags, layer, num_blocks, block_size, num_kv_heads, head_dim,
# payload bytes; the checksum follows (40 bytes in all, so keys and pages stay 8-byte aligned).
_FIELDS = struct.Struct("<4sHBBIIIIIQ")
_CHECKSUM = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CHECKSUM.size

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.int8: 6,
    torch.uint8: 7,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(slots=True)
class RecordView:
    """A validated record whose K and V bytes still point into the record (nothing copied)."""

    keys: list[bytes]
    layer: int
    dtype: torch.dtype
    page_shape: tuple[int, int, int]
    k_bytes: memoryview
    v_bytes: memoryview

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    def copy_into(self, dst: LayerKV, start: int = 0) -> None:
        """Copy this record's blocks into rows `start:start + num_blocks` of `dst`."""
        rows = slice(start, start + self.num_blocks)
        if dst.k.dtype != self.dtype or dst.shape[1:] != self.page_shape:
            raise CorruptRecord(
                f"record holds pages {self.page_shape} {self.dtype}, "
                f"expected {dst.shape[1:]} {dst.k.dtype}"
            )
        np.copyto(tensor_bytes(dst.k[rows]), _bytes(self.k_bytes))
        np.copyto(tensor_bytes(dst.v[rows]), _bytes(self.v_bytes))

    def to_layer_kv(self) -> LayerKV:
        """A fresh LayerKV holding a copy of this record's K and V."""
        shape = (self.num_blocks, *self.page_shape)
        kv = LayerKV(torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))
        self.copy_into(kv)
        return kv


def gather_records(layout: KvLayout, records: Sequence[RecordView]) -> LayerKV:
    """One LayerKV holding the blocks of validated `records` in order, in one copy per K and V."""
    kv = LayerKV.empty(layout, sum(record.num_blocks for record in records))
    for record in records:
        if record.dtype != layout.dtype or record.page_shape != layout.page_shape:
            raise CorruptRecord(
                f"record holds pages {record.page_shape} {record.dtype}, "
                f"expected {layout.page_shape} {layout.dtype}"
            )
    np.concatenate([_bytes(r.k_bytes) for r in records], out=tensor_bytes(kv.k))
    np.concatenate([_bytes(r.v_bytes) for r in records], out=tensor_bytes(kv.v))
    return kv


def encode_layer(keys: Sequence[bytes], layer: int, kv: LayerKV) -> bytes:
    """Encode one layer of `len(keys)` blocks into one record."""
    if len(keys) != kv.num_blocks:
        raise ValueError(f"{len(keys)} keys for a payload of {kv.num_blocks} blocks")
    return encode_raw(
        keys, layer, kv.k.dtype, kv.shape[1:], [tensor_bytes(kv.k), tensor_bytes(kv.v)]
    )


def encode_raw(
    keys: Sequence[bytes],
    layer: int,
    dtype: torch.dtype,
    page_shape: Sequence[int],
    payload: Sequence[memoryview | np.ndarray],
) -> bytes:
    """Encode already-laid-out payload bytes (all K, then all V) under a header."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} has no wire code; use one of {list(DTYPE_CODES)}")
    for key in keys:
        if len(key) != KEY_BYTES:
            raise ValueError(f"block key must be {KEY_BYTES} bytes, got {len(key)}: {key!r}")
    if len(page_shape) != 3:
        raise ValueError(f"page shape {tuple(page_shape)} is not (block_size, kv heads, head_dim)")
    payload_bytes = sum(memoryview(part).nbytes for part in payload)
    header = (MAGIC, VERSION, DTYPE_CODES[dtype], 0, layer, len(keys), *page_shape, payload_bytes)
    fields = _FIELDS.pack(*header)
    key_bytes = b"".join(keys)
    page_bytes = math.prod(page_shape) * dtype.itemsize
    checksum = zlib.crc32(key_bytes, zlib.crc32(fields))
    for part in payload:
        checksum = zlib.crc32(_page_sums(part, page_bytes), checksum)
    return b"".join([fields, _CHECKSUM.pack(checksum), key_bytes, *payload])


def decode_layer(record: bytes | memoryview) -> RecordView:
    """Validate one record without copying its payload; raise CorruptRecord on any inconsistency."""
    view = memoryview(record)
    if view.nbytes < HEADER_BYTES:
        raise CorruptRecord(f"record of {view.nbytes} bytes is shorter than the header")
    fields = _FIELDS.unpack_from(view)
    magic, version, dtype_code, flags, layer, num_blocks, *page_shape, payload_bytes = fields
    if magic != MAGIC:
        raise CorruptRecord(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CorruptRecord(f"unsupported record version {version}, expected {VERSION}")
    if flags != 0:
        raise CorruptRecord(f"unknown flags {flags:#x}")
    if dtype_code not in CODE_DTYPES:
        raise CorruptRecord(f"unknown dtype code {dtype_code}")
    if not 0 < num_blocks <= MAX_BLOCKS:
        raise CorruptRecord(f"num_blocks {num_blocks} out of range 1..{MAX_BLOCKS}")
    if not all(0 < dim <= MAX_DIM for dim in page_shape):
        raise CorruptRecord(f"page shape {tuple(page_shape)} out of range 1..{MAX_DIM}")
    dtype = CODE_DTYPES[dtype_code]
    page_bytes = math.prod(page_shape) * dtype.itemsize
    if payload_bytes != 2 * num_blocks * page_bytes:
        raise CorruptRecord(
            f"payload of {payload_bytes} bytes does not hold K and V of {num_blocks} pages "
            f"{tuple(page_shape)} {dtype}"
        )
    keys_end = HEADER_BYTES + num_blocks * KEY_BYTES
    if view.nbytes != keys_end + payload_bytes:
        raise CorruptRecord(
            f"record is {view.nbytes} bytes, header says {keys_end + payload_bytes}"
        )
    (stored,) = _CHECKSUM.unpack_from(view, _FIELDS.size)
    checksum = zlib.crc32(view[HEADER_BYTES:keys_end], zlib.crc32(view[: _FIELDS.size]))
    checksum = zlib.crc32(_page_sums(view[keys_end:], page_bytes), checksum)
    if checksum != stored:
        raise CorruptRecord(f"checksum {checksum:#010x} does not match header {stored:#010x}")
    keys = [
        bytes(view[start : start + KEY_BYTES]) for start in range(HEADER_BYTES, keys_end, KEY_BYTES)
    ]
    half = keys_end + payload_bytes // 2
    return RecordView(keys, layer, dtype, tuple(page_shape), view[keys_end:half], view[half:])


def _page_sums(data: memoryview | np.ndarray, page_bytes: int) -> np.ndarray:
    """Wrapping 64-bit sum of each page of `data` (whole pages, 8-byte words where possible)."""
    flat = np.frombuffer(data, dtype=np.uint8)
    if page_bytes % 8 == 0:
        words = flat.view(np.uint64).reshape(-1, page_bytes // 8)
        return words.sum(axis=1, dtype=np.uint64)
    return flat.reshape(-1, page_bytes).sum(axis=1, dtype=np.uint64)


def _bytes(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8)

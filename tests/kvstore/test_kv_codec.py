from __future__ import annotations

import pickle
import struct

import pytest
import torch
from kv_helpers import LAYOUT, assert_same, make_keys, random_kv

from halfmoon.kvstore.codec import HEADER_BYTES, decode_layer, encode_layer, gather_records
from halfmoon.kvstore.errors import CorruptRecord

# Byte offsets of header fields (see codec._FIELDS).
VERSION_AT, DTYPE_AT, FLAGS_AT, LAYER_AT = 4, 6, 7, 8
BLOCKS_AT, SHAPE_AT, PAYLOAD_AT, CHECKSUM_AT = 12, 16, 28, 36


def record(num_blocks: int = 2, layer: int = 1) -> tuple[bytes, list[bytes]]:
    keys = make_keys(num_blocks)
    return encode_layer(keys, layer, random_kv(num_blocks)), keys


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    kv = random_kv(3)
    kv.k, kv.v = kv.k.to(dtype), kv.v.to(dtype)
    keys = make_keys(3)
    decoded = decode_layer(encode_layer(keys, 7, kv))
    assert decoded.keys == keys and decoded.layer == 7 and decoded.dtype == dtype
    assert_same(decoded.to_layer_kv(), kv)


def test_gather_records_concatenates_blocks_in_order() -> None:
    kvs = [random_kv(1, seed) for seed in range(3)]
    records = [decode_layer(encode_layer(make_keys(1), 0, kv)) for kv in kvs]
    gathered = gather_records(LAYOUT, records)
    assert torch.equal(gathered.k, torch.cat([kv.k for kv in kvs]))
    assert torch.equal(gathered.v, torch.cat([kv.v for kv in kvs]))


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "message"),
    [
        (0, "<I", 0x4B4D4858, "bad magic"),
        (VERSION_AT, "<H", 99, "unsupported record version"),
        (DTYPE_AT, "<B", 200, "unknown dtype code"),
        (FLAGS_AT, "<B", 1, "unknown flags"),
        (BLOCKS_AT, "<I", 0, "num_blocks 0 out of range"),
        (BLOCKS_AT, "<I", 1 << 30, "out of range"),
        (BLOCKS_AT, "<I", 3, "does not hold K and V"),
        (SHAPE_AT, "<I", 0, "page shape"),
        (SHAPE_AT, "<I", 1 << 20, "page shape"),
        (PAYLOAD_AT, "<Q", 1 << 40, "does not hold K and V"),
        (LAYER_AT, "<I", 2, "checksum"),
        (CHECKSUM_AT, "<I", 12345, "checksum"),
    ],
)
def test_decode_rejects_bad_header_field(offset: int, fmt: str, value: int, message: str) -> None:
    data, _ = record()
    with pytest.raises(CorruptRecord, match=message):
        decode_layer(patched(data, offset, fmt, value))


def test_decode_rejects_flipped_payload_bit() -> None:
    data, _ = record()
    out = bytearray(data)
    out[-5] ^= 0x10
    with pytest.raises(CorruptRecord, match="checksum"):
        decode_layer(bytes(out))


def test_decode_rejects_swapped_pages() -> None:
    data, _ = record(num_blocks=2)
    page = LAYOUT.page_bytes
    start = HEADER_BYTES + 2 * 16
    first, second = data[start : start + page], data[start + page : start + 2 * page]
    assert first != second
    swapped = data[:start] + second + first + data[start + 2 * page :]
    with pytest.raises(CorruptRecord, match="checksum"):
        decode_layer(swapped)


def test_decode_rejects_changed_key() -> None:
    data, _ = record()
    out = bytearray(data)
    out[HEADER_BYTES] ^= 1
    with pytest.raises(CorruptRecord, match="checksum"):
        decode_layer(bytes(out))


@pytest.mark.parametrize("cut", [0, 10, HEADER_BYTES, -1])
def test_decode_rejects_truncated_record(cut: int) -> None:
    data, _ = record()
    with pytest.raises(CorruptRecord):
        decode_layer(data[:cut])


def test_decode_rejects_trailing_bytes() -> None:
    data, _ = record()
    with pytest.raises(CorruptRecord, match="header says"):
        decode_layer(data + b"\0")


def test_decode_never_unpickles() -> None:
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    with pytest.raises(CorruptRecord, match="bad magic"):
        decode_layer(pickle.dumps(Boom()))
    with pytest.raises(CorruptRecord):
        decode_layer(pickle.dumps(random_kv(1)))


def test_encode_rejects_wrong_key_count_and_length() -> None:
    with pytest.raises(ValueError, match="2 keys for a payload of 1 blocks"):
        encode_layer(make_keys(2), 0, random_kv(1))
    with pytest.raises(ValueError, match="16 bytes"):
        encode_layer([b"short"], 0, random_kv(1))

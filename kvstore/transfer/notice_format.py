"""The notices' wire format: fixed binary records (a header, the receive key, a body),
checked field by field on decode, never unpickled (kvstore/transfer/channel.py sends them)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"HMKN"
LAYER, FIRST_TOKEN, HELLO, PAGES, RELEASE = 1, 2, 3, 4, 5
_HEAD = struct.Struct("<4sBH")  # magic, kind, length of the receive key (or the hello's name)
_LAYER = struct.Struct("<IHQI")  # unit, layer, lease to release (0: none), number of slots
_PAGES = struct.Struct("<IHI")  # unit, layer, number of pages
_TOKEN = struct.Struct("<q")
MAX_KEY_BYTES = 512
MAX_SLOTS = 4096  # a unit of 64k tokens in 16-token blocks; one message stays under 17 KiB
MAX_MESSAGE = _HEAD.size + MAX_KEY_BYTES + _LAYER.size + 4 * MAX_SLOTS


class NoticeError(ValueError):
    """A message that is not a well-formed notice."""


@dataclass(frozen=True, slots=True)
class UnitLayerNotice:
    """Layer `layer` of transfer unit `unit` of the receive `key` is ready; each kind of
    notice says where it is."""

    key: str
    unit: int
    layer: int


@dataclass(frozen=True, slots=True)
class LayerNotice(UnitLayerNotice):
    """The layer is in arena `slots`; the claim `lease` (0: none) is the reader's to release
    once it has copied the unit."""

    lease: int
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenNotice:
    """The first token of the receive `key`, sampled by its prefill."""

    key: str
    token_id: int


@dataclass(frozen=True, slots=True)
class PagesNotice(UnitLayerNotice):
    """The layer is in the sender's own KV pages `pages` (held for the reader until it sends
    `ReleaseNotice(key)`)."""

    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Hello:
    """First on a connection whose sender lends its pages: `key` is its Ray actor name."""

    key: str


@dataclass(frozen=True, slots=True)
class ReleaseNotice:
    """The reply: the reader needs none of the receive `key`'s lent pages any more."""

    key: str


Notice = LayerNotice | TokenNotice | PagesNotice | Hello | ReleaseNotice
_KINDS = {Hello: HELLO, ReleaseNotice: RELEASE}


def encode(notice: Notice) -> bytes:
    key = notice.key.encode()
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise NoticeError(f"receive key of {len(key)} bytes (1 to {MAX_KEY_BYTES})")
    if isinstance(notice, TokenNotice):
        return _HEAD.pack(MAGIC, FIRST_TOKEN, len(key)) + key + _TOKEN.pack(notice.token_id)
    if type(notice) in _KINDS:
        return _HEAD.pack(MAGIC, _KINDS[type(notice)], len(key)) + key
    if isinstance(notice, PagesNotice):
        if len(notice.pages) > MAX_SLOTS:
            raise NoticeError(f"{len(notice.pages)} pages in one notice (at most {MAX_SLOTS})")
        body = _PAGES.pack(notice.unit, notice.layer, len(notice.pages))
        pages = struct.pack(f"<{len(notice.pages)}I", *notice.pages)
        return _HEAD.pack(MAGIC, PAGES, len(key)) + key + body + pages
    if len(notice.slots) > MAX_SLOTS:
        raise NoticeError(f"{len(notice.slots)} slots in one notice (at most {MAX_SLOTS})")
    body = _LAYER.pack(notice.unit, notice.layer, notice.lease, len(notice.slots))
    slots = struct.pack(f"<{len(notice.slots)}I", *notice.slots)
    return _HEAD.pack(MAGIC, LAYER, len(key)) + key + body + slots


def decode(data: bytes) -> Notice:
    """The notice in `data`, or NoticeError saying what is wrong with it."""
    if len(data) < _HEAD.size:
        raise NoticeError(f"{len(data)} bytes: shorter than a header")
    magic, kind, key_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise NoticeError(f"magic {magic!r}, not {MAGIC!r}")
    if not 0 < key_len <= MAX_KEY_BYTES or len(data) < _HEAD.size + key_len:
        raise NoticeError(f"receive key of {key_len} bytes in a {len(data)}-byte message")
    try:
        key = data[_HEAD.size : _HEAD.size + key_len].decode()
    except UnicodeDecodeError as error:
        raise NoticeError(f"receive key is not UTF-8: {error}") from None
    rest = memoryview(data)[_HEAD.size + key_len :]
    if kind == FIRST_TOKEN:
        if len(rest) != _TOKEN.size:
            raise NoticeError(f"first-token notice with {len(rest)} bytes of body")
        (token_id,) = _TOKEN.unpack(rest)
        return TokenNotice(key, token_id)
    if kind in (HELLO, RELEASE):
        if len(rest):
            raise NoticeError(f"{'hello' if kind == HELLO else 'release'} with a body")
        return Hello(key) if kind == HELLO else ReleaseNotice(key)
    if kind == PAGES:
        if len(rest) < _PAGES.size:
            raise NoticeError(f"pages notice with {len(rest)} bytes of body")
        unit, layer, num_pages = _PAGES.unpack_from(rest)
        if len(rest) != _PAGES.size + 4 * num_pages or num_pages > MAX_SLOTS:
            raise NoticeError(f"pages notice of {num_pages} pages with {len(rest)} bytes of body")
        pages = struct.unpack_from(f"<{num_pages}I", rest, _PAGES.size)
        return PagesNotice(key, unit, layer, pages)
    if kind != LAYER:
        raise NoticeError(f"unknown notice kind {kind}")
    if len(rest) < _LAYER.size:
        raise NoticeError(f"layer notice with {len(rest)} bytes of body")
    unit, layer, lease, num_slots = _LAYER.unpack_from(rest)
    if len(rest) != _LAYER.size + 4 * num_slots or num_slots > MAX_SLOTS:
        raise NoticeError(f"layer notice of {num_slots} slots with {len(rest)} bytes of body")
    slots = struct.unpack_from(f"<{num_slots}I", rest, _LAYER.size)
    return LayerNotice(key, unit, layer, lease, slots)

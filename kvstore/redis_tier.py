"""Redis tier: cluster-wide block records with TTL; failures become misses, never exceptions.

Each value is a codec record followed by an HMAC-SHA256 tag over the Redis key and the record,
so a record written by anyone without the cluster's key (a forged one, however well formed)
is rejected. Connections come from a bounded pool a call waits on, so load never opens
more than `max_connections` per tier nor counts as an outage.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisError

from halfmoon.kvstore.codec import RecordView, decode_layer, encode_raw, gather_records
from halfmoon.kvstore.errors import CorruptRecord
from halfmoon.kvstore.layout import KvLayout, LayerKV, tensor_bytes
from halfmoon.kvstore.stats import TierStats

log = logging.getLogger(__name__)
TAG_BYTES = hashlib.sha256().digest_size


@dataclass(slots=True)
class RedisHits:
    """Blocks of one layer found in Redis: their indices in the request and their K/V."""

    indices: list[int] = field(default_factory=list)
    kv: LayerKV | None = None
    corrupt_keys: list[bytes] = field(default_factory=list)


class RedisTier:
    """One record per (block, layer) under `prefix + key + layer`, written and read in pipelines."""

    def __init__(
        self,
        url: str,
        layout: KvLayout,
        ttl_s: int = 3600,
        prefix: str = "hm:kv:",
        timeout_s: float = 1.0,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        hmac_key: bytes | None = None,
        password: str | None = None,
        max_connections: int = 64,
        pool_timeout_s: float = 5.0,
    ) -> None:
        """`hmac_key` None: a random key, so only this tier can read what it writes."""
        self.layout = layout
        self.ttl_s = ttl_s
        self.prefix = prefix.encode()
        self.stats = TierStats()
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._hmac_key = hmac_key or secrets.token_bytes(32)
        self._forgery_logged = False
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            **({"password": password} if password else {}),
        )
        self._client = aioredis.Redis(connection_pool=pool, decode_responses=False)

    @property
    def available(self) -> bool:
        """False from a failed call until a later call succeeds."""
        return self._down_since is None

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    def record_key(self, key: bytes, layer: int) -> bytes:
        return self.prefix + key + layer.to_bytes(2, "big")

    async def put_layer(self, keys: Sequence[bytes], layer: int, kv: LayerKV) -> bool:
        """Store one record per block of `keys`; False when Redis is unreachable."""
        kv.check(self.layout, len(keys))
        k_bytes, v_bytes = tensor_bytes(kv.k), tensor_bytes(kv.v)
        page = self.layout.page_bytes
        records = []
        for i, key in enumerate(keys):
            rows = slice(i * page, (i + 1) * page)
            records.append(self._record(key, layer, k_bytes[rows], v_bytes[rows]))
        return await self.put_records(records)

    def encode_block(self, key: bytes, data: torch.Tensor) -> list[tuple[bytes, bytes]]:
        """Records for every layer of one block laid out as a host slot (layer, K/V, page)."""
        flat = tensor_bytes(data)
        page = self.layout.page_bytes
        records = []
        for layer in range(self.layout.num_layers):
            base = 2 * layer * page
            k, v = flat[base : base + page], flat[base + page : base + 2 * page]
            records.append(self._record(key, layer, k, v))
        return records

    def seal(self, name: bytes, record: bytes) -> bytes:
        """`record` as stored under Redis key `name`: followed by its HMAC tag."""
        return record + self._tag(name, record)

    async def put_records(self, records: Sequence[tuple[bytes, bytes]]) -> bool:
        """SET every (redis key, sealed value) with the TTL in one pipeline; False on failure."""
        if not records or not self._may_try():
            return False
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for name, value in records:
                    pipe.set(name, value, ex=self.ttl_s)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return False
        self._mark_up()
        self.stats.bytes_written += sum(len(value) for _, value in records)
        return True

    async def get_layer(self, keys: Sequence[bytes], layer: int) -> RedisHits:
        """Fetch one layer of `keys`; corrupt records count as misses and are deleted."""
        hits = RedisHits()
        if not keys or not self._may_try():
            self.stats.misses += len(keys)
            return hits
        names = [self.record_key(key, layer) for key in keys]
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.get(name)
                values = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed(exc)
            self.stats.misses += len(keys)
            return hits
        self._mark_up()
        records = []
        for i, value in enumerate(values):
            record = self._validate(value, names[i], keys[i], layer) if value is not None else None
            if record is not None:
                hits.indices.append(i)
                records.append(record)
            elif value is not None:
                hits.corrupt_keys.append(keys[i])
        if hits.corrupt_keys:
            await self._delete([self.record_key(key, layer) for key in hits.corrupt_keys])
        self.stats.hits += len(records)
        self.stats.misses += len(keys) - len(records)
        if records:
            hits.kv = gather_records(self.layout, records)
            self.stats.bytes_read += hits.kv.nbytes
        return hits

    async def exists(self, keys: Sequence[bytes], layer: int) -> list[bool]:
        """Whether a record for `layer` of each block exists (not validated)."""
        if not keys or not self._may_try():
            return [False] * len(keys)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(self.record_key(key, layer))
                found = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return [False] * len(keys)
        self._mark_up()
        return [bool(count) for count in found]

    async def leading_depth(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of `keys` have a record for every layer (not validated)."""
        depth = len(keys)
        for layer in range(self.layout.num_layers):
            found = await self.exists(keys[:depth], layer)
            depth = found.index(False) if False in found else depth
            if depth == 0:
                break
        return depth

    async def close(self) -> None:
        await self._client.aclose()

    def _record(self, key: bytes, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[bytes, bytes]:
        """(Redis key, sealed record) of `layer` of block `key` from its K and V page bytes."""
        layout = self.layout
        value = encode_raw([key], layer, layout.dtype, layout.page_shape, [k, v])
        name = self.record_key(key, layer)
        return name, self.seal(name, value)

    def _tag(self, name: bytes, record: bytes | memoryview) -> bytes:
        mac = hmac.new(self._hmac_key, name, hashlib.sha256)
        mac.update(record)
        return mac.digest()

    def _authentic(self, name: bytes, value: bytes) -> memoryview | None:
        """The record in `value` if its tag is right, else None (counted, logged once)."""
        view = memoryview(value)
        record, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
        if len(value) > TAG_BYTES and hmac.compare_digest(self._tag(name, record), tag):
            return record
        self.stats.forged += 1
        self.stats.corrupt += 1
        if not self._forgery_logged:
            self._forgery_logged = True
            log.warning(
                "rejecting a Redis record whose HMAC does not match (forged, or written by a "
                "cluster with another store.redis_hmac_key); further ones are only counted"
            )
        return None

    def _validate(self, value: bytes, name: bytes, key: bytes, layer: int) -> RecordView | None:
        record = self._authentic(name, value)
        if record is None:
            return None
        try:
            record = decode_layer(record)
            if record.keys != [key] or record.layer != layer:
                raise CorruptRecord(f"record holds {record.keys} layer {record.layer}")
            if record.dtype != self.layout.dtype or record.page_shape != self.layout.page_shape:
                raise CorruptRecord(f"record pages {record.page_shape} {record.dtype}")
        except CorruptRecord as exc:
            self.stats.corrupt += 1
            log.warning(
                "deleting corrupt Redis record for block %s layer %d: %s", key.hex(), layer, exc
            )
            return None
        return record

    async def _delete(self, names: list[bytes]) -> None:
        try:
            await self._client.delete(*names)
        except (RedisError, OSError) as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        """A call failed: waiting too long for a pooled connection is load, anything else
        an outage."""
        if isinstance(exc.__cause__, asyncio.TimeoutError) and "No connection" in str(exc):
            self.stats.pool_timeouts += 1
            return
        self._mark_down(exc)

    def _may_try(self) -> bool:
        """While down, try again only every `retry_interval_s` so calls do not stall on connects."""
        return self._down_since is None or self._clock() >= self._retry_at

    def _mark_down(self, exc: BaseException) -> None:
        self.stats.errors += 1
        self._retry_at = self._clock() + self.retry_interval_s
        if self._down_since is None:
            self._down_since = self._clock()
            log.warning("Redis tier unreachable, serving misses until it returns: %s", exc)

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.warning("Redis tier reachable again after %.1f s", self._clock() - self._down_since)
            self._down_since = None

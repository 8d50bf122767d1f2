"""Store configuration: one validated schema with every default written once."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

MiB = 1 << 20
# Tokens per KV block, and so per block key: the engine's and the router's default.
BLOCK_SIZE = 16


class TransferSettings(BaseModel):
    """How KV crosses nodes (kvstore/transfer/engine.py): on Mooncake's Transfer Engine, the
    prefill worker writing each layer straight into the decode worker's registered staging
    memory, or (`ray`, and the fallback where the engine cannot start) as Ray objects through
    the store's stream. `auto`: the engine where the Ray cluster spans machines (its nodes
    have more than one address when the worker starts); on one machine nothing crosses a
    network, and this Mooncake release listens on every interface whatever address it is
    given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["auto", "mooncake", "ray"] = "auto"
    protocol: Literal["tcp", "rdma"] = "tcp"
    # RDMA devices to use (comma-separated, e.g. "mlx5_0,mlx5_1"); "auto": every one found.
    devices: str = "auto"
    # The address peers reach this node's engine at; None: the worker's Ray node address.
    host: str | None = None
    # Host memory each decode worker registers for prefill workers on other nodes to write
    # into; a prompt that does not fit comes through the store's stream instead.
    staging_bytes: int = Field(256 * MiB, gt=0)


class StoreSettings(BaseModel):
    """What a deployment sets per store node; the cluster's `store:` section embeds these."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host_capacity_bytes: int = Field(256 * MiB, gt=0)
    lease_ttl_s: float = Field(30.0, gt=0)
    # How long a read waits for a layer once its producer should have put it.
    get_timeout_s: float = Field(30.0, gt=0)
    redis_url: str | None = None
    redis_password: SecretStr | None = None
    # Every Redis record carries an HMAC-SHA256 under this key; None: a random key per tier.
    redis_hmac_key: SecretStr | None = None
    # Connections per store node; a request waits up to redis_pool_timeout_s for one.
    redis_max_connections: int = Field(64, ge=1)
    redis_pool_timeout_s: float = Field(5.0, gt=0)
    redis_ttl_s: int = Field(3600, gt=0)
    # Between nodes: KV on Mooncake's Transfer Engine, or as Ray objects.
    transfer: TransferSettings = TransferSettings()


class StoreConfig(StoreSettings):
    """Capacity, eviction, lease and Redis settings of one store node."""

    high_watermark: float = Field(0.95, gt=0, le=1)
    low_watermark: float = Field(0.85, gt=0, le=1)
    pending_ttl_s: float = Field(60.0, gt=0)
    # The host tier in shared memory: prefill workers on the node copy layers straight into
    # it (kvstore/shared_arena.py) instead of sending them through Ray's object store.
    shared_arena: bool = True
    redis_prefix: str = "hm:kv:"
    redis_timeout_s: float = Field(1.0, gt=0)
    redis_retry_interval_s: float = Field(1.0, ge=0)
    demote_to_redis: bool = True
    max_demotion_backlog_bytes: int = Field(256 * MiB, ge=0)

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> StoreConfig:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark {self.low_watermark} must not exceed "
                f"high_watermark {self.high_watermark}"
            )
        return self

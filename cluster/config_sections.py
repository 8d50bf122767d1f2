"""The sections of the cluster config. The engine, store and router sections embed their part's
own settings (EngineSettings, StoreSettings, RouterConfig's defaults) and add what only the
cluster needs; `ClusterConfig` (cluster/config.py) holds one of each."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from halfmoon.cluster.control.autoscaling_policy import invalid
from halfmoon.cluster.frontend.auth import API_KEY_ENV, loopback
from halfmoon.cluster.frontend.http_limits import HttpLimits
from halfmoon.engine.config import EngineConfig, EngineSettings
from halfmoon.kvstore.config import StoreConfig, StoreSettings
from halfmoon.router.config import RouterConfig
from halfmoon.router.policies import POLICIES
from halfmoon.router.profile import PROFILE_DIR

ROUTER_DEFAULTS = RouterConfig()


class Section(BaseModel):
    """A config section: unknown keys are errors, values are read-only once loaded."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineSection(EngineSettings):
    """Per-worker engine sizing: the engine's own settings, chunked prefill on by default."""

    model_config = Section.model_config

    # Each chunk's KV is published layer by layer, so a cluster always prefills in chunks.
    prefill_chunk_size: int = Field(256, ge=1)

    @field_validator("tensor_parallel_size")
    @classmethod
    def _degree_per_pool(cls, size: int) -> int:
        if size != 1:
            raise PydanticCustomError(
                "tensor_parallel",
                "a cluster sets the degree per pool: prefill.tensor_parallel_size and "
                "decode.tensor_parallel_size (or --tensor-parallel-size for both); leave this 1",
            )
        return size

    @model_validator(mode="after")
    def _chunk_fits_batch(self) -> EngineSection:
        chunk = self.prefill_chunk_size
        if chunk > self.max_num_batched_tokens:
            raise invalid(
                "prefill_chunk_size",
                f"{chunk} exceeds max_num_batched_tokens = {self.max_num_batched_tokens}; "
                "lower it or raise max_num_batched_tokens",
            )
        return self

    def engine_config(self, model: str) -> EngineConfig:
        """The engine config of every worker of this cluster, for the resolved `model`."""
        return EngineConfig(
            model=model, **self.model_dump(include=set(EngineSettings.model_fields))
        )


class PoolConfig(Section):
    """How many workers of one kind, and the Ray resources each one asks for."""

    replicas: int = Field(1, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # Custom Ray resources, e.g. {"prefill": 1} to pin workers to prefill nodes.
    resources: dict[str, float] = Field(default_factory=dict)
    # Ranks each worker splits the model across (engine/tensor_parallel.py): processes of the
    # worker's actor, which reserves num_cpus and num_gpus for each. Prefill and decode may
    # differ: the KV moves between them whole-head (engine/kv_shards.py).
    tensor_parallel_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _tensor_parallel_on_cpu(self) -> PoolConfig:
        if self.tensor_parallel_size > 1 and self.num_gpus > 0:
            raise invalid(
                "tensor_parallel_size",
                f"{self.tensor_parallel_size} with num_gpus = {self.num_gpus}: a worker's ranks "
                "move KV through shared CPU memory only so far; set num_gpus: 0 or "
                "tensor_parallel_size: 1",
            )
        return self

    @field_validator("resources")
    @classmethod
    def _non_negative(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if amount < 0:
                raise invalid(name, f"{amount} must be >= 0 (an amount of Ray resource {name!r})")
        return resources


class StoreSection(StoreSettings):
    """The per-node KV store: the store's own settings, plus how the cluster sizes its host tier,
    finds Redis and moves KV between workers of one node. `redis_password` falls back to
    $HALFMOON_REDIS_PASSWORD, `redis_hmac_key` to $HALFMOON_REDIS_HMAC_KEY (else a random key
    per cluster, so records outlive the cluster only when it is set)."""

    model_config = Section.model_config

    # When set, each node's host tier is this share of its Ray `memory` resource instead.
    host_memory_fraction: float | None = Field(None, gt=0, lt=1)
    # Start a local redis-server (with a fresh random password) when no URL is given and the
    # binary is on PATH.
    use_local_redis: bool = True
    # A prefill worker tells a decode worker on its node of each layer and of the first token
    # over a Unix socket, and the decode worker joins its batch as soon as both are in
    # (kvstore/transfer/channel.py); off: through the store node and the router's hand-off.
    direct_notices: bool = True
    # With direct notices, the prefill worker also lends its own KV pages (the device tier): the
    # decode worker copies each layer straight out of them (on a GPU, device to device through
    # CUDA IPC), and the store's copy only feeds the cache; off: out of the store's arena.
    lend_pages: bool = True

    @field_validator("redis_hmac_key")
    @classmethod
    def _long_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and len(key.get_secret_value()) < 16:
            # ValueError: the message shows the field, never the secret
            raise ValueError("must be at least 16 characters (e.g. `openssl rand -hex 32`)")
        return key

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise PydanticCustomError(
                "redis_url",
                "must start with redis://, rediss:// or unix:// (e.g. redis://host:6379/0)",
            )
        return url

    def store_config(self, **resolved: Any) -> StoreConfig:
        """The store nodes' config: these settings with `resolved` (e.g. the Redis URL found at
        start) in place of the configured values."""
        settings = self.model_dump(include=set(StoreSettings.model_fields))
        return StoreConfig(**{**settings, **resolved})


class SloSection(Section):
    """Latency targets; None means no target. Admission rejects against these."""

    ttft_s: float | None = Field(None, gt=0)
    tbt_s: float | None = Field(None, gt=0)


class RouterSection(Section):
    """Placement policy, SLO admission and short-prompt bypass; the knobs it shares with the
    Conductor default to RouterConfig's."""

    # The Conductor: cache-aware, load-aware placement by predicted TTFT (docs/router.md).
    policy: str = ROUTER_DEFAULTS.policy
    # queue_bound: reject (RESOURCE_EXHAUSTED) once max_queued_per_worker requests per worker
    # wait for their first token; the SLO modes also bound the queue. none: queue everything.
    admission: Literal["none", "queue_bound", "early_rejection", "prediction_early_rejection"] = (
        "queue_bound"
    )
    # Reject at arrival a request whose predicted TTFT (the Conductor's: queued work, its own
    # uncached prefill, the hand-off) exceeds this many seconds; None: no bound.
    max_ttft_s: float | None = Field(ROUTER_DEFAULTS.max_ttft_s, gt=0)
    # One engine batch waiting per worker.
    max_queued_per_worker: int = Field(EngineSettings.model_fields["max_num_seqs"].default, ge=1)
    # Prefill on the decode worker when at most this many prompt tokens are uncached (0: never).
    bypass_threshold_tokens: int = Field(ROUTER_DEFAULTS.bypass_max_tokens, ge=0)
    # Copy hot prefixes from the store into idle prefill workers' pages (router/replication.py).
    replicate: bool = ROUTER_DEFAULTS.replicate
    replicate_min_hits: int = Field(ROUTER_DEFAULTS.replicate_min_hits, ge=1)
    replicate_max_copies: int = Field(ROUTER_DEFAULTS.replicate_max_copies, ge=1)
    replicate_margin_s: float = Field(ROUTER_DEFAULTS.replicate_margin_s, ge=0)
    # A cost-model profile: a YAML path, or a name from deploy/profiles; None: profile at start.
    profile: str | None = None
    # Seconds a request waits for a replacement while a pool has no live worker (0: fail now).
    pool_wait_s: float = Field(10.0, ge=0)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise PydanticCustomError(
                "policy", "must be one of {names}", {"names": ", ".join(POLICIES)}
            )
        return name

    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, profile: str | None) -> str | None:
        if profile is None:
            return None
        for path in (Path(profile), PROFILE_DIR / f"{profile}.yaml"):
            if path.is_file():
                return str(path.resolve())
        names = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
        raise PydanticCustomError(
            "profile", "must be a profile file or one of {names}", {"names": names}
        )

    def router_config(self, slo: SloSection, block_size: int) -> RouterConfig:
        """The Conductor's settings: these knobs, the SLOs, and the workers' `block_size`."""
        shared = self.model_dump(include=_CONDUCTOR_FIELDS)
        return RouterConfig(
            **shared,
            # The queue bound is the backend's; the Conductor judges SLOs only.
            admission="none" if self.admission == "queue_bound" else self.admission,
            ttft_slo_s=slo.ttft_s,
            tbt_slo_s=slo.tbt_s,
            block_size=block_size,
            bypass_max_tokens=self.bypass_threshold_tokens,
        )


# The router knobs the section and RouterConfig name alike; admission maps queue_bound.
_CONDUCTOR_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)} & (
    set(RouterSection.model_fields) - {"admission"}
)


class ServerSection(Section):
    """Where the gRPC API, the OpenAI HTTP API and the Prometheus endpoint listen (port 0: any
    free port), and the API key clients must present."""

    host: str = "127.0.0.1"
    grpc_port: int = Field(50051, ge=0, le=65535)
    metrics_port: int = Field(9400, ge=0, le=65535)
    # The OpenAI-compatible HTTP API; null or off: not served.
    http_port: int | None = Field(8000, ge=0, le=65535)
    # When set, HTTP needs `Authorization: Bearer KEY` and gRPC the same `authorization` metadata.
    api_key: SecretStr | None = Field(None, min_length=1)
    # Prometheus file_sd JSON listing every worker's and store node's own /metrics; None: none.
    metrics_targets_file: str | None = None
    # On SIGTERM: refuse new requests (UNAVAILABLE, health NOT_SERVING), let the streams in
    # flight finish for up to this long, then stop.
    drain_timeout_s: float = Field(30.0, ge=0)
    # Serve beyond loopback (a `host` other than 127.0.0.1, ::1, localhost) without `api_key`:
    # refused unless this is set, and then logged at start.
    allow_unauthenticated: bool = False
    # PEM files: serve the gRPC and the HTTP API over TLS (both or neither).
    tls_cert: str | None = None
    tls_key: str | None = None
    # Read deadlines and connection bounds of the HTTP API (docs/deploy.md, "Protection").
    http_limits: HttpLimits = Field(default_factory=HttpLimits)

    @field_validator("http_port", mode="before")
    @classmethod
    def _http_off(cls, port: Any) -> Any:
        # YAML reads a bare `off` as False.
        return None if port is False or port == "off" else port

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServerSection:
        named = [
            ("grpc_port", self.grpc_port),
            ("metrics_port", self.metrics_port),
            ("http_port", self.http_port),
        ]
        for i, (name, port) in enumerate(named):
            for other, other_port in named[:i]:
                if port and port == other_port:
                    raise invalid(name, f"{port} is also {other}; give each its own port")
        if self.api_key is None and not self.allow_unauthenticated and not loopback(self.host):
            raise invalid(
                "host",
                f"{self.host} serves beyond this machine with no API key: set server.api_key "
                f"(serve --api-key-file PATH, or ${API_KEY_ENV}), or server.allow_unauthenticated "
                "(serve --allow-unauthenticated) to serve anyone who can reach it",
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise invalid("tls_key", "give tls_cert and tls_key together (or neither)")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise invalid(name, f"{path} is not a file; give a PEM file")
        return self


class RaySection(Section):
    """Which Ray cluster to use: None starts one in-process, "auto" joins the local one."""

    address: str | None = None
    namespace: str = Field("halfmoon", min_length=1)
    # Authentication of a Ray that halfmoon starts ($RAY_AUTH_MODE wins): token is Ray's own
    # default for a local Ray, which makes a token in ~/.ray/auth_token every Ray call carries.
    auth_mode: Literal["token", "disabled"] = "token"


class HealthSection(Section):
    """How often the controller checks each actor, and when a silent one counts as dead."""

    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(10.0, gt=0)
    # A worker whose pings time out is replaced only once it has been silent this long (one
    # whose actor Ray reports dead is replaced at once): a busy worker answers late, not never.
    unresponsive_s: float = Field(60.0, gt=0)

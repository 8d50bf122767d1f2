"""The cluster's configuration: one validated schema loaded from YAML, every default written here
once. `load_config` applies CLI overrides and turns validation errors into one ConfigError."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from halfmoon.cluster.control.autoscaling_policy import (
    TAG_PREFIX,
    AutoscalingConfig,
    DecodePlannerPolicy,
    PrefillPlannerPolicy,
    invalid,
)
from halfmoon.cluster.frontend.request_limits import RequestLimits
from halfmoon.router.policies import POLICIES
from halfmoon.router.profile import PROFILE_DIR

MiB = 1 << 20
DEFAULT_MODEL_NAME = "tiny-llama"


if TYPE_CHECKING:
    from halfmoon.router.config import RouterConfig


class ConfigError(ValueError):
    """A configuration value is invalid; the message has one line per field: path, value, fix."""


class Section(BaseModel):
    """A config section: unknown keys are errors, values are read-only once loaded."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineSection(Section):
    """Per-worker engine sizing; `num_pages` None sizes the KV pool from memory."""

    block_size: int = Field(16, ge=1)
    num_pages: int | None = Field(None, ge=2)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    # Tokens per prefill chunk; each chunk's KV is published layer by layer.
    prefill_chunk_size: int = Field(64, ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # None: the model's own context (max_position_embeddings / sliding window), or less if the
    # KV cache cannot hold it; a larger value than the model's is an error.
    max_model_len: int | None = Field(None, ge=2)
    # KV budget per worker; None sizes it from the device (below on CUDA, 2 GiB on CPU).
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    # Share of the GPU's memory one worker's weights, activations and KV may use; with a
    # fractional num_gpus the launcher scales it by that fraction.
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    # False: decode steps replay CUDA graphs captured at start (GPU only); True: always eager.
    enforce_eager: bool = False

    @field_validator("tensor_parallel_size")
    @classmethod
    def _no_tensor_parallel(cls, size: int) -> int:
        if size != 1:
            raise PydanticCustomError(
                "tensor_parallel",
                "tensor parallelism is not supported yet: each worker runs on one device; "
                "scale with more prefill/decode replicas instead (set 1)",
            )
        return size

    @model_validator(mode="after")
    def _chunk_fits(self) -> EngineSection:
        chunk = self.prefill_chunk_size
        if chunk % self.block_size:
            raise invalid(
                "prefill_chunk_size",
                f"{chunk} must be a multiple of block_size = {self.block_size}",
            )
        if chunk > self.max_num_batched_tokens:
            raise invalid(
                "prefill_chunk_size",
                f"{chunk} exceeds max_num_batched_tokens = {self.max_num_batched_tokens}; "
                "lower it or raise max_num_batched_tokens",
            )
        return self


class PoolConfig(Section):
    """How many workers of one kind, and the Ray resources each one asks for."""

    replicas: int = Field(1, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # Custom Ray resources, e.g. {"prefill": 1} to pin workers to prefill nodes.
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("resources")
    @classmethod
    def _non_negative(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if amount < 0:
                raise invalid(name, f"{amount} must be >= 0 (an amount of Ray resource {name!r})")
        return resources


class StoreSection(Section):
    """The per-node KV store: host tier size, optional Redis tier, leases."""

    host_capacity_bytes: int = Field(256 * MiB, gt=0)
    # When set, each node's host tier is this share of its Ray `memory` resource instead.
    host_memory_fraction: float | None = Field(None, gt=0, lt=1)
    redis_url: str | None = None
    # Start a local redis-server when no URL is given and the binary is on PATH.
    use_local_redis: bool = True
    redis_ttl_s: int = Field(3600, gt=0)
    lease_ttl_s: float = Field(30.0, gt=0)
    # How long a read waits for a layer once its producer should have put it: a decode worker's
    # reads, from the moment its request's prefill returned; a prefix load, from its start.
    get_timeout_s: float = Field(30.0, gt=0)
    # Password of the Redis server (or $HALFMOON_REDIS_PASSWORD); a password in redis_url
    # also works. The local redis-server halfmoon starts gets a fresh random one.
    redis_password: SecretStr | None = None
    # Key of the HMAC-SHA256 every Redis record carries (or $HALFMOON_REDIS_HMAC_KEY); None:
    # a random key per cluster, so records outlive the cluster only when this is set.
    redis_hmac_key: SecretStr | None = None
    # Connections per store node; a request waits up to redis_pool_timeout_s for one.
    redis_max_connections: int = Field(64, ge=1)
    redis_pool_timeout_s: float = Field(5.0, gt=0)
    # A prefill worker tells a decode worker on its node of each layer and of the first token
    # over a Unix socket, and the decode worker joins its batch as soon as both are in
    # (kvstore/kv_notices.py); off: through the store node and the router's hand-off.
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


class SloSection(Section):
    """Latency targets; None means no target. Admission rejects against these."""

    ttft_s: float | None = Field(None, gt=0)
    tbt_s: float | None = Field(None, gt=0)


class RouterSection(Section):
    """Placement policy, SLO admission and short-prompt bypass."""

    policy: str = "least_loaded"
    # queue_bound: reject (RESOURCE_EXHAUSTED) once max_queued_per_worker requests per worker
    # wait for their first token; the SLO modes also bound the queue. none: queue everything.
    admission: Literal["none", "queue_bound", "early_rejection", "prediction_early_rejection"] = (
        "queue_bound"
    )
    # One engine batch (engine.max_num_seqs' default) waiting per worker.
    max_queued_per_worker: int = Field(64, ge=1)
    # Prefill on the decode worker when at most this many prompt tokens are uncached (0: never).
    bypass_threshold_tokens: int = Field(512, ge=0)
    # Copy hot prefixes from the store into idle prefill workers' pages (router/replication.py).
    replicate: bool = False
    replicate_min_hits: int = Field(2, ge=1)
    replicate_max_copies: int = Field(4, ge=1)
    replicate_margin_s: float = Field(0.1, ge=0)
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
    # PEM files: serve the gRPC API over TLS (both or neither).
    tls_cert: str | None = None
    tls_key: str | None = None

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


class ClusterConfig(Section):
    """Everything `halfmoon serve` needs; the defaults run a tiny model on one machine."""

    # A checkpoint directory or a model id in the local Hugging Face cache; None: the tiny
    # model generated on first use.
    model: str | None = None
    # The model name clients use (OpenAI `model`, ModelInfo); None: `model` as given.
    served_model_name: str | None = Field(None, min_length=1)
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: EngineSection = Field(default_factory=EngineSection)
    prefill: PoolConfig = Field(default_factory=PoolConfig)
    decode: PoolConfig = Field(default_factory=PoolConfig)
    store: StoreSection = Field(default_factory=StoreSection)
    slo: SloSection = Field(default_factory=SloSection)
    router: RouterSection = Field(default_factory=RouterSection)
    server: ServerSection = Field(default_factory=ServerSection)
    ray: RaySection = Field(default_factory=RaySection)
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    health: HealthSection = Field(default_factory=HealthSection)
    limits: RequestLimits = Field(default_factory=RequestLimits)

    @field_validator("autoscaling", mode="before")
    @classmethod
    def _policy_file(cls, value: Any) -> Any:
        if not isinstance(value, str | Path):
            return value
        try:
            return read_yaml(Path(value))
        except ConfigError as exc:
            raise PydanticCustomError("policy_file", "{reason}", {"reason": str(exc)}) from None

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        for check in (self._check_pools, self._check_admission, self._check_autoscaling):
            check()
        return self

    def _check_pools(self) -> None:
        if self.decode.replicas < 1:
            raise invalid("decode.replicas", f"{self.decode.replicas} must be >= 1")
        if self.mode == "disaggregated" and self.prefill.replicas < 1:
            raise invalid(
                "prefill.replicas",
                f"{self.prefill.replicas} must be >= 1 in disaggregated mode "
                "(or set mode: colocated)",
            )

    def _check_admission(self) -> None:
        no_slo = self.slo.ttft_s is None and self.slo.tbt_s is None
        if self.router.admission in ("early_rejection", "prediction_early_rejection") and no_slo:
            raise invalid(
                "router.admission",
                f"{self.router.admission!r} rejects against an SLO; set slo.ttft_s or slo.tbt_s "
                "(or admission: queue_bound)",
            )

    def _check_autoscaling(self) -> None:
        prefill, decode = self.autoscaling.prefill, self.autoscaling.decode
        if prefill is not None and self.mode == "colocated":
            raise invalid(
                "autoscaling.prefill",
                "colocated mode has no prefill pool; remove autoscaling.prefill",
            )
        planner = isinstance(prefill, PrefillPlannerPolicy)
        if planner and (prefill.ttft_s or self.slo.ttft_s) is None:
            raise invalid(
                "autoscaling.prefill.ttft_s",
                "slo_planner needs a TTFT target; set it here or set slo.ttft_s",
            )
        if isinstance(decode, DecodePlannerPolicy) and _no_tbt(decode, self.slo.tbt_s):
            raise invalid(
                "autoscaling.decode.tbt_s",
                "slo_planner derives decode throughput at the TBT target; set it here, "
                "set slo.tbt_s, or give decode_tokens_per_s",
            )
        for pool, policy in (("prefill", prefill), ("decode", decode)):
            replicas = getattr(self, pool).replicas
            if policy is None or (pool == "prefill" and self.mode == "colocated"):
                continue
            if not policy.min_replicas <= replicas <= policy.max_replicas:
                raise invalid(
                    f"{pool}.replicas",
                    f"{replicas} is outside autoscaling.{pool}'s "
                    f"[{policy.min_replicas}, {policy.max_replicas}]; start within the bounds",
                )


def served_name(config: ClusterConfig) -> str:
    """The name clients see for the model."""
    return config.served_model_name or config.model or DEFAULT_MODEL_NAME


def _no_tbt(policy: DecodePlannerPolicy, slo_tbt_s: float | None) -> bool:
    return policy.decode_tokens_per_s is None and policy.tbt_s is None and slo_tbt_s is None


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping from `path`; anything else is a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"{path} is not a file; give the path to a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level is {type(data).__name__}; it must be a mapping")
    return data


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> ClusterConfig:
    """The config in `path` (None: the defaults) with dotted-key `overrides` (None values skipped)
    applied; raises ConfigError listing every invalid field."""
    data = read_yaml(Path(path)) if path is not None else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
    return validate_config(data, source=str(path) if path else "config")


def validate_config(data: dict[str, Any], source: str = "config") -> ClusterConfig:
    """Validate a config mapping; raises ConfigError with one line per invalid field."""
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        lines = [format_error(error, ClusterConfig) for error in exc.errors()]
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(lines)) from None


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parents[: i + 1])
            raise ConfigError(f"override {key}: {where} holds {child!r}, not a section")
        node = child
    node[leaf] = value


def format_error(error: Any, root: type[BaseModel]) -> str:
    """One line for one pydantic error: the field path, the bad value and what is allowed."""
    loc = [str(part) for part in error["loc"]]
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "cross_field":
        return f"{_path(loc + ctx['field'].split('.'))}: {ctx['reason']}"
    if kind == "extra_forbidden":
        allowed = ", ".join(_fields_at(root, loc[:-1]))
        return f"{_path(loc)}: unknown field; allowed here: {allowed}"
    if kind == "missing":
        return f"{_path(loc)}: required; add it"
    if kind == "policy_kind":
        got = error["input"].get("kind") if isinstance(error["input"], dict) else error["input"]
        return f"{_path(loc + ['kind'])} = {got!r}: {error['msg']}"
    message = error["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if kind in ("value_error", "assertion_error") or _is_model_error(error):
        return f"{_path(loc)}: {message}"
    return f"{_path(loc)} = {error['input']!r}: {message}"


def _is_model_error(error: Any) -> bool:
    # A whole-section check raises with the section as input; repeating the mapping is noise.
    return isinstance(error["input"], dict) and error["type"] not in ("dict_type", "model_type")


def _path(loc: list[str]) -> str:
    return ".".join(part for part in loc if not part.startswith(TAG_PREFIX)) or "(top level)"


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The field names of the section at `loc`, following tagged unions by their tag."""
    for part in loc:
        if part.startswith(TAG_PREFIX):
            kind = part.removeprefix(TAG_PREFIX)
            model = next(m for m in _models_in(model) if m.model_fields["kind"].default == kind)
            continue
        annotation = model.model_fields[part].annotation
        candidates = _models_in(annotation)
        model = candidates[0] if len(candidates) == 1 else annotation
    return list(model.model_fields)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes an annotation (Optional, union, Annotated) can hold."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        args = args[:1]
    elif typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return []
    return [model for arg in args for model in _models_in(arg)]


def router_config(config: ClusterConfig, block_size: int) -> RouterConfig:
    """The Conductor's settings for this cluster, keyed with the workers' `block_size`."""
    from halfmoon.router.config import RouterConfig

    return RouterConfig(
        policy=config.router.policy,
        # The queue bound is the backend's; the Conductor judges SLOs only.
        admission="none" if config.router.admission == "queue_bound" else config.router.admission,
        ttft_slo_s=config.slo.ttft_s,
        tbt_slo_s=config.slo.tbt_s,
        block_size=block_size,
        bypass_max_tokens=config.router.bypass_threshold_tokens,
        replicate=config.router.replicate,
        replicate_min_hits=config.router.replicate_min_hits,
        replicate_max_copies=config.router.replicate_max_copies,
        replicate_margin_s=config.router.replicate_margin_s,
    )

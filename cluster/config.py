"""The cluster's configuration: one validated schema loaded from YAML, every default written once,
in its part's settings or its section (cluster/config_sections.py). `load_config` applies CLI
overrides and turns validation errors into one ConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from halfmoon.cluster.config_errors import ConfigError, format_error
from halfmoon.cluster.config_sections import (
    EngineSection,
    HealthSection,
    PoolConfig,
    RaySection,
    RouterSection,
    Section,
    ServerSection,
    SloSection,
    StoreSection,
)
from halfmoon.cluster.control.autoscaling_policy import (
    AutoscalingConfig,
    DecodePlannerPolicy,
    PrefillPlannerPolicy,
    invalid,
)
from halfmoon.cluster.frontend.request_limits import RequestLimits
from halfmoon.router.config import RouterConfig

DEFAULT_MODEL_NAME = "tiny-llama"

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "EngineSection",
    "HealthSection",
    "PoolConfig",
    "RaySection",
    "RouterSection",
    "ServerSection",
    "SloSection",
    "StoreSection",
    "load_config",
    "read_yaml",
    "router_config",
    "served_name",
    "validate_config",
]


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


def router_config(config: ClusterConfig, block_size: int) -> RouterConfig:
    """The Conductor's settings for this cluster, keyed with the workers' `block_size`."""
    return config.router.router_config(config.slo, block_size)

"""A worker profile: its cost model plus the sizes and bandwidths that turn KV into seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from halfmoon.router.cost_model import CostModel
from halfmoon.router.errors import ProfileError

PROFILE_DIR = Path(__file__).resolve().parent.parent / "deploy" / "profiles"
DEFAULT_PROFILE = PROFILE_DIR / "llama70b-8xa800.yaml"


@dataclass(slots=True)
class Profile:
    """Everything the router and the simulator know about one worker kind's speed and size."""

    name: str
    cost: CostModel
    kv_bytes_per_token: int
    num_layers: int
    network_bytes_per_s: float
    host_to_device_bytes_per_s: float
    transfer_latency_s: float
    decode_kv_capacity_tokens: int
    cache_bytes_per_instance: float
    assumptions: dict = field(default_factory=dict)
    # Fixed latency a request pays outside prefill compute (routing, reservation, the last
    # layer's transfer, joining the batch, the API): measured on live clusters, 0 if unknown.
    request_overhead_s: float = 0.0
    # What a disaggregated request pays on top between its prefill's end and its first token
    # (the last layers' transfer, the hand-off to decode, the join) and in routing under load;
    # a bypassed prompt does not pay it. Refit online from live requests, 0 if unknown.
    handoff_s: float = 0.0
    # Devices one instance splits the model across: its timings are at this degree, the decode
    # side's at `decode_tensor_parallel_size` where a profile composed for pools at two degrees
    # sets it (router/degree.py).
    tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int | None = None

    @property
    def decode_degree(self) -> int:
        """The degree its decode side (decode coefficients, decode KV capacity) is timed at."""
        return self.decode_tensor_parallel_size or self.tensor_parallel_size

    def transfer_time(self, num_tokens: int, remote: bool = True) -> float:
        """Seconds to move the KV of `num_tokens` from another instance (or from local host)."""
        if num_tokens <= 0:
            return 0.0
        bandwidth = self.network_bytes_per_s if remote else self.host_to_device_bytes_per_s
        return self.transfer_latency_s + num_tokens * self.kv_bytes_per_token / bandwidth

    def cache_blocks(self, block_size: int) -> int:
        """How many `block_size`-token blocks of KV one instance's cache holds."""
        return int(self.cache_bytes_per_instance // (self.kv_bytes_per_token * block_size))


_FIELDS = (
    "kv_bytes_per_token",
    "num_layers",
    "network_bytes_per_s",
    "host_to_device_bytes_per_s",
    "transfer_latency_s",
    "decode_kv_capacity_tokens",
    "cache_bytes_per_instance",
)


def load_profile(path: str | Path) -> Profile:
    """Read a profile YAML; a missing or impossible field is a ProfileError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"profile {path} does not exist; pick one from {PROFILE_DIR}")
    data = yaml.safe_load(path.read_text()) or {}
    return profile_from_dict(data, path)


def profile_from_dict(data: object, source: str | Path) -> Profile:
    """A profile from its YAML mapping (or the same mapping as JSON, e.g. from a server);
    `source` names where it came from in errors, and is the name when the mapping has none."""
    path = source
    if not isinstance(data, dict):
        raise ProfileError(f"profile {path} is not a mapping")
    values = {}
    for name in _FIELDS:
        if name not in data:
            raise ProfileError(f"profile {path} lacks `{name}`")
        try:
            value = float(data[name])
        except (TypeError, ValueError):
            raise ProfileError(
                f"profile {path}: `{name}` = {data[name]!r} is not a number"
            ) from None
        if not math.isfinite(value) or value < 0 or (value == 0 and name != "transfer_latency_s"):
            raise ProfileError(f"profile {path}: `{name}` = {data[name]!r} must be positive")
        values[name] = value
    assumptions = data.get("assumptions") or {}
    if not isinstance(assumptions, dict):
        raise ProfileError(f"profile {path}: `assumptions` must be a mapping")
    return Profile(
        name=str(data.get("name", Path(str(path)).stem)),
        cost=CostModel.from_dict(data),
        kv_bytes_per_token=int(values["kv_bytes_per_token"]),
        num_layers=int(values["num_layers"]),
        network_bytes_per_s=values["network_bytes_per_s"],
        host_to_device_bytes_per_s=values["host_to_device_bytes_per_s"],
        transfer_latency_s=values["transfer_latency_s"],
        decode_kv_capacity_tokens=int(values["decode_kv_capacity_tokens"]),
        cache_bytes_per_instance=values["cache_bytes_per_instance"],
        assumptions=dict(assumptions),
        request_overhead_s=_overhead(path, data, "request_overhead_s"),
        handoff_s=_overhead(path, data, "handoff_s"),
        tensor_parallel_size=_degree(path, data, "tensor_parallel_size", 1),
        decode_tensor_parallel_size=_degree(path, data, "decode_tensor_parallel_size", None),
    )


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write `profile` as YAML that `load_profile` reads back unchanged."""
    Path(path).write_text(yaml.safe_dump(profile_to_dict(profile), sort_keys=False))


def profile_to_dict(profile: Profile) -> dict:
    """The mapping `save_profile` writes and `profile_from_dict` reads."""
    data = {"name": profile.name, "assumptions": profile.assumptions}
    data.update({name: getattr(profile, name) for name in _FIELDS})
    data["request_overhead_s"] = profile.request_overhead_s
    data["handoff_s"] = profile.handoff_s
    data["tensor_parallel_size"] = profile.tensor_parallel_size
    if profile.decode_tensor_parallel_size is not None:
        data["decode_tensor_parallel_size"] = profile.decode_tensor_parallel_size
    data.update(profile.cost.to_dict())
    return data


def _overhead(path: str | Path, data: dict, name: str) -> float:
    try:
        value = float(data.get(name, 0.0))
    except (TypeError, ValueError):
        raise ProfileError(f"profile {path}: `{name}` = {data[name]!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ProfileError(f"profile {path}: `{name}` = {value!r} must be >= 0")
    return value


def _degree(path: str | Path, data: dict, name: str, default: int | None) -> int | None:
    if name not in data:
        return default
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"profile {path}: `{name}` = {value!r} must be an int >= 1")
    return value

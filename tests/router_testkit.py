"""Builders for tests of the router and its simulator (tests/router, the replay benchmark's):
a simple profile and a conductor over named instances."""

from __future__ import annotations

from halfmoon.router.conductor import Conductor
from halfmoon.router.config import RouterConfig
from halfmoon.router.cost_model import CostModel
from halfmoon.router.profile import Profile
from halfmoon.router.request import RouteRequest


def simple_profile(network_bytes_per_s: float = 1e12) -> Profile:
    """Prefill costs 1 ms per new token; decode steps cost 10 ms + 1 ms per sequence."""
    return Profile(
        name="test",
        cost=CostModel((0.0, 1e-3, 0.0, 0.0), (0.01, 1e-3, 0.0)),
        kv_bytes_per_token=1000,
        num_layers=10,
        network_bytes_per_s=network_bytes_per_s,
        host_to_device_bytes_per_s=1e12,
        transfer_latency_s=0.0,
        decode_kv_capacity_tokens=1_000_000,
        cache_bytes_per_instance=1e9,
    )


def make_conductor(
    num_prefill: int = 3, num_decode: int = 2, profile: Profile | None = None, **config
) -> Conductor:
    """A conductor with block size 10 over p0.. and d0.. (bypass off unless asked)."""
    config.setdefault("block_size", 10)
    config.setdefault("bypass_max_tokens", 0)
    conductor = Conductor(RouterConfig(**config), profile or simple_profile())
    for i in range(num_prefill):
        conductor.add_prefill(f"p{i}")
    for i in range(num_decode):
        conductor.add_decode(f"d{i}")
    return conductor


def request(rid: str, num_blocks: int = 10, first_key: int = 0, **kwargs) -> RouteRequest:
    """A request of `num_blocks` 10-token blocks keyed first_key, first_key + 1, ..."""
    keys = list(range(first_key, first_key + num_blocks))
    kwargs.setdefault("max_output_tokens", 100)
    kwargs.setdefault("arrival_s", 0.0)
    kwargs.setdefault("expected_output_tokens", 100)
    return RouteRequest(rid, keys, num_blocks * 10, **kwargs)

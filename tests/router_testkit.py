"""Builders for tests of the router and its simulator (tests/router, the replay benchmark's):
a simple profile, a conductor over named instances, and requests served through it."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.router.conductor import Conductor
from halfmoon.router.config import RouterConfig
from halfmoon.router.cost_model import CostModel
from halfmoon.router.events import Abandoned, FirstToken, PrefillDone
from halfmoon.router.profile import Profile
from halfmoon.router.reports import BlockEvents
from halfmoon.router.request import RouteRequest
from halfmoon.router.views import DecodeView, PrefillView


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
    return conductor_and_views(num_prefill, num_decode, profile, **config)[0]


def conductor_and_views(
    num_prefill: int = 3, num_decode: int = 2, profile: Profile | None = None, **config
) -> tuple[Conductor, dict[str, PrefillView | DecodeView]]:
    """`make_conductor`'s conductor and the view it keeps of each instance (`add_instance`
    returns it), by name: a test loads a prefill queue there, or reads it."""
    config.setdefault("block_size", 10)
    config.setdefault("bypass_max_tokens", 0)
    conductor = Conductor(RouterConfig(**config), profile or simple_profile())
    views: dict[str, PrefillView | DecodeView] = {}
    for i in range(num_prefill):
        views[f"p{i}"] = conductor.add_instance(f"p{i}", "prefill").prefill
    for i in range(num_decode):
        views[f"d{i}"] = conductor.add_instance(f"d{i}", "decode").decode
    return conductor, views


def stored(conductor: Conductor, instance: str, tier: str, keys: Iterable[Hashable]) -> None:
    """`keys` entered `instance`'s `tier`, as that tier's block events tell the router."""
    conductor.observe(BlockEvents([BlockEvent("stored", instance, tier, list(keys))]))


def serve_late(conductor: Conductor, rid: str, num_blocks: int, now: float, ttft_s: float) -> None:
    """Route a request of `num_blocks` blocks at `now` and have its first token take `ttft_s`,
    then give up what it held (Abandoned): the prediction error is what it leaves behind."""
    conductor.route(request(rid, num_blocks), now)
    conductor.on_event(PrefillDone(rid, now))
    conductor.on_event(FirstToken(rid, now, ttft_s))
    conductor.on_event(Abandoned(rid, now))


def request(rid: str, num_blocks: int = 10, first_key: int = 0, **kwargs) -> RouteRequest:
    """A request of `num_blocks` 10-token blocks keyed first_key, first_key + 1, ..."""
    keys = list(range(first_key, first_key + num_blocks))
    kwargs.setdefault("max_output_tokens", 100)
    kwargs.setdefault("arrival_s", 0.0)
    kwargs.setdefault("expected_output_tokens", 100)
    return RouteRequest(rid, keys, num_blocks * 10, **kwargs)

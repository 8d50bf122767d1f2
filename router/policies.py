"""Routing policies by name."""

from __future__ import annotations

from typing import Protocol

from halfmoon.router.config import POLICY_NAMES, check_choice
from halfmoon.router.placement import Placement, PlacementContext
from halfmoon.router.policies_basic import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from halfmoon.router.policy_cache_local import CacheAwareLocalPolicy
from halfmoon.router.policy_conductor import ConductorPolicy


class Policy(Protocol):
    """Chooses a prefill and a decode instance for one request."""

    name: str

    def place(self, ctx: PlacementContext) -> Placement: ...


POLICIES = {
    cls.name: cls
    for cls in (
        RandomPolicy,
        RoundRobinPolicy,
        LeastLoadedPolicy,
        CacheAwareLocalPolicy,
        ConductorPolicy,
    )
}


def make_policy(name: str, seed: int = 0) -> Policy:
    """The policy called `name`; an unknown name is a RouterConfigError listing the known ones."""
    check_choice("routing policy", name, POLICY_NAMES)
    return POLICIES[name](seed)

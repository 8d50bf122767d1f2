"""Ray for a cluster: joined at the configured address, or started here ("local")."""

from __future__ import annotations

import os

import ray

from halfmoon.cluster.config import ClusterConfig
from halfmoon.cluster.control.ray_token import make_token_private


def start_ray(config: ClusterConfig) -> bool:
    """Join or start Ray; True when this call did (so the cluster shuts it down at stop)."""
    if ray.is_initialized():
        return False
    # None starts a Ray here ("local"), never joins one found on the machine.
    address = config.ray.address or os.environ.get("RAY_ADDRESS") or "local"
    local = address == "local"
    if local and config.ray.auth_mode == "disabled":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Otherwise Ray's own default for a Ray it starts: token auth, with the token it makes
    # in ~/.ray/auth_token ($RAY_AUTH_MODE and $RAY_AUTH_TOKEN win). Setting RAY_AUTH_MODE
    # here would not do: Ray has read it at import.
    ray.init(
        address=address,
        namespace=config.ray.namespace,
        include_dashboard=False,
        log_to_driver=False,
        # One node: its address is loopback, where Ray binds what it can.
        _node_ip_address="127.0.0.1" if local else None,
    )
    if local:
        make_token_private()
    return True

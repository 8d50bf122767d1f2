"""Finding store node actors: the one on this worker's node, or one named by the router."""

from __future__ import annotations

import ray

from halfmoon.kvstore.store_node import store_node_name


def local_store():
    """The store node actor on the Ray node this process runs on."""
    return ray.get_actor(store_node_name(ray.get_runtime_context().get_node_id()))


def local_store_name() -> str:
    return store_node_name(ray.get_runtime_context().get_node_id())

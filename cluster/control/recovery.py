"""Recovery of the parts above the workers, run by the controller every round: the router (one
that died or hangs is replaced on the same ports, from the refitted profile kept here, outside
its memory) and the store nodes (one that died or hangs on a live node is replaced under its
name). docs/deploy.md, "When the router, a store node or Redis dies", says what a replacement
keeps and what it loses."""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from halfmoon.cluster.control.launcher import Cluster
from halfmoon.kvstore.store_node import store_node_name

log = logging.getLogger(__name__)
ROUTER = "router"
# How often the controller copies the router's refitted profile (what a replacement starts from).
PROFILE_KEEP_S = 10.0


class Silence:
    """Since when each part's pings have timed out: a part that does not answer is taken as busy
    until it has been silent for `health.unresponsive_s` (its actor is alive, or Ray would have
    said so), and as dead after."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.since: dict[str, float] = {}

    def too_long(self, name: str) -> bool:
        """A ping of `name` timed out: whether it has been silent past the bound now."""
        now = time.monotonic()
        since = self.since.setdefault(name, now)
        if now - since < self.bound_s:
            log.warning(
                "%s did not answer its health check for %.1f s; taken as busy until %g s "
                "(health.unresponsive_s)",
                name,
                now - since,
                self.bound_s,
            )
            return False
        return True

    def answered(self, name: str) -> None:
        self.since.pop(name, None)


class Recovery:
    """Watches the router and the store nodes of `cluster` (`silence`: the controller's)."""

    def __init__(self, cluster: Cluster, silence: Silence) -> None:
        self.cluster = cluster
        self.silence = silence
        self.num_store_restarts = 0
        self.num_redis_restarts = 0
        self.router_restarts_s: list[float] = []  # how long each replacement took
        self.num_requests_ended = 0  # requests of dead routers the workers ended
        self._profile_kept_at = time.monotonic()

    @property
    def num_router_restarts(self) -> int:
        return len(self.router_restarts_s)

    def check_router(self, routed: list[str]) -> bool:
        """Ping the router; replace it when Ray says it died or it was silent too long, routing
        to the workers `routed`; while it answers, keep its refitted profile every
        PROFILE_KEEP_S. Returns whether it was replaced."""
        router = self.cluster.router
        timeout_s = self.cluster.config.health.timeout_s
        try:
            ray.get(router.ping.remote(), timeout=timeout_s)
        except GetTimeoutError:
            if not self.silence.too_long(ROUTER):
                return False
            why = f"has not answered for {self.silence.bound_s:g} s"
        except RayActorError as error:
            if isinstance(error, RayTaskError):
                raise
            why = "died"
        else:
            self.silence.answered(ROUTER)
            self._keep_profile(router, timeout_s)
            return False
        self.silence.answered(ROUTER)
        log.error("the router %s: ending its requests and replacing it", why)
        began = time.monotonic()
        ended = self.cluster.replace_router(routed)
        self.router_restarts_s.append(time.monotonic() - began)
        self.num_requests_ended += ended
        ports = ", ".join(f"{k} {v}" for k, v in self.cluster.ports.items() if v is not None)
        log.error(
            "router replaced in %.1f s (%s); the workers ended %d requests of the dead one",
            self.router_restarts_s[-1],
            ports,
            ended,
        )
        return True

    def _keep_profile(self, router, timeout_s: float) -> None:
        if time.monotonic() - self._profile_kept_at < PROFILE_KEEP_S:
            return
        self._profile_kept_at = time.monotonic()
        try:
            self.cluster.profile = ray.get(router.profile.remote(), timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as error:  # the next round's ping sees to it
            log.warning("could not keep the router's profile: %s", error)

    def check_stores(self) -> list[str]:
        """Ping every store node; replace each one that died or was silent too long. Returns
        the Ray node ids of those replaced. The local Redis, if it died, is started again."""
        setup = self.cluster.store_setup
        if setup is not None and setup.check_redis():
            self.num_redis_restarts += 1
        stores = dict(self.cluster.stores)
        refs = {node_id: store.ping.remote() for node_id, store in stores.items()}
        answered = answered_within(refs.values(), self.cluster.config.health.timeout_s)
        replaced = []
        for node_id, ref in refs.items():
            name = store_node_name(node_id)
            if ref not in answered:
                if not self.silence.too_long(name):
                    continue
            elif _alive(ref):
                self.silence.answered(name)
                continue
            self.silence.answered(name)
            log.error("store node %s is dead or unresponsive; replacing it", name)
            self.cluster.replace_store(node_id)
            self.num_store_restarts += 1
            replaced.append(node_id)
        return replaced


def answered_within(refs, timeout_s: float) -> set[ray.ObjectRef]:
    """The calls of `refs` that came back (answered or failed) within one shared deadline: a
    check takes `timeout_s` however many parts are silent."""
    refs = list(refs)
    if not refs:
        return set()
    answered, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return set(answered)


def _alive(ping: ray.ObjectRef) -> bool:
    """Whether a ping that came back was answered (not Ray telling of the actor's death)."""
    try:
        ray.get(ping)
    except RayActorError as error:
        return isinstance(error, RayTaskError)
    return True

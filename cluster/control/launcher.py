"""Brings the cluster up and down: Ray, a store node per Ray node, the worker pools and the
router actor. The controller (cluster/control/controller.py) keeps it healthy and sized."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from halfmoon.cluster.config import ClusterConfig, PoolConfig
from halfmoon.cluster.control.measured_profile import profile_workers
from halfmoon.cluster.control.ray_start import start_ray
from halfmoon.cluster.control.store_setup import StoreSetup
from halfmoon.cluster.control.worker_configs import worker_engine_config
from halfmoon.cluster.serving.router_actor import RouterActor
from halfmoon.cluster.worker.info import WorkerInfo
from halfmoon.decode_worker.worker import DecodeWorker
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.model_source import resolve_model
from halfmoon.kvstore.store_node import start_store_node, store_node_name
from halfmoon.prefill_worker.worker import PrefillWorker
from halfmoon.router.degree import profile_for_pools
from halfmoon.router.profile import Profile, load_profile

log = logging.getLogger(__name__)
WORKER_CLASSES = {"prefill": PrefillWorker, "decode": DecodeWorker}
END_ALL_TIMEOUT_S = 10.0  # a worker's `end_all` when its router is replaced
STORE_NAME_WAIT_S = 10.0  # for Ray to free a killed store node's name for its replacement


@dataclass(slots=True)
class WorkerHandle:
    name: str
    kind: str
    actor: ray.actor.ActorHandle


@dataclass
class Cluster:
    """A running halfmoon cluster, owned by the process that started it."""

    config: ClusterConfig
    cluster_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    workers: dict[str, WorkerHandle] = field(default_factory=dict)
    stores: dict[str, ray.actor.ActorHandle] = field(default_factory=dict)
    router: ray.actor.ActorHandle | None = None
    ports: dict = field(default_factory=dict)
    info: WorkerInfo | None = None
    profile: Profile | None = None
    owns_ray: bool = False
    store_setup: StoreSetup | None = None
    _counter: itertools.count = field(default_factory=itertools.count)
    _routers: itertools.count = field(default_factory=itertools.count)

    @property
    def pools(self) -> dict[str, PoolConfig]:
        if self.config.mode == "colocated":
            return {"decode": self.config.decode}
        return {"prefill": self.config.prefill, "decode": self.config.decode}

    def start(self) -> dict:
        """Start everything; returns the bound ports (`grpc_port`, `metrics_port`, and
        `http_port`, None when the HTTP API is off)."""
        began = time.monotonic()
        model = str(resolve_model(self.config.model))  # a missing model fails before Ray starts
        self.owns_ray = start_ray(self.config)
        replicas = sum(pool.replicas for pool in self.pools.values())
        log.info("Ray is up; starting %d worker(s) and the router", replicas)
        self.engine_config = self.config.engine.engine_config(model)
        for kind, pool in self.pools.items():
            for _ in range(pool.replicas):
                self._spawn(kind)
        # Started now, so its process comes up while the workers load the model.
        router = self._new_router(self.config)
        try:
            first = next(iter(self.workers.values()))
            self.info = ray.get(first.actor.info.remote())
            log.info("a worker has loaded the model (%.1f s)", time.monotonic() - began)
            self.store_setup = StoreSetup(self.config)
            self.ensure_stores()
            self.profile = self._profile()
            log.info("router profile ready (%.1f s)", time.monotonic() - began)
            ray.get(router.setup.remote(self.info, self.profile))
        except BaseException:
            ray.kill(router, no_restart=True)
            raise
        self.router = router
        self.ports = ray.get(self.router.start.remote())
        for node_id, store in self.stores.items():  # started before the router existed
            ray.get(self.router.add_store.remote(store_node_name(node_id), store))
        for worker in list(self.workers.values()):
            self._register(worker)
        if self.config.router.profile is None and self.config.mode == "disaggregated":
            ray.get(self.router.calibrate.remote())
        log.info("serving (%.1f s after start)", time.monotonic() - began)
        return self.ports

    def _new_router(self, config: ClusterConfig) -> ray.actor.ActorHandle:
        """A router actor on this process's node (the head under `ray up`): its ports are
        where clients look."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        generation = next(self._routers)
        name = f"halfmoon-router-{self.cluster_id}" + (f"-{generation}" if generation else "")
        options = {"name": name, "num_cpus": 0, "max_concurrency": 10_000}
        return ray.remote(RouterActor).options(**options, scheduling_strategy=here).remote(config)

    def replace_router(self, routed: list[str]) -> int:
        """The router died (or hangs): end what it had in flight on every worker, then start a
        new one on the same ports from the last profile the controller kept, routing to the
        stores and to the workers `routed` (those the dead one routed to). Returns how many
        requests the workers ended."""
        ray.kill(self.router, no_restart=True)  # a hung one lets go of its ports
        self.router = None
        ended = self._end_all(routed)
        server = self.config.server.model_copy(update=self.ports)  # the ports bound at start
        router = self._new_router(self.config.model_copy(update={"server": server}))
        ray.get(router.setup.remote(self.info, self.profile))
        self.router = router
        for node_id, store in self.stores.items():
            self._add_store(node_id, store_node_name(node_id), store)
        for name in routed:  # before the ports open: the first request finds them routed
            try:
                self._register(self.workers[name])
            except ray.exceptions.RayActorError as error:  # the health check replaces it
                log.warning("worker %s is not routed to by the new router: %s", name, error)
        self.ports = ray.get(router.start.remote())
        return ended

    def _end_all(self, names: list[str]) -> int:
        """Each of workers `names` ends every request it holds; returns how many in all (a
        worker that is dead or does not answer within END_ALL_TIMEOUT_S counts none)."""
        ends = {name: self.workers[name].actor.end_all.remote() for name in names}
        refs = list(ends.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=END_ALL_TIMEOUT_S)
        ended = 0
        for name, ref in ends.items():
            try:
                ended += ray.get(ref, timeout=0) if ref in ready else 0
            except ray.exceptions.RayError as error:
                log.warning("worker %s did not end its requests: %s", name, error)
        return ended

    def _profile(self) -> Profile | None:
        """The router's profile: the configured file, or measured now from the workers."""
        if self.config.router.profile is not None:
            return priced_for(file_profile(self.config.router.profile, self.config), self.info)
        cache_bytes = self.config.store.host_capacity_bytes
        return profile_workers(list(self.workers.values()), cache_bytes)

    def add_worker(self, kind: str, wait: bool = True) -> WorkerHandle:
        """Start one more worker of `kind`. With `wait`, route to it once it answers (which
        blocks while Ray places it, e.g. while the autoscaler boots a node); without, the
        caller passes it to `register_worker` once its `ping` answers."""
        worker = self._spawn(kind)
        if wait:
            self._register(worker)
        return worker

    def register_worker(self, worker: WorkerHandle) -> None:
        """Route to a worker started with `add_worker(kind, wait=False)` that now answers."""
        self._register(worker)

    def forget_worker(self, name: str) -> None:
        """Drop a started worker that died before it was ever routed to."""
        worker = self.workers.pop(name)
        ray.kill(worker.actor, no_restart=True)

    def remove_worker(self, name: str) -> None:
        """Stop routing to `name` and kill it (drain first with the controller)."""
        worker = self.workers.pop(name)
        ray.get(self.router.remove_worker.remote(name))
        ray.kill(worker.actor, no_restart=True)

    def ensure_stores(self) -> None:
        """A store node on every live Ray node (new nodes join as the autoscaler adds them)."""
        layout = self.info.kv_layout
        for node in ray.nodes():
            if not node["Alive"] and node["NodeID"] in self.stores:
                self._forget_store(node["NodeID"])
            if not node["Alive"] or node["NodeID"] in self.stores:
                continue
            name = store_node_name(node["NodeID"])
            config = self.store_setup.for_node(node)
            store = start_store_node(layout, config, node["NodeID"])
            self.stores[node["NodeID"]] = store
            if self.router is not None:
                self._add_store(node["NodeID"], name, store)

    def _add_store(self, node_id: str, name: str, store) -> None:
        """Tell the router of a new store node; one whose node died before it started (Ray
        still listed the node as alive) is dropped, and tried again while Ray lists it."""
        try:
            ray.get(self.router.add_store.remote(name, store))
        except ray.exceptions.RayTaskError as error:
            # Raised inside add_store, as the store's own death (not the router's).
            if not isinstance(error, ray.exceptions.RayActorError):
                raise
            log.warning("the store node %s did not start (its node died?): %s", name, error)
            self.stores.pop(node_id, None)

    def replace_store(self, node_id: str) -> None:
        """The store node of Ray node `node_id` died or hangs: its blocks leave the router's
        index at once; on a live node a new one starts under its name, and every worker is
        told to find it on next use (their calls in flight on the old one fail, and the
        router retries those requests)."""
        name = store_node_name(node_id)
        ray.kill(self.stores[node_id], no_restart=True)
        self._forget_store(node_id)
        if not any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes()):
            return
        _wait_until_unnamed(name, STORE_NAME_WAIT_S)
        self.ensure_stores()
        told = [w.actor.store_replaced.remote(name) for w in self.workers.values()]
        ray.wait(told, num_returns=len(told), timeout=END_ALL_TIMEOUT_S)

    def _forget_store(self, node_id: str) -> None:
        """A store node that died (or whose Ray node died): stop reading from it."""
        self.stores.pop(node_id)
        if self.router is not None:
            ray.get(self.router.remove_store.remote(store_node_name(node_id)))

    def stop(self) -> None:
        """Stop serving and release every actor and process this cluster started."""
        if self.router is not None:
            try:
                drain_s = self.config.server.drain_timeout_s
                in_flight, cut = ray.get(self.router.stop.remote(), timeout=drain_s + 20)
                log.info("drained %d requests in flight (%d cut at the timeout)", in_flight, cut)
            except Exception:  # noqa: BLE001 - shutting down regardless
                log.warning("router did not stop cleanly")
            ray.kill(self.router, no_restart=True)
            self.router = None
        for worker in self.workers.values():
            ray.kill(worker.actor, no_restart=True)
        self.workers.clear()
        for store in self.stores.values():
            ray.kill(store, no_restart=True)
        self.stores.clear()
        if self.store_setup is not None:
            self.store_setup.stop()
        if self.owns_ray:
            ray.shutdown()

    def _engine_config(self, kind: str) -> EngineConfig:
        return worker_engine_config(self.config, self.engine_config, kind)

    def _spawn(self, kind: str) -> WorkerHandle:
        pool = self.pools[kind]
        name = f"{kind}-{next(self._counter)}"
        actor = (
            ray.remote(WORKER_CLASSES[kind])
            .options(
                name=f"halfmoon-{self.cluster_id}-{name}",
                num_cpus=pool.num_cpus * pool.tensor_parallel_size,  # its ranks' processes
                num_gpus=pool.num_gpus * pool.tensor_parallel_size,
                resources=pool.resources or None,
                max_concurrency=10_000,
                max_restarts=0,
            )
            .remote(
                name,
                self._engine_config(kind),
                None,
                self.config.store.get_timeout_s,
                transfer=self.config.store.transfer,
            )
        )
        worker = self.workers[name] = WorkerHandle(name, kind, actor)
        return worker

    def _register(self, worker: WorkerHandle) -> None:
        ray.get(worker.actor.ping.remote())
        self.ensure_stores()
        store_name = ray.get(worker.actor.store_name.remote()) if worker.kind == "prefill" else None
        store = self.config.store
        notified = self.config.mode == "disaggregated" and store.direct_notices
        kv_peer = (
            ray.get(worker.actor.kv_peer.remote()) if worker.kind == "decode" and notified else None
        )
        ray.get(
            self.router.add_worker.remote(
                worker.name, worker.kind, worker.actor, store_name, kv_peer
            )
        )


def _wait_until_unnamed(name: str, timeout_s: float) -> None:
    """Until Ray has let go of the name of an actor just killed (a lookup would find the dead
    one), or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            return
        time.sleep(0.05)


def file_profile(path: str, config: ClusterConfig) -> Profile:
    """A profile from a file, scaled to the pools' degrees (router/degree.py) and made to prefill
    in this cluster's chunks: the online refit fits per-chunk steps, so a whole prompt is the sum
    over its chunks. A ProfileError names the pool whose degree cannot hold the weights."""
    profile = profile_for_pools(load_profile(path), *pool_degrees(config))
    chunk = config.engine.prefill_chunk_size or 0
    if profile.cost.chunk_tokens != chunk:
        profile.cost = dataclasses.replace(profile.cost, chunk_tokens=chunk)
    return profile


def priced_for(profile: Profile, info: WorkerInfo) -> Profile:
    """A file profile with the KV bytes of workers whose KV is quantized (`--kv-cache-dtype`):
    a profile states its model's KV at full width, and every transfer and cache price the
    router makes follows these bytes."""
    live = info.kv_bytes_per_token
    if not info.kv_dtype or profile.kv_bytes_per_token == live:
        return profile
    log.info("router profile: KV in %s, %d bytes a token", info.kv_dtype, live)
    note = f"{live}, the workers' {info.kv_dtype} KV ({profile.kv_bytes_per_token} in the file)"
    assumptions = {**profile.assumptions, "kv_bytes_per_token": note}
    return dataclasses.replace(profile, kv_bytes_per_token=live, assumptions=assumptions)


def pool_degrees(config: ClusterConfig) -> tuple[int, int]:
    """The (prefill, decode) pools' tensor-parallel degrees; colocated, the one pool's twice."""
    decode = config.decode.tensor_parallel_size
    prefill = decode if config.mode == "colocated" else config.prefill.tensor_parallel_size
    return prefill, decode

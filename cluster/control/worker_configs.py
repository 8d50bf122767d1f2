"""Each pool's engine config, derived once from the cluster config (the launcher spawns workers
with these)."""

from __future__ import annotations

from halfmoon.cluster.config import ClusterConfig, PoolConfig
from halfmoon.engine.config import EngineConfig


def pool_engine_config(base: EngineConfig, pool: PoolConfig) -> EngineConfig:
    """Workers sharing a GPU (fractional num_gpus) split its memory by their fraction."""
    share = min(pool.num_gpus, 1.0) if pool.num_gpus > 0 else 1.0
    utilization = base.gpu_memory_utilization * share
    return base.model_copy(update={"gpu_memory_utilization": utilization})


def worker_engine_config(config: ClusterConfig, base: EngineConfig, kind: str) -> EngineConfig:
    """A pool's engine config at its degree; prefill workers' KV caches shared with their
    node when they lend pages to decode workers (`store.lend_pages`, at degree 1)."""
    pool = config.decode if kind == "decode" else config.prefill
    engine = pool_engine_config(base, pool)
    engine = engine.model_copy(update={"tensor_parallel_size": pool.tensor_parallel_size})
    if kind == "prefill" and lends_pages(config) and pool.tensor_parallel_size == 1:
        engine = engine.model_copy(update={"share_kv": True})  # at T > 1 it cannot
    return engine


def lends_pages(config: ClusterConfig) -> bool:
    """Prefill workers lend their pages to decode workers on their node."""
    store = config.store
    return config.mode == "disaggregated" and store.direct_notices and store.lend_pages

"""Loading the cluster config: defaults, the example files and CLI overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.cluster.config import ClusterConfig, ConfigError, load_config, router_config
from halfmoon.cluster.control.autoscaling_policy import DecodeTargetPolicy, PrefillTargetPolicy
from halfmoon.engine.config import EngineConfig
from halfmoon.kvstore.config import StoreConfig
from halfmoon.router.config import RouterConfig

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def test_no_file_gives_the_documented_defaults():
    config = load_config()
    assert config == ClusterConfig()
    assert config.model is None
    assert config.mode == "disaggregated"
    assert (config.prefill.replicas, config.decode.replicas) == (1, 1)
    assert (config.engine.block_size, config.engine.prefill_chunk_size) == (16, 256)
    assert config.store.host_capacity_bytes == 256 << 20
    assert (config.server.host, config.server.grpc_port, config.server.metrics_port) == (
        "127.0.0.1",
        50051,
        9400,
    )
    assert config.router.policy == "conductor"
    assert config.autoscaling.prefill is None and config.autoscaling.decode is None


def test_local_example_equals_the_defaults():
    assert load_config(CONFIGS / "local.yaml") == load_config()


# gpu-cluster.yaml serves beyond loopback: it loads only with an API key (or an explicit
# allow_unauthenticated), as `serve` gives it from $HALFMOON_API_KEY.
KEYED = {"server.api_key": "k"}


def test_gpu_cluster_example_pins_pools_to_their_node_types():
    config = load_config(CONFIGS / "gpu-cluster.yaml", KEYED)
    assert config.prefill.resources == {"prefill": 1.0}
    assert config.decode.resources == {"decode": 1.0}
    assert config.prefill.num_gpus == config.decode.num_gpus == 1
    assert config.router.policy == "conductor"
    assert config.router.admission == "prediction_early_rejection"
    # Redis runs on the head at an address known at start: `serve --redis-url` gives it.
    assert config.store.redis_url is None
    assert config.store.host_memory_fraction == 0.25
    assert isinstance(config.autoscaling.prefill, PrefillTargetPolicy)
    assert isinstance(config.autoscaling.decode, DecodeTargetPolicy)


def test_dotted_overrides_replace_file_values():
    config = load_config(
        CONFIGS / "local.yaml",
        {"model": "/models/qwen", "prefill.replicas": 2, "server.grpc_port": 0, "mode": None},
    )
    assert config.model == "/models/qwen"
    assert config.prefill.replicas == 2
    assert config.server.grpc_port == 0
    assert config.mode == "disaggregated"


def test_autoscaling_may_name_a_policy_file():
    config = load_config(
        None, {"autoscaling": str(CONFIGS.parent / "autoscaling/prefill-queue.yaml")}
    )
    assert config.autoscaling.prefill.signal == "queue_s"
    assert config.autoscaling.decode is None


def test_colocated_mode_ignores_prefill_replicas():
    config = load_config(None, {"mode": "colocated", "prefill.replicas": 0})
    assert config.prefill.replicas == 0


def test_overriding_a_field_inside_a_value_is_an_error():
    with pytest.raises(ConfigError, match=r"override model\.x: model holds"):
        load_config(None, {"model": "m", "model.x": 1})


def test_a_file_that_is_not_a_mapping_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="it must be a mapping"):
        load_config(path)


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(tmp_path / "absent.yaml")


def test_engine_section_gives_the_engine_its_own_defaults():
    engine = ClusterConfig().engine.engine_config("/models/m")
    # Chunked prefill is the one value the cluster sets otherwise: it publishes KV per chunk.
    assert engine == EngineConfig(model="/models/m", prefill_chunk_size=256)


def test_store_section_gives_the_store_its_own_defaults():
    assert ClusterConfig().store.store_config() == StoreConfig()


def test_router_section_gives_the_conductor_its_defaults():
    router = router_config(ClusterConfig(), block_size=16)
    assert router == RouterConfig()
    assert router.policy == "conductor"


def test_a_bind_beyond_loopback_without_a_key_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match=r"server\.host.*0\.0\.0\.0 serves beyond this machine"):
        load_config(CONFIGS / "gpu-cluster.yaml")
    with pytest.raises(ConfigError, match="allow-unauthenticated"):
        load_config(None, {"server.host": "10.0.0.5"})
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert load_config(None, {"server.host": host}).server.host == host
    allowed = load_config(None, {"server.host": "0.0.0.0", "server.allow_unauthenticated": True})
    assert allowed.server.api_key is None


def test_the_host_tier_default_is_one_value():
    assert ClusterConfig().store.host_capacity_bytes == StoreConfig().host_capacity_bytes
    assert StoreConfig().host_capacity_bytes == 256 << 20


def test_block_size_default_is_shared_by_engine_router_and_cluster():
    sizes = {ClusterConfig().engine.block_size, RouterConfig().block_size}
    assert sizes == {EngineConfig(model="m").block_size}


def test_section_values_reach_the_part_configs():
    config = load_config(
        CONFIGS / "gpu-cluster.yaml", {"store.redis_url": "redis://h:6380/0", **KEYED}
    )
    engine = config.engine.engine_config("/models/qwen")
    assert (engine.max_num_seqs, engine.prefill_chunk_size, engine.dtype) == (256, 2048, "bfloat16")
    assert config.store.store_config().redis_ttl_s == 86400
    assert router_config(config, 16).bypass_max_tokens == 256


def test_each_pool_sets_its_tensor_parallel_degree_on_cpu():
    config = load_config(None, {"prefill.tensor_parallel_size": 2})
    assert (config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size) == (2, 1)
    with pytest.raises(ConfigError, match="decode.tensor_parallel_size"):
        load_config(None, {"engine.tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="shared CPU memory"):
        load_config(None, {"decode.tensor_parallel_size": 2, "decode.num_gpus": 1})

"""A cluster whose pools run at their own tensor-parallel degrees: the router's profile (a file
scaled to the pools' degrees, or measured per side at each worker's degree) and its instances
(each worker registered at its own degree with its own KV pages). No Ray is started."""

from __future__ import annotations

import pytest

from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import file_profile
from halfmoon.cluster.control.measured_profile import measured_profile
from halfmoon.cluster.serving.workers import Worker, WorkerPool
from halfmoon.cluster.worker.info import WorkerInfo
from halfmoon.engine.profiling import ProfileSamples
from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.router.conductor import Conductor
from halfmoon.router.config import RouterConfig
from halfmoon.router.degree import profile_for_pools
from halfmoon.router.errors import ProfileError
from halfmoon.router.prefix_index import PrefixIndex
from halfmoon.router.profile import DEFAULT_PROFILE, load_profile
from halfmoon.router.request import RouteRequest

A800 = load_profile(DEFAULT_PROFILE)  # timed at degree 8


def test_a_profile_file_is_scaled_to_each_pool_s_degree_and_the_cluster_s_chunks():
    config = load_config(
        None,
        {
            "prefill.tensor_parallel_size": 4,
            "decode.tensor_parallel_size": 8,
            "engine.prefill_chunk_size": 128,
        },
    )
    profile = file_profile(str(DEFAULT_PROFILE), config)
    assert profile.name == "llama70b-8xa800@tp4/8"
    assert profile.cost.prefill_coef == profile_for_pools(A800, 4, 8).cost.prefill_coef
    assert profile.cost.decode_coef == A800.cost.decode_coef
    assert profile.cost.chunk_tokens == 128


def test_a_colocated_cluster_scales_both_sides_to_its_one_pool_s_degree():
    config = load_config(None, {"mode": "colocated", "decode.tensor_parallel_size": 4})
    profile = file_profile(str(DEFAULT_PROFILE), config)
    assert (profile.name, profile.tensor_parallel_size, profile.decode_degree) == (
        "llama70b-8xa800@tp4",
        4,
        4,
    )


def test_a_pool_whose_degree_cannot_hold_the_weights_is_refused_at_start():
    config = load_config(None, {"prefill.tensor_parallel_size": 1})  # decode at 1 too
    with pytest.raises(ProfileError, match="llama70b-8xa800 at prefill degree 1"):
        file_profile(str(DEFAULT_PROFILE), config)


def _info(kind: str, degree: int, num_pages: int) -> WorkerInfo:
    return WorkerInfo(
        name=f"{kind}-0",
        kind=kind,
        model="/models/tiny",
        architecture="llama",
        vocab_size=256,
        max_model_len=512,
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        num_pages=num_pages,
        root_key=b"k",
        tensor_parallel_size=degree,
    )


def test_a_measured_profile_records_each_worker_s_degree_and_the_decode_worker_s_kv():
    prefill = ProfileSamples(
        prefill=[
            (n, c, 1e-3 + 1e-5 * n + 1e-9 * n * n + 1e-8 * n * c)
            for n in (16, 64, 256)
            for c in (0, 32)
        ],
        chunk_tokens=64,
    )
    decode = ProfileSamples(
        decode=[(b, k, 2e-3 + 1e-4 * b + 1e-7 * k) for b in (1, 4) for k in (64, 512)]
    )
    profile = measured_profile(
        _info("prefill", 2, 128), prefill, _info("decode", 1, 300), decode, 1 << 20
    )
    assert (profile.tensor_parallel_size, profile.decode_tensor_parallel_size) == (2, 1)
    assert profile.decode_kv_capacity_tokens == 300 * 16
    assert profile.cost.chunk_tokens == 64
    same = measured_profile(_info("prefill", 2, 128), prefill, _info("decode", 2, 128), decode, 0)
    assert (same.tensor_parallel_size, same.decode_tensor_parallel_size) == (2, None)
    assert same.decode_degree == 2


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_the_pool_registers_each_worker_at_its_degree_with_its_own_kv_pages(mode):
    profile = profile_for_pools(A800, 4, 4)
    config = RouterConfig(bypass_max_tokens=0)
    pool = WorkerPool(Conductor(config, profile, colocated=mode == "colocated"), mode)
    pool.add(Worker("decode-0", "decode", None, _info("decode", 4, 300)))
    if mode == "disaggregated":
        pool.add(Worker("prefill-0", "prefill", None, _info("prefill", 4, 100), "store-0"))
    conductor = pool.conductor
    too_big = conductor.route(RouteRequest("too-big", [1], 16, 300 * 16 - 15, 0.0), 0.0)
    assert "(most free: 4800)" in too_big.reason  # its own 300 pages of 16 tokens
    placed = conductor.route(RouteRequest("fits", [1], 16, 300 * 16 - 16, 0.0), 0.0)
    prefill = "prefill-0" if mode == "disaggregated" else "decode-0"
    assert (placed.prefill_instance, placed.decode_instance) == (prefill, "decode-0")
    assert (placed.prefill_degree, placed.decode_degree) == (4, 4)


def test_a_new_router_s_index_starts_from_the_snapshots_and_a_dead_store_leaves_it():
    # A router replacing a dead one learns what each worker's pages and store's tiers hold from
    # their snapshots; a store node that died takes its blocks out of the index at once.
    index = PrefixIndex()
    pool = WorkerPool(
        Conductor(RouterConfig(), profile_for_pools(A800, 4, 4), index), "disaggregated"
    )
    chain = [b"k0", b"k1", b"k2"]
    pool.add(
        Worker("prefill-0", "prefill", None, _info("prefill", 4, 100), "store-0"),
        [BlockEvent("stored", "prefill-0", "device", chain[:2])],
    )
    pool.add(
        Worker("decode-1", "decode", None, _info("decode", 4, 100)),
        [BlockEvent("stored", "decode-1", "device", chain)],
    )  # not a prefix cache: ignored
    pool.add_store("store-0", None, [BlockEvent("stored", "store-0", "host", chain)])
    assert index.longest_prefix(chain) == {("prefill-0", "device"): 2, ("store-0", "host"): 3}
    pool.remove_store("store-0")
    assert index.longest_prefix(chain) == {("prefill-0", "device"): 2}

"""A router profile measured from live workers: the cost model fitted from their start-up
profile (prefill's side from a prefill worker, decode's from a decode worker, each at its own
degree), sizes from the model's KV layout and the decode worker's pages, transfer figures from
the store's loopback path."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from pathlib import Path

import ray

from halfmoon.cluster.worker.info import WorkerInfo
from halfmoon.engine.profiling import ProfileSamples
from halfmoon.router.cost_model import CostModel
from halfmoon.router.profile import PROFILE_DIR, Profile, save_profile

# Ray's shared-memory object store between processes on one host, as measured by
# `halfmoon bench kvstore` (the Ray-actor rows): about 0.3-0.5 GB/s end to end on our CPU machines.
LOOPBACK_BYTES_PER_S = 4.0e8
LOOPBACK_LATENCY_S = 0.003


def profile_workers(workers: list, cache_bytes: float) -> Profile:
    """The profile measured now from one worker per pool of `workers` (the launcher's
    handles), each side at its pool's degree. Every worker is timed at once, as they will
    serve: workers sharing a node's cores are timed sharing them (one at a time, each would
    look faster than it serves); each times only its own side (a decode worker both where
    there is no prefill pool)."""
    by_kind = {w.kind: w for w in workers}
    colocated = "prefill" not in by_kind
    samples = {
        w.name: w.actor.profile.remote(w.kind == "prefill" or colocated, w.kind == "decode")
        for w in workers
    }
    infos = {kind: w.actor.info.remote() for kind, w in by_kind.items()}
    decode = ray.get(samples[by_kind["decode"].name])
    prefill = ray.get(samples[by_kind["prefill"].name]) if "prefill" in by_kind else decode
    decode_info = ray.get(infos["decode"])
    prefill_info = ray.get(infos["prefill"]) if "prefill" in infos else decode_info
    ray.get(list(samples.values()))
    return measured_profile(prefill_info, prefill, decode_info, decode, cache_bytes)


def measured_profile(
    prefill_info: WorkerInfo,
    prefill: ProfileSamples,
    decode_info: WorkerInfo,
    decode: ProfileSamples,
    cache_bytes: float,
) -> Profile:
    """Fit the cost model from a prefill and a decode worker's samples, each side at the degree
    of the worker it was measured on; the decode KV capacity is the decode worker's pages."""
    info = prefill_info
    kv_bytes_per_token = info.kv_bytes_per_token  # as stored and moved: quantized or not
    kv_suffix = f"-kv-{info.kv_dtype}" if info.kv_dtype else ""
    prefill_degree, decode_degree = info.tensor_parallel_size, decode_info.tensor_parallel_size
    return Profile(
        name=f"measured-{info.architecture}-{info.dtype}{kv_suffix}",
        cost=dataclasses.replace(
            CostModel.fit(prefill.prefill, decode.decode), chunk_tokens=prefill.chunk_tokens
        ),
        kv_bytes_per_token=kv_bytes_per_token,
        num_layers=info.num_layers,
        network_bytes_per_s=LOOPBACK_BYTES_PER_S,
        host_to_device_bytes_per_s=LOOPBACK_BYTES_PER_S,
        transfer_latency_s=LOOPBACK_LATENCY_S,
        decode_kv_capacity_tokens=decode_info.num_pages * decode_info.block_size,
        cache_bytes_per_instance=max(
            cache_bytes, info.num_pages * info.block_size * kv_bytes_per_token
        ),
        assumptions={
            "measured": datetime.date.today().isoformat(),
            "model": Path(info.model).name,
            "how": "start-up profile of live workers (engine/profiling.py), least-squares fit",
            "prefill_samples": [list(s) for s in prefill.prefill],
            "decode_samples": [list(s) for s in decode.decode],
            "transfer": "loopback Ray object store, LOOPBACK_* in cluster/control/"
            "measured_profile.py",
        },
        tensor_parallel_size=prefill_degree,
        decode_tensor_parallel_size=decode_degree if decode_degree != prefill_degree else None,
    )


def main(argv: list[str] | None = None) -> int:
    """`halfmoon profile`: measure the profile of a model on this machine and write it."""
    parser = argparse.ArgumentParser(
        prog="halfmoon profile",
        description="Profile the engine on this machine (prefill and decode timings) and write "
        "a router profile YAML the simulator and the Conductor can load.",
    )
    parser.add_argument("--model", help="checkpoint directory (default: the tiny model)")
    parser.add_argument("--out", default=str(PROFILE_DIR / "cpu-tiny.yaml"), help="YAML to write")
    args = parser.parse_args(argv)
    import torch

    from halfmoon.cluster.worker.info import worker_info
    from halfmoon.engine import LLM
    from halfmoon.engine.profiling import profile_engine

    torch.set_num_threads(1)
    llm = LLM(args.model, num_pages=512)
    samples = profile_engine(llm.engine)
    info = worker_info("profile", "both", llm.engine)
    profile = measured_profile(info, samples, info, samples, 256 << 20)
    save_profile(profile, args.out)
    print(f"wrote {args.out}: {profile.cost}")
    return 0

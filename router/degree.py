"""A profile at other tensor-parallel degrees, derived on paper when none was measured there, and
the degree each of the router's instances runs at.

A profile is timed at one degree (its `tensor_parallel_size`: the 70B profiles at 8, a measured
CPU one at 1), or at one per side (`decode_tensor_parallel_size`: a profile composed for prefill
and decode pools at two degrees). At degree T from T0 a step runs `speedup` = (T / T0) x
e^log2(T / T0) times faster: each doubling of the devices splits the compute and the weight and
KV reads in two, and loses 1 - e of that to the all-reduces and to kernels on smaller shapes (e =
`TP_EFFICIENCY_PER_DOUBLING`, an assumption, not a measurement: 0.85 is what Megatron-style TP
keeps per doubling within one NVLink node). Each side's cost-model coefficients are divided by
its own speedup. A device holds what one of the T0 devices did: the decode KV capacity is what
the T devices' memory holds beside one copy of the weights (`assumptions.weight_bytes`, 0 if the
profile does not say), and a prefill instance's devices must hold the weights too. The
host-to-device bandwidth, the network and the host cache are a node's, shared among its
instances by their devices (one PCIe link per device, the NICs and the DRAM in proportion), so a
split of the same GPUs has the same total; they are taken at the prefill degree, the side that
caches prefixes, fetches them and sends KV."""

from __future__ import annotations

import dataclasses
import logging
import math

from halfmoon.router.cost_model import CostModel
from halfmoon.router.errors import ProfileError
from halfmoon.router.profile import Profile

log = logging.getLogger(__name__)

TP_EFFICIENCY_PER_DOUBLING = 0.85


def tp_speedup(degree: int, from_degree: int, efficiency: float) -> float:
    """How many times faster a step runs at `degree` than at `from_degree`."""
    ratio = degree / from_degree
    return ratio * efficiency ** math.log2(ratio)


def profile_at_degree(
    profile: Profile, degree: int, efficiency: float = TP_EFFICIENCY_PER_DOUBLING
) -> Profile:
    """`profile` with both sides scaled to `degree` (see the module's docstring); a
    ProfileError when the weights do not fit the devices at `degree`."""
    return profile_for_pools(profile, degree, degree, efficiency)


def profile_for_pools(
    profile: Profile,
    prefill_degree: int,
    decode_degree: int,
    efficiency: float = TP_EFFICIENCY_PER_DOUBLING,
) -> Profile:
    """The router's profile for prefill instances at `prefill_degree` and decode instances at
    `decode_degree`, each side scaled from the degree it was timed at, named
    `<name>@tp<P>/<D>` (`<name>@tp<T>` when both are T); a ProfileError naming the side and
    degree whose devices cannot hold the weights."""
    if min(prefill_degree, decode_degree) < 1 or not 0 < efficiency <= 1:
        raise ProfileError(
            f"degrees {prefill_degree}/{decode_degree} must be >= 1 and efficiency {efficiency} "
            f"in (0, 1] to scale profile {profile.name}"
        )
    if (prefill_degree, decode_degree) == (profile.tensor_parallel_size, profile.decode_degree):
        return profile
    _kv_room_tokens(profile, prefill_degree, "prefill")
    prefill_speedup = tp_speedup(prefill_degree, profile.tensor_parallel_size, efficiency)
    decode_speedup = tp_speedup(decode_degree, profile.decode_degree, efficiency)
    share = prefill_degree / profile.tensor_parallel_size
    cost = profile.cost
    scaled = CostModel(
        tuple(c / prefill_speedup for c in cost.prefill_coef),
        tuple(c / decode_speedup for c in cost.decode_coef),
        cost.chunk_tokens,
    )
    return dataclasses.replace(
        profile,
        name=f"{profile.name.split('@tp')[0]}@{pools_name(prefill_degree, decode_degree)}",
        cost=scaled,
        tensor_parallel_size=prefill_degree,
        decode_tensor_parallel_size=decode_degree if decode_degree != prefill_degree else None,
        decode_kv_capacity_tokens=_kv_room_tokens(profile, decode_degree, "decode"),
        host_to_device_bytes_per_s=profile.host_to_device_bytes_per_s * share,
        network_bytes_per_s=profile.network_bytes_per_s * share,
        cache_bytes_per_instance=profile.cache_bytes_per_instance * share,
        assumptions={**profile.assumptions, "tp_efficiency_per_doubling": efficiency},
    )


def pools_name(prefill_degree: int, decode_degree: int) -> str:
    """`tp4/2`, or `tp4` when both pools are at 4."""
    if prefill_degree == decode_degree:
        return f"tp{prefill_degree}"
    return f"tp{prefill_degree}/{decode_degree}"


def side_degree(profile: Profile, role: str) -> int:
    """The degree `profile` times `role` ("prefill" or "decode") at."""
    return profile.decode_degree if role == "decode" else profile.tensor_parallel_size


def instance_degree(profile: Profile, role: str, instance: object, degree: int | None) -> int:
    """The degree of a `role` instance registered at `degree` (None: the profile's own). The
    router keeps one cost model per role, not one per instance: an instance at another degree
    than the profile's is predicted as if at the profile's, which a warning says."""
    timed_at = side_degree(profile, role)
    if degree is not None and degree != timed_at:
        off = tp_speedup(degree, timed_at, TP_EFFICIENCY_PER_DOUBLING)
        log.warning(
            f"{role} instance {instance} runs at tensor-parallel degree {degree}, but the "
            f"router's profile {profile.name} times {role} at degree {timed_at}: its predicted "
            f"step times are off by about {max(off, 1 / off):.2f}x; start it at degree "
            f"{timed_at} or scale the profile to the pool's degree (router/degree.py)"
        )
    return timed_at if degree is None else degree


def measures_side(profile: Profile, role: str, degree: int | None) -> bool:
    """Whether a `role` step measured on a worker at `degree` (None: unknown, taken as the
    profile's) times the profile's side of that role, and so may refit it: a short prompt
    prefilled on a decode worker at another degree than prefill's does not."""
    return degree is None or degree == side_degree(profile, role)


def _kv_room_tokens(profile: Profile, degree: int, side: str) -> int:
    """Tokens of KV that `degree` devices hold beside the weights (each device as one of the
    profile's decode devices); a ProfileError when not even one."""
    weight_bytes = float(profile.assumptions.get("weight_bytes", 0.0))
    kv_bytes = profile.decode_kv_capacity_tokens * profile.kv_bytes_per_token
    per_device = (kv_bytes + weight_bytes) / profile.decode_degree
    left = degree * per_device - weight_bytes
    if left < profile.kv_bytes_per_token:
        raise ProfileError(
            f"profile {profile.name} at {side} degree {degree}: {degree} devices of "
            f"{per_device:.3g} bytes hold no KV beside {weight_bytes:.3g} bytes of weights; use "
            f"a higher {side} degree"
        )
    return int(left // profile.kv_bytes_per_token)

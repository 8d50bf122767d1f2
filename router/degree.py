"""A profile at another tensor-parallel degree, derived on paper when none was measured there.

A profile is timed at one degree (its `tensor_parallel_size`: the 70B profiles at 8, a measured
CPU one at 1). At degree T from T0 a step runs `speedup` = (T / T0) x e^log2(T / T0) times
faster: each doubling of the devices splits the compute and the weight and KV reads in two, and
loses 1 - e of that to the all-reduces and to kernels on smaller shapes (e =
`TP_EFFICIENCY_PER_DOUBLING`, an assumption, not a measurement: 0.85 is what Megatron-style TP
keeps per doubling within one NVLink node). Every cost-model coefficient is divided by it. The
decode KV capacity is what the T devices' memory holds beside one copy of the weights
(`assumptions.weight_bytes`, 0 if the profile does not say), each device holding what one of the
T0 devices did; the host-to-device bandwidth is one link per device. The network and the host
cache are the node's and stay as they are."""

from __future__ import annotations

import dataclasses
import math

from halfmoon.router.cost_model import CostModel
from halfmoon.router.errors import ProfileError
from halfmoon.router.profile import Profile

TP_EFFICIENCY_PER_DOUBLING = 0.85


def tp_speedup(degree: int, from_degree: int, efficiency: float) -> float:
    """How many times faster a step runs at `degree` than at `from_degree`."""
    ratio = degree / from_degree
    return ratio * efficiency ** math.log2(ratio)


def profile_at_degree(
    profile: Profile, degree: int, efficiency: float = TP_EFFICIENCY_PER_DOUBLING
) -> Profile:
    """`profile` scaled from its own degree to `degree` (see the module's docstring); a
    ProfileError when the weights do not fit the devices at `degree`."""
    if degree < 1 or not 0 < efficiency <= 1:
        raise ProfileError(
            f"degree {degree} must be >= 1 and efficiency {efficiency} in (0, 1] to scale "
            f"profile {profile.name}"
        )
    from_degree = profile.tensor_parallel_size
    if degree == from_degree:
        return profile
    speedup = tp_speedup(degree, from_degree, efficiency)
    cost = profile.cost
    scaled = CostModel(
        tuple(c / speedup for c in cost.prefill_coef),
        tuple(c / speedup for c in cost.decode_coef),
        cost.chunk_tokens,
    )
    return dataclasses.replace(
        profile,
        name=f"{profile.name}@tp{degree}",
        cost=scaled,
        tensor_parallel_size=degree,
        decode_kv_capacity_tokens=_kv_capacity_tokens(profile, degree),
        host_to_device_bytes_per_s=profile.host_to_device_bytes_per_s * degree / from_degree,
        assumptions={**profile.assumptions, "tp_efficiency_per_doubling": efficiency},
    )


def _kv_capacity_tokens(profile: Profile, degree: int) -> int:
    weight_bytes = float(profile.assumptions.get("weight_bytes", 0.0))
    kv_bytes = profile.decode_kv_capacity_tokens * profile.kv_bytes_per_token
    per_device = (kv_bytes + weight_bytes) / profile.tensor_parallel_size
    left = degree * per_device - weight_bytes
    if left < profile.kv_bytes_per_token:
        raise ProfileError(
            f"profile {profile.name} at degree {degree}: {degree} devices of "
            f"{per_device:.3g} bytes hold no KV beside {weight_bytes:.3g} bytes of weights; use "
            "a higher degree"
        )
    return int(left // profile.kv_bytes_per_token)

"""The cluster `bench live-capacity` mirrors: its mode, instances, router and profile, as
`GetServerInfo` reports them, and the SLOs it is judged against by default."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from halfmoon.router.config import RouterConfig
from halfmoon.router.errors import ProfileError, RouterConfigError
from halfmoon.router.profile import Profile, profile_from_dict

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
# Default SLOs, as multiples of the profile's unloaded times for the workload's mean request
# (Mooncake's 30 s TTFT and 100-300 ms TBT are loose multiples of a 70B model's; these keep the
# same shape for whatever model the cluster serves, a tiny one on CPU included).
TTFT_SLO_X, TBT_SLO_X = 10.0, 5.0


class LiveCapacityError(ValueError):
    """The server cannot be mirrored by the simulator; the message names the fix."""


@dataclass(slots=True)
class ClusterShape:
    """What the simulator copies from a live cluster."""

    mode: str
    num_prefill: int
    num_decode: int
    router: RouterConfig
    profile: Profile
    model: str

    @property
    def instances(self) -> str:
        if self.mode == COLOCATED:
            return f"{self.num_decode} colocated"
        return f"{self.num_prefill}P+{self.num_decode}D"


def default_slos(
    shape: ClusterShape, mean_prompt: float, mean_output: float
) -> tuple[float, float]:
    """TTFT and TBT SLOs as TTFT_SLO_X and TBT_SLO_X times the profile's unloaded figures for
    the mean request: its prefill, the fixed per-request overhead and (disaggregated) its KV
    transfer, and a decode step of one sequence. The hand-off the router refits under load is
    left out, so the SLOs of a cluster do not drift with the load it has seen."""
    profile = shape.profile
    ttft = profile.request_overhead_s + profile.cost.prefill_time(mean_prompt, 0)
    if shape.mode == DISAGGREGATED:
        ttft += profile.transfer_time(int(mean_prompt))
    tbt = profile.cost.decode_step_time(1, mean_prompt + mean_output / 2)
    return TTFT_SLO_X * ttft, TBT_SLO_X * tbt


def shape_from_server(
    details: dict, mode: str, model: str, profile: Profile | None
) -> ClusterShape:
    """The cluster as `GetServerInfo` describes it; `profile` (from --profile) wins over the
    server's. Every field is checked: it comes from the network."""
    if mode not in (DISAGGREGATED, COLOCATED):
        raise LiveCapacityError(
            f"the server's mode {mode!r} is neither {DISAGGREGATED} nor {COLOCATED}"
        )
    workers = details.get("workers")
    if not isinstance(workers, dict):
        raise LiveCapacityError("the server's info lists no workers; is it a halfmoon cluster?")
    counts = {"prefill": 0, "decode": 0}
    for load in workers.values():
        if not isinstance(load, dict) or load.get("dead") or load.get("draining"):
            continue
        if load.get("kind") in counts:
            counts[load["kind"]] += 1
    if counts["decode"] < 1 or (mode == DISAGGREGATED and counts["prefill"] < 1):
        raise LiveCapacityError(f"the server has no live worker of a kind it needs: {counts}")
    router = details.get("router")
    if not isinstance(router, dict):
        raise LiveCapacityError(
            "the server does not report its router settings (GetServerInfo `router`); it is older "
            "than this client: upgrade it"
        )
    names = {f.name for f in dataclasses.fields(RouterConfig)}
    try:
        config = RouterConfig(**{k: v for k, v in router.items() if k in names})
    except (RouterConfigError, TypeError) as error:
        raise LiveCapacityError(f"the server's router settings are invalid: {error}") from None
    if profile is None:
        if "profile" not in details:
            raise LiveCapacityError("the server does not report its profile; pass --profile FILE")
        try:
            profile = profile_from_dict(details["profile"], "from the server")
        except (ProfileError, TypeError, ValueError, KeyError, AttributeError) as error:
            raise LiveCapacityError(f"the server's profile is invalid: {error}") from None
    return ClusterShape(mode, counts["prefill"], counts["decode"], config, profile, model)

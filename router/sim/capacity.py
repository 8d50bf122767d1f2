"""Effective request capacity (Mooncake's headline metric): the highest arrival rate at which a
cluster still serves `target` of the requests within both SLOs (TTFT and TBT), found by
bisection on the trace's arrival rate, for the disaggregated cluster (the Conductor on N prefill
instances at degree P + M decode instances at degree D, for each split tried) and for colocated
instances at one degree on the same GPUs (for each routing tried); each side counts its best
configuration. Each instance is timed by the profile scaled to its degree (router/degree.py).

Every run is kept, keyed by its rate factor, and judged at every TBT threshold, so the
bisections for 300, 200 and 100 ms share the runs they have in common.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from halfmoon.router.config import RouterConfig
from halfmoon.router.degree import profile_at_degree
from halfmoon.router.profile import Profile
from halfmoon.router.sim.colocated_simulation import ColocatedSimulation
from halfmoon.router.sim.simulation import SimInstances, Simulation
from halfmoon.router.sim.splits import Split
from halfmoon.router.sim.trace import TraceRecord

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
# The lowest rate factor tried before a mode is declared unable to meet the SLOs at all, and
# the highest tried before its capacity is reported as this bound (the SLOs are too loose).
MIN_SCALE, MAX_SCALE = 1 / 256, 4096.0


def highest_passing(
    passes: Callable[[float], bool],
    start: float,
    rel_tol: float,
    known: dict[float, bool] | None = None,
    min_x: float = MIN_SCALE,
    max_x: float = MAX_SCALE,
) -> float:
    """The highest x that `passes` (assumed true below some threshold, false above), within a
    factor 1 + `rel_tol`: bracket by doubling or halving from `start` (or from `known`
    results), then bisect in log space. 0.0 when even `min_x` fails, `max_x` when it passes."""
    known = dict(known or {})
    failing = [x for x, ok in known.items() if not ok]
    hi = min(failing) if failing else None
    passing = [x for x, ok in known.items() if ok and (hi is None or x < hi)]
    lo = max(passing) if passing else None

    def test(x: float) -> bool:
        if x not in known:
            known[x] = passes(x)
        return known[x]

    if lo is None:
        x = start if hi is None else min(start, hi / 2)
        while not test(x):
            hi = x
            if x <= min_x:
                return 0.0
            x = max(x / 2, min_x)
        lo = x
    if hi is None:
        x = min(lo * 2, max_x)
        while test(x):
            if x >= max_x:
                return max_x
            lo, x = x, min(x * 2, max_x)
        hi = x
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True)
class Point:
    """One simulated run at `rate_rps` (the trace's rate times `scale`); `rejected` is the
    fraction of requests rejected at arrival."""

    scale: float
    rate_rps: float
    attainment: dict[float, float]
    ttft_mean_s: float
    ttft_p90_s: float
    tbt_mean_s: float
    tbt_p90_s: float
    hit_rate: float
    rejected: float
    wall_s: float

    def to_dict(self) -> dict:
        """Plain dict for JSON, attainment keyed by the TBT threshold in ms."""
        data = dataclasses.asdict(self)
        data["attainment"] = {f"{k * 1e3:g}": v for k, v in self.attainment.items()}
        return data


@dataclass(slots=True)
class Setup:
    """The trace, profile, cluster sizes and SLOs one capacity sweep shares across modes.
    `cache_blocks` None: each instance caches its profile's cache bytes at its degree;
    `colocated_degree` None: the profile's own."""

    records: list[TraceRecord]
    profile: Profile
    splits: tuple[Split, ...]
    cache_blocks: int | None
    block_size: int = 512
    max_batched_tokens: int = 2048
    ttft_slo_s: float = 30.0
    tbt_slos_s: tuple[float, ...] = (0.1, 0.2, 0.3)
    target: float = 0.9
    # Each side's admission against the TTFT SLO (RouterConfig.admission).
    admission: str = "early_rejection"
    colocated_admission: str = "none"
    colocated_degree: int | None = None

    def __post_init__(self) -> None:
        if self.colocated_degree is None:
            self.colocated_degree = self.profile.tensor_parallel_size

    @property
    def num_gpus(self) -> int:
        """GPUs of either mode: N x P + M x D of any split."""
        return self.splits[0].num_gpus

    @property
    def colocated_profile(self) -> Profile:
        """The profile at the colocated degree."""
        return profile_at_degree(self.profile, self.colocated_degree)

    @property
    def num_colocated(self) -> int:
        """Colocated instances on the splits' GPUs."""
        return self.num_gpus // self.colocated_degree

    def cache_blocks_of(self, profile: Profile) -> int:
        """Prefix-cache blocks of one prefill or colocated instance timed by `profile`."""
        if self.cache_blocks is not None:
            return self.cache_blocks
        return profile.cache_blocks(self.block_size)

    @property
    def base_rate_rps(self) -> float:
        """The trace's own mean arrival rate."""
        span = self.records[-1].arrival_s - self.records[0].arrival_s
        return (len(self.records) - 1) / span if span > 0 else float(len(self.records))


@dataclass
class ModeSweep:
    """Runs of one configuration at scaled rates, memoized: `disaggregated/<split name>` (with
    its `split`) or `colocated/<routing>`."""

    mode: str
    setup: Setup
    on_run: Callable[[], None] | None = None
    split: Split | None = None
    points: dict[float, Point] = field(default_factory=dict)

    def at(self, scale: float) -> Point:
        """Simulate the trace at `scale` times its rate (once per scale)."""
        point = self.points.get(scale)
        if point is None:
            point = self.points[scale] = self._run(scale)
            if self.on_run is not None:
                self.on_run()
        return point

    def capacity_scale(self, tbt_slo_s: float, rel_tol: float) -> float:
        """The highest rate factor meeting both SLOs for `target` of the requests."""
        target = self.setup.target

        def passes(scale: float) -> bool:
            return self.at(scale).attainment[tbt_slo_s] >= target

        known = {s: p.attainment[tbt_slo_s] >= target for s, p in self.points.items()}
        return highest_passing(passes, 1.0, rel_tol, known)

    def _run(self, scale: float) -> Point:
        setup = self.setup
        records = [dataclasses.replace(r, arrival_s=r.arrival_s / scale) for r in setup.records]
        started = time.perf_counter()
        simulation = self._simulation()
        summary = simulation.run(records, progress=False)
        ttft, tbt = simulation.latencies()
        in_ttft = ttft <= setup.ttft_slo_s
        attainment = {slo: float(np.mean(in_ttft & (tbt <= slo))) for slo in setup.tbt_slos_s}
        return Point(
            scale,
            setup.base_rate_rps * scale,
            attainment,
            summary.ttft_mean_s,
            summary.ttft_p90_s,
            summary.tbt_mean_s,
            summary.tbt_p90_s,
            summary.hit_rate,
            summary.rejected / max(summary.requests, 1),
            time.perf_counter() - started,
        )

    @property
    def kind(self) -> str:
        """`disaggregated` or `colocated`."""
        return self.mode.split("/")[0]

    def _simulation(self) -> Simulation | ColocatedSimulation:
        setup, split = self.setup, self.split
        if split is None:
            return self._colocated()
        # No TBT SLO in the router: runs do not depend on the threshold they are judged at
        # (the short-prompt bypass then keeps its stalls under bypass_max_stall_s).
        config = self._config("conductor", setup.admission)
        profile = split.profile(setup.profile)
        blocks = setup.cache_blocks_of(profile)
        instances = SimInstances(profile, split.num_prefill, split.num_decode, blocks)
        return Simulation(config, instances)

    def _colocated(self) -> ColocatedSimulation:
        setup = self.setup
        config = self._config(self.mode.split("/")[1], setup.colocated_admission)
        profile = setup.colocated_profile
        blocks = setup.cache_blocks_of(profile)
        return ColocatedSimulation(
            config, profile, setup.num_colocated, blocks, setup.max_batched_tokens
        )

    def _config(self, policy: str, admission: str) -> RouterConfig:
        setup = self.setup
        ttft_slo_s = setup.ttft_slo_s if admission != "none" else None
        return RouterConfig(
            policy=policy, admission=admission, ttft_slo_s=ttft_slo_s, block_size=setup.block_size
        )


@dataclass(slots=True)
class Capacity:
    """The capacity of each mode at one TBT threshold, in requests per second."""

    tbt_slo_s: float
    by_mode: dict[str, float]

    def best(self, kind: str) -> tuple[str, float]:
        """The configuration of `kind` (disaggregated or colocated) with the highest capacity."""
        modes = {k: v for k, v in self.by_mode.items() if k.split("/")[0] == kind}
        mode = max(modes, key=modes.get)
        return mode, modes[mode]

    @property
    def ratio(self) -> float:
        """Best disaggregated over best colocated capacity (inf when colocated never meets it)."""
        colocated = self.best(COLOCATED)[1]
        return self.best(DISAGGREGATED)[1] / colocated if colocated > 0 else math.inf


def sweep(
    setup: Setup,
    colocated_policies: tuple[str, ...],
    rel_tol: float,
    at_rates_rps: tuple[float, ...] = (),
    on_run: Callable[[], None] | None = None,
) -> tuple[list[Capacity], dict[str, ModeSweep]]:
    """Every mode's capacity at every TBT threshold (loosest first, so the tighter bisections
    start from runs already made), plus every mode's runs at `at_rates_rps`."""
    runs_of = [ModeSweep(f"{DISAGGREGATED}/{s.name}", setup, on_run, s) for s in setup.splits]
    runs_of += [ModeSweep(f"{COLOCATED}/{policy}", setup, on_run) for policy in colocated_policies]
    sweeps = {runs.mode: runs for runs in runs_of}
    by_slo: dict[float, dict[str, float]] = {slo: {} for slo in setup.tbt_slos_s}
    for mode, runs in sweeps.items():
        for rate in at_rates_rps:
            runs.at(rate / setup.base_rate_rps)
        for slo in sorted(setup.tbt_slos_s, reverse=True):
            by_slo[slo][mode] = runs.capacity_scale(slo, rel_tol) * setup.base_rate_rps
    return [Capacity(slo, by_slo[slo]) for slo in setup.tbt_slos_s], sweeps

"""The simulated side of `bench live-capacity`: the requests sent, replayed on a simulator set
up as the live cluster is, and compared with the live attainment rate by rate."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import numpy as np

from halfmoon.bench.studies.live_shape import DISAGGREGATED, ClusterShape, LiveCapacityError
from halfmoon.bench.workload import BenchRequest
from halfmoon.router.sim.capacity import MAX_SCALE, highest_passing
from halfmoon.router.sim.colocated_simulation import ColocatedSimulation
from halfmoon.router.sim.simulation import SimInstances, Simulation
from halfmoon.router.sim.summary import percentile
from halfmoon.router.sim.trace import TraceRecord


@dataclass(slots=True)
class SimFigures:
    """One simulated run: attainment and the latencies behind it."""

    attainment: float
    rejected: float
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_mean_s: float
    tbt_p99_s: float


def simulate(
    shape: ClusterShape,
    records: list[TraceRecord],
    block_size: int,
    max_batched_tokens: int,
    slos: tuple[float, float],
) -> SimFigures:
    """The records on the simulated cluster; the attainment is judged as `bench capacity` judges
    it (TTFT and TBT, a request's decode time over its decoded tokens; rejected ones miss)."""
    router = dataclasses.replace(shape.router, block_size=block_size)
    cache_blocks = shape.profile.cache_blocks(block_size)
    if shape.mode == DISAGGREGATED:
        instances = SimInstances(shape.profile, shape.num_prefill, shape.num_decode, cache_blocks)
        sim = Simulation(router, instances)
    else:  # the live colocated router picks the least loaded worker and admits everything
        router = dataclasses.replace(router, policy="least_loaded", admission="none")
        sim = ColocatedSimulation(
            router, shape.profile, shape.num_decode, cache_blocks, max_batched_tokens
        )
    sim.run(records, progress=False)
    ttft, tbt = sim.latencies()
    ttft_slo, tbt_slo = slos
    served = np.isfinite(ttft)
    ttfts = sorted(ttft[served].tolist()) or [0.0]
    tbts = sorted(tbt[served].tolist()) or [0.0]
    return SimFigures(
        float(np.mean((ttft <= ttft_slo) & (tbt <= tbt_slo))),
        float(np.mean(~served)),
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        statistics.fmean(tbts),
        percentile(tbts, 0.99),
    )


def simulated_capacity(
    shape: ClusterShape,
    records: list[TraceRecord],
    block_size: int,
    max_batched_tokens: int,
    slos: tuple[float, float],
    target: float,
) -> float:
    """The highest rate (req/s) at which the simulator meets the SLOs for `target` of these
    requests, their arrivals scaled (bisection, within 5 %); inf when they meet them even all
    at once."""
    span = records[-1].arrival_s - records[0].arrival_s
    base_rps = (len(records) - 1) / span if span > 0 else float(len(records))

    def passes(scale: float) -> bool:
        scaled = [dataclasses.replace(r, arrival_s=r.arrival_s / scale) for r in records]
        return simulate(shape, scaled, block_size, max_batched_tokens, slos).attainment >= target

    scale = highest_passing(passes, 1.0, 0.05)
    return math.inf if scale >= MAX_SCALE else scale * base_rps


def to_records(
    requests: list[BenchRequest], hash_ids: list[list[int]] | None, block_size: int
) -> list[TraceRecord]:
    """The simulator's view of the requests sent: same lengths and arrival times; hash ids from
    the trace, or (random prompts, which share nothing) fresh ones per `block_size` tokens."""
    records, next_id = [], 0
    for i, request in enumerate(requests):
        if hash_ids is not None:
            ids = list(hash_ids[i])
        else:
            count = math.ceil(len(request.prompt_token_ids) / block_size)
            ids, next_id = list(range(next_id, next_id + count)), next_id + count
        records.append(
            TraceRecord(
                i + 1, request.arrival_s, len(request.prompt_token_ids), request.max_tokens, ids
            )
        )
    return records


@dataclass(slots=True)
class Agreement:
    """Live against simulated attainment at one rate."""

    rate_rps: float
    live: float
    simulated: float
    tolerance: float

    @property
    def difference(self) -> float:
        return self.live - self.simulated

    @property
    def agrees(self) -> bool:
        return abs(self.difference) <= self.tolerance + 1e-12

    def to_dict(self) -> dict:
        return {
            "rate_rps": self.rate_rps,
            "live_attainment": self.live,
            "simulated_attainment": self.simulated,
            "difference": self.difference,
            "agrees": self.agrees,
        }


def compare(
    rates: list[float], live: list[float], simulated: list[float], tolerance: float
) -> list[Agreement]:
    """One Agreement per rate."""
    if not len(rates) == len(live) == len(simulated):
        raise ValueError(f"{len(rates)} rates but {len(live)} live, {len(simulated)} simulated")
    return [Agreement(*row, tolerance) for row in zip(rates, live, simulated, strict=True)]


def rates_from_capacity(capacity_rps: float, fractions: tuple[float, ...]) -> list[float]:
    """The rates to run: fractions of the simulated capacity."""
    if capacity_rps <= 0:
        raise LiveCapacityError(
            "the simulator misses the SLOs even at the lowest rate: loosen --ttft-slo / "
            "--tbt-slo, or pass --rates"
        )
    if math.isinf(capacity_rps):
        raise LiveCapacityError(
            "the simulator meets the SLOs even with every request sent at once: tighten "
            "--ttft-slo / --tbt-slo, send more --num-prompts, or pass --rates"
        )
    return [capacity_rps * f for f in fractions]

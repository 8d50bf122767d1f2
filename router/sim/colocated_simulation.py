"""The colocated baseline: `num_instances` instances that each prefill and decode in one
continuous batch (`SimColocated`, vLLM with chunked prefill and prefix caching), behind a router
that is either least-loaded or local-cache-aware. Same cost model, traces and SLO figures as the
disaggregated `Simulation`, so the two compare on the same GPUs.
"""

from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

from halfmoon.router.config import RouterConfig, check_choice
from halfmoon.router.errors import RouterConfigError
from halfmoon.router.predictor import Predictor, summarize_hits
from halfmoon.router.prefix_index import PrefixIndex
from halfmoon.router.profile import Profile
from halfmoon.router.sim.cache_bound import cache_bound_ttft_s
from halfmoon.router.sim.colocated_instance import ColocatedJob, SimColocated
from halfmoon.router.sim.summary import SimSummary, percentile
from halfmoon.router.sim.trace import TraceRecord, unbounded_hit_rate

COLOCATED_POLICIES = ("least_loaded", "cache_aware_local")
COLOCATED_ADMISSION = ("none", "early_rejection")


class ColocatedSimulation:
    """One run of a trace on colocated instances, routed by `config.policy`:
    `least_loaded` (fewest unfinished requests, then least queued prefill) or
    `cache_aware_local` (least queued prefill plus the prefill of what the instance does not
    hold, as predicted by the Conductor's own `Predictor`). With `early_rejection` a request
    whose predicted TTFT there (queued prefill plus its own) breaks `config.ttft_slo_s` is
    rejected at arrival, as the Conductor's early rejection does."""

    def __init__(
        self,
        config: RouterConfig,
        profile: Profile,
        num_instances: int,
        cache_blocks: int,
        max_batched_tokens: int = 2048,
    ) -> None:
        check_choice("colocated routing", config.policy, COLOCATED_POLICIES)
        check_choice("colocated admission", config.admission, COLOCATED_ADMISSION)
        if num_instances < 1 or max_batched_tokens < 1:
            raise RouterConfigError(
                f"need at least one instance and a token budget >= 1, got {num_instances} and "
                f"{max_batched_tokens}"
            )
        self.config = config
        self.profile = profile
        self.index = PrefixIndex()
        self.predictor = Predictor(profile, config.block_size, config.fetch_margin_s)
        self.instances = [
            SimColocated(
                f"c{i}", profile, cache_blocks, self.index, config.block_size, max_batched_tokens
            )
            for i in range(num_instances)
        ]
        self.ttft_s = np.empty(0)
        self.tbt_s = np.empty(0)

    def run(self, records: list[TraceRecord], progress: bool = True) -> SimSummary:
        """Route every record at its arrival, run every instance to completion, summarize."""
        started = time.perf_counter()
        count = len(records)
        self.ttft_s = np.full(count, np.inf)
        self.tbt_s = np.full(count, np.inf)
        instances = self.instances
        for i, record in enumerate(tqdm(records, unit="req", disable=not progress)):
            now = record.arrival_s
            for instance in instances:
                instance.advance(now)
                self._collect(instance, records)
            self._route(str(i), record)
        for instance in instances:
            instance.drain()
            self._collect(instance, records)
        return self._summary(records, time.perf_counter() - started)

    def latencies(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-request TTFT and TBT seconds in trace order after `run` (inf when rejected)."""
        return self.ttft_s, self.tbt_s

    def _route(self, rid: str, record: TraceRecord) -> None:
        prompt = record.num_prompt_tokens
        if prompt + record.num_output_tokens > self.profile.decode_kv_capacity_tokens:
            return  # never fits one instance's KV: rejected, counted as missed
        if self.config.policy == "least_loaded":
            target = min(self.instances, key=lambda c: (c.num_requests, c.queued_prefill_s))
            depth = target.cache.prefix_depth(record.hash_ids)
        else:
            local = summarize_hits(self.index.longest_prefix(record.hash_ids)).local_blocks
            plans = {}
            best = None
            for instance in self.instances:
                depth = local.get(instance.name, 0)
                if depth not in plans:
                    plans[depth] = self.predictor.local_plan(depth, prompt).work_s
                key = (instance.queued_prefill_s + plans[depth], instance.num_requests)
                if best is None or key < best[0]:
                    best = (key, instance, depth)
            _, target, depth = best
        work_s = self.predictor.local_plan(depth, prompt).work_s
        early = self.config.admission == "early_rejection"
        slo_s = self.config.ttft_slo_s if early else None
        if (
            slo_s is not None
            and target.queued_prefill_s + work_s + self.profile.request_overhead_s > slo_s
        ):
            return
        target.add(ColocatedJob(rid, record.hash_ids, prompt, record.num_output_tokens, work_s))

    def _collect(self, instance: SimColocated, records: list[TraceRecord]) -> None:
        overhead_s = self.profile.request_overhead_s
        for first in instance.first_tokens:
            i = int(first.request_id)
            self.ttft_s[i] = first.time_s + overhead_s - records[i].arrival_s
            if records[i].num_output_tokens <= 1:
                self.tbt_s[i] = 0.0
        for done in instance.finished:
            self.tbt_s[int(done.request_id)] = done.tbt_s
        instance.first_tokens.clear()
        instance.finished.clear()

    def _summary(self, records: list[TraceRecord], wall_s: float) -> SimSummary:
        ttft, tbt = self.ttft_s, self.tbt_s
        served = np.isfinite(ttft)
        ttfts = sorted(ttft[served].tolist())
        tbts = sorted(tbt[served & (tbt > 0)].tolist())
        config = self.config
        met = (ttft <= (config.ttft_slo_s or np.inf)) & (tbt <= (config.tbt_slo_s or np.inf))
        first = records[0].arrival_s if records else 0.0
        last = max((c.batch.clock_s for c in self.instances), default=first)
        makespan = max(last - first, 1e-9)
        outputs = sum(r.num_output_tokens for r, ok in zip(records, served, strict=True) if ok)
        hit = sum(c.hit_blocks for c in self.instances)
        total = sum(c.total_blocks for c in self.instances)
        return SimSummary(
            policy=f"colocated/{config.policy}",
            admission=config.admission,
            requests=len(records),
            served=int(served.sum()),
            rejected=int((~served).sum()),
            ttft_mean_s=float(np.mean(ttfts)) if ttfts else 0.0,
            ttft_p50_s=percentile(ttfts, 0.5),
            ttft_p90_s=percentile(ttfts, 0.9),
            ttft_p99_s=percentile(ttfts, 0.99),
            tbt_mean_s=float(np.mean(tbts)) if tbts else 0.0,
            tbt_p50_s=percentile(tbts, 0.5),
            tbt_p90_s=percentile(tbts, 0.9),
            tbt_p99_s=percentile(tbts, 0.99),
            slo_attainment=float(met.mean()) if len(records) else 0.0,
            hit_rate=hit / total if total else 0.0,
            hit_rate_unbounded=unbounded_hit_rate(records),
            fetches=0,
            bypassed=0,
            throughput_rps=float(served.sum()) / makespan,
            output_tokens_per_s=outputs / makespan,
            makespan_s=makespan,
            ttft_pred_error_mean_s=0.0,
            wall_s=wall_s,
            bad_lines=0,
            ttft_bound_mean_s=cache_bound_ttft_s(records, self.profile, config.block_size),
        )

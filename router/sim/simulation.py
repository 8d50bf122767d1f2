"""The discrete-event simulation: the real Conductor places trace requests on simulated
prefill and decode instances, events in time order from a heap."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from halfmoon.router.conductor import Conductor
from halfmoon.router.config import RouterConfig
from halfmoon.router.decision import Decision
from halfmoon.router.profile import Profile
from halfmoon.router.replication import Replication
from halfmoon.router.request import RouteRequest
from halfmoon.router.sim.cache_bound import cache_bound_ttft_s
from halfmoon.router.sim.decode_instance import Finished, SimDecode
from halfmoon.router.sim.prefill_instance import PrefillJob, SimPrefill
from halfmoon.router.sim.summary import SimSummary, percentile
from halfmoon.router.sim.trace import TraceRecord, unbounded_hit_rate

ARRIVE, PREFILL_DONE, DECODE_JOIN, DECODE_STEP, REPLICATE_DONE = range(5)
ENGINE_EVENTS = 10  # kinds from here on belong to the step-level simulation (step_simulation.py)


@dataclass(slots=True)
class _Outcome:
    arrival_s: float
    ttft_s: float = -1.0
    tbt_s: float = -1.0
    rejected: bool = False


@dataclass(slots=True, frozen=True)
class SimInstances:
    """The simulated instances: how many of each role, the KV blocks a prefill instance caches,
    the profile that times them, and the engine limits a step-level simulation keeps."""

    profile: Profile
    num_prefill: int
    num_decode: int
    cache_blocks: int
    max_batched_tokens: int = 2048
    max_num_seqs: int = 64


class Simulation:
    """One run of a trace through the Conductor on `num_prefill` + `num_decode` instances."""

    def __init__(
        self, config: RouterConfig, instances: SimInstances, router_profile: Profile | None = None
    ) -> None:
        """Instances are timed by their profile; the Conductor starts from `router_profile`
        (default the same) and refits online from the simulated step times, as a live router
        does."""
        profile = instances.profile
        self.config = config
        self.profile = profile
        self.cost = profile.cost
        self.conductor = Conductor(config, router_profile or profile)
        index = self.conductor.index
        self.prefill = {}
        for i in range(instances.num_prefill):
            self.prefill[f"p{i}"] = SimPrefill(f"p{i}", instances.cache_blocks, index)
            self.conductor.add_prefill(f"p{i}", tensor_parallel_size=profile.tensor_parallel_size)
        self.decode = {}
        for i in range(instances.num_decode):
            self.decode[f"d{i}"] = SimDecode(f"d{i}", profile.cost)
            self.conductor.add_decode(f"d{i}", tensor_parallel_size=profile.decode_degree)
        self._events: list[tuple[float, int, int, str, int]] = []
        self._decode_of: dict[str, str] = {}
        self._seq = 0
        self._records: dict[str, TraceRecord] = {}
        self._outcomes: dict[str, _Outcome] = {}
        self._hit_blocks = 0
        self._total_blocks = 0
        self._fetches = 0
        self._bypassed = 0

    def _push(self, when_s: float, kind: int, name: str, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when_s, self._seq, kind, name, version))

    def run(self, records: list[TraceRecord], progress: bool = True) -> SimSummary:
        """Simulate every record to completion and summarize."""
        started = time.perf_counter()
        for i, record in enumerate(records):
            rid = str(i)
            self._records[rid] = record
            self._push(record.arrival_s, ARRIVE, rid)
        bar = tqdm(total=len(records), unit="req", disable=not progress, mininterval=0.5)
        events = self._events
        while events:
            now, _, kind, name, version = heapq.heappop(events)
            if kind == ARRIVE:
                self._arrive(name, now)
                bar.update(1)
            elif kind == PREFILL_DONE:
                self._prefill_done(self.prefill[name], now)
            elif kind == DECODE_JOIN:
                self._decode_join(name, now)
            elif kind == REPLICATE_DONE:
                self._replicate_done(name, version)
            elif kind >= ENGINE_EVENTS:
                self._engine_event(kind, name, now)
            elif version == self.decode[name].version:
                self._decode_step(name, now)
        bar.close()
        summary = self._summary(records, time.perf_counter() - started)
        replicator = self.conductor.replicator
        summary.replications = replicator.num_completed if replicator is not None else 0
        return summary

    def latencies(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-request TTFT and TBT seconds in trace order after `run` (inf when rejected)."""
        outcomes = [self._outcomes[str(i)] for i in range(len(self._outcomes))]
        ttft = np.array([np.inf if o.rejected else o.ttft_s for o in outcomes])
        tbt = np.array([np.inf if o.rejected else max(o.tbt_s, 0.0) for o in outcomes])
        return ttft, tbt

    def _arrive(self, rid: str, now: float) -> None:
        record = self._records[rid]
        outcome = self._outcomes[rid] = _Outcome(now)
        request = RouteRequest(
            rid, record.hash_ids, record.num_prompt_tokens, record.num_output_tokens, now
        )
        decision = self.conductor.route(request, now)
        if decision.rejected:
            outcome.rejected = True
            return
        self._replicate(decision, now)
        self._decode_of[rid] = decision.decode_instance
        if decision.bypass:
            self._bypass(rid, now)
            return
        instance = self.prefill[decision.prefill_instance]
        keys = record.hash_ids
        local = instance.prefix_depth(keys)
        instance.lease(keys, local)
        source, source_blocks = None, 0
        if decision.fetch_from is not None:
            source = self.prefill[decision.fetch_from[0]]
            source_blocks = source.prefix_depth(keys)
            source.lease(keys, source_blocks)
        job = PrefillJob(rid, keys, record.num_prompt_tokens, source, source_blocks, local)
        instance.queue.append(job)
        if instance.running is None:
            self._start_prefill(instance, now)

    def _start_prefill(self, instance: SimPrefill, now: float) -> None:
        job = instance.queue.popleft()
        transfer_s = self._take_prefix(instance, job)
        job.work_s = self.cost.prefill_time(
            job.num_prompt_tokens - job.cached_tokens, job.cached_tokens
        )
        instance.running = job
        self._push(now + transfer_s + job.work_s, PREFILL_DONE, instance.name)

    def _take_prefix(self, instance: SimPrefill, job: PrefillJob) -> float:
        """Settle the cached prefix `job` starts from (its own, or fetched when deeper); sets
        `job.cached_tokens` and returns the fetch's transfer seconds."""
        keys, prompt, block = job.keys, job.num_prompt_tokens, self.config.block_size
        instance.release(keys, job.local_leased)
        local = instance.prefix_depth(keys)
        cached_blocks, fetch_tokens = local, 0
        local_tokens = min(local * block, prompt - 1)
        if job.source is not None:
            job.source.release(keys, job.source_blocks)
            if job.source_blocks > local:
                cached_blocks = job.source_blocks
                fetch_tokens = min(cached_blocks * block, prompt - 1) - local_tokens
                self._fetches += 1
        self._hit_blocks += cached_blocks
        self._total_blocks += len(keys)
        job.cached_tokens = min(cached_blocks * block, prompt - 1)
        return self.profile.transfer_time(fetch_tokens) if fetch_tokens > 0 else 0.0

    def _prefill_done(self, instance: SimPrefill, now: float) -> None:
        job = instance.running
        instance.running = None
        instance.store(job.keys)
        self.conductor.observe_prefill(job.num_prompt_tokens, job.cached_tokens, job.work_s)
        self._first_token(job.request_id, now, self._handoff_s(job.num_prompt_tokens))
        if instance.queue:
            self._start_prefill(instance, now)

    def _handoff_s(self, num_prompt_tokens: int) -> float:
        """What a disaggregated request pays between its prefill's end and its first token:
        its last layer's KV transfer to decode (the earlier layers streamed during the
        prefill) plus the profile's fixed `handoff_s` (the call's return, the relay)."""
        profile = self.profile
        layer_bytes = num_prompt_tokens * profile.kv_bytes_per_token / profile.num_layers
        tail_s = profile.transfer_latency_s + layer_bytes / profile.network_bytes_per_s
        return profile.handoff_s + tail_s

    def _first_token(self, rid: str, now: float, handoff_s: float | None) -> None:
        """The prefill of `rid` ended at `now`; it joins decode once its hand-off
        (`handoff_s`, None for a bypassed prompt: none) is paid, which the Conductor learns
        as the live router does."""
        if handoff_s is not None:
            self.conductor.observe_handoff(handoff_s)
        charged_s = handoff_s or 0.0
        if self._record_first_token(rid, now, charged_s):
            self._push(now + self.profile.request_overhead_s + charged_s, DECODE_JOIN, rid)

    def _record_first_token(self, rid: str, now: float, handoff_s: float) -> bool:
        """The prefill of `rid` ended at `now`: record its TTFT (with the per-request overhead
        and the hand-off charged) and tell the Conductor. False when it ends here."""
        outcome = self._outcomes[rid]
        outcome.ttft_s = now + self.profile.request_overhead_s + handoff_s - outcome.arrival_s
        self.conductor.on_prefill_done(rid, now)
        self.conductor.observe_ttft(rid, outcome.ttft_s)
        record = self._records[rid]
        if record.num_output_tokens <= 1:
            self.conductor.on_finish(rid, now, record.num_output_tokens)
            return False
        return True

    def _bypass(self, rid: str, now: float) -> None:
        self._bypassed += 1
        decode = self.decode[self._decode_of[rid]]
        self._finish(decode, decode.advance(now))
        prompt = self._records[rid].num_prompt_tokens
        self._total_blocks += len(self._records[rid].hash_ids)
        work_s = self.cost.prefill_time(prompt, 0)
        decode.stall(work_s)
        self.conductor.observe_prefill(prompt, 0, work_s)
        self._first_token(rid, decode.clock_s, None)

    def _decode_join(self, rid: str, now: float) -> None:
        record = self._records[rid]
        decode = self.decode[self._decode_of[rid]]
        self._finish(decode, decode.advance(now))
        joined_s = decode.join(rid, record.num_prompt_tokens + 1, record.num_output_tokens - 1)
        self.conductor.on_decode_join(rid, joined_s)
        self.conductor.report_decode(decode.name, decode.batch_size, decode.kv_tokens)
        self._schedule(decode)

    def _decode_step(self, name: str, now: float) -> None:
        decode = self.decode[name]
        self._finish(decode, decode.advance(now))
        self._schedule(decode)

    def _schedule(self, decode: SimDecode) -> None:
        decode.version += 1
        when = decode.next_finish_s()
        if when is not None:
            self._push(when, DECODE_STEP, decode.name, decode.version)

    def _finish(self, decode: SimDecode, done: list[Finished]) -> None:
        for item in done:
            self._outcomes[item.request_id].tbt_s = item.tbt_s
            record = self._records[item.request_id]
            self.conductor.on_finish(item.request_id, item.finish_s, record.num_output_tokens)
        if done:
            self.conductor.report_decode(decode.name, decode.batch_size, decode.kv_tokens)

    def _summary(self, records: list[TraceRecord], wall_s: float) -> SimSummary:
        outcomes = list(self._outcomes.values())
        served = [o for o in outcomes if not o.rejected]
        ttfts = sorted(o.ttft_s for o in served)
        tbts = sorted(o.tbt_s for o in served if o.tbt_s >= 0)
        ttft_slo = self.config.ttft_slo_s or float("inf")
        tbt_slo = self.config.tbt_slo_s or float("inf")
        met = sum(1 for o in served if o.ttft_s <= ttft_slo and o.tbt_s <= tbt_slo)
        first = min((r.arrival_s for r in records), default=0.0)
        last = max((o.arrival_s + o.ttft_s for o in served), default=first)
        last = max([last, *(d.clock_s for d in self.decode.values())])
        makespan = max(last - first, 1e-9)
        output_tokens = sum(
            self._records[rid].num_output_tokens
            for rid, o in self._outcomes.items()
            if not o.rejected
        )
        total = max(len(outcomes), 1)
        return SimSummary(
            policy=self.config.policy,
            admission=self.config.admission,
            requests=len(outcomes),
            served=len(served),
            rejected=len(outcomes) - len(served),
            ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
            ttft_p50_s=percentile(ttfts, 0.5),
            ttft_p90_s=percentile(ttfts, 0.9),
            ttft_p99_s=percentile(ttfts, 0.99),
            tbt_mean_s=sum(tbts) / len(tbts) if tbts else 0.0,
            tbt_p50_s=percentile(tbts, 0.5),
            tbt_p90_s=percentile(tbts, 0.9),
            tbt_p99_s=percentile(tbts, 0.99),
            slo_attainment=met / total,
            hit_rate=self._hit_blocks / self._total_blocks if self._total_blocks else 0.0,
            hit_rate_unbounded=unbounded_hit_rate(records),
            fetches=self._fetches,
            bypassed=self._bypassed,
            throughput_rps=len(served) / makespan,
            output_tokens_per_s=output_tokens / makespan,
            makespan_s=makespan,
            ttft_pred_error_mean_s=self.conductor.prediction_error().mean_abs_s,
            wall_s=wall_s,
            bad_lines=0,
            ttft_bound_mean_s=cache_bound_ttft_s(records, self.profile, self.config.block_size),
        )

    def _replicate(self, decision: Decision, now: float) -> None:
        """Start the decision's hot-prefix copies; the source's blocks stay leased until each
        lands, one transfer time later."""
        for copy in decision.replications:
            source = self.prefill[copy.source[0]]
            depth = source.prefix_depth(copy.keys)
            source.lease(copy.keys, depth)
            when_s = now + self.profile.transfer_time(copy.num_tokens)
            self._push(when_s, REPLICATE_DONE, copy, depth)

    def _replicate_done(self, copy: Replication, leased: int) -> None:
        self.prefill[copy.source[0]].release(copy.keys, leased)
        self.prefill[copy.target].store(copy.keys[:leased])
        self.conductor.on_replicated(copy)

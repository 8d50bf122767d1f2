"""The discrete-event simulation: the real Conductor places trace requests on simulated
prefill and decode instances, events in time order from a heap."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from halfmoon.router import events
from halfmoon.router.conductor import Conductor
from halfmoon.router.config import RouterConfig
from halfmoon.router.decision import Decision
from halfmoon.router.prefix_index import PrefixIndex
from halfmoon.router.profile import Profile
from halfmoon.router.replication import Replication
from halfmoon.router.reports import DecodeLoad, PrefillSample
from halfmoon.router.request import RouteRequest
from halfmoon.router.sim.decode_instance import Finished, SimDecode
from halfmoon.router.sim.prefill_instance import PrefillJob, SimPrefill
from halfmoon.router.sim.step_engine import SimEngine
from halfmoon.router.sim.summary import SimSummary
from halfmoon.router.sim.tally import Outcome, RunEnd, Tally, summarize
from halfmoon.router.sim.trace import TraceRecord

ARRIVE, PREFILL_DONE, DECODE_JOIN, DECODE_STEP, REPLICATE_DONE = range(5)
ENGINE_EVENTS = 10  # kinds from here on belong to the step-level simulation (step_simulation.py)


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
        self.index = PrefixIndex()  # the simulated prefill instances' caches write into it
        self.conductor = Conductor(config, router_profile or profile, self.index)
        self.prefill = {}
        for i in range(instances.num_prefill):
            self.prefill[f"p{i}"] = SimPrefill(f"p{i}", instances.cache_blocks, self.index)
            degree = profile.tensor_parallel_size
            self.conductor.add_instance(f"p{i}", "prefill", tensor_parallel_size=degree)
        self.decode = {}
        for i in range(instances.num_decode):
            self.decode[f"d{i}"] = SimDecode(f"d{i}", profile.cost)
            degree = profile.decode_degree
            self.conductor.add_instance(f"d{i}", "decode", tensor_parallel_size=degree)
        self._events: list[tuple[float, int, int, str, int]] = []
        self._decode_of: dict[str, str] = {}
        self._seq = 0
        self._records: dict[str, TraceRecord] = {}
        self.tally = Tally()

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
                self._replicate_done(name, version, now)
            elif kind >= ENGINE_EVENTS:
                self._engine_event(kind, name, now)
            elif version == self.decode[name].version:
                self._decode_step(name, now)
        bar.close()
        return self._summary(records, time.perf_counter() - started)

    def latencies(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-request TTFT and TBT seconds in trace order after `run` (inf when rejected)."""
        return self.tally.latencies()

    def _summary(self, records: list[TraceRecord], wall_s: float) -> SimSummary:
        view = self.conductor.view()
        last_s = max((d.clock_s for d in self.decode.values()), default=float("-inf"))
        error_s = view.prediction_error().mean_abs_s
        end = RunEnd(self.config, self.profile, last_s, error_s, wall_s)
        summary = summarize(self.tally, records, end)
        summary.replications = view.num_replications_completed
        return summary

    def _arrive(self, rid: str, now: float) -> None:
        record = self._records[rid]
        outcome = self.tally.outcomes[rid] = Outcome(now)
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
                self.tally.fetches += 1
        self.tally.hit_blocks += cached_blocks
        self.tally.total_blocks += len(keys)
        job.cached_tokens = min(cached_blocks * block, prompt - 1)
        return self.profile.transfer_time(fetch_tokens) if fetch_tokens > 0 else 0.0

    def _prefill_done(self, instance: SimPrefill, now: float) -> None:
        job = instance.running
        instance.running = None
        instance.store(job.keys)
        sample = PrefillSample(job.num_prompt_tokens, job.cached_tokens, job.work_s)
        self.conductor.observe(sample)
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
        (`handoff_s`, None for a bypassed prompt: none) is paid."""
        if self._record_first_token(rid, now, handoff_s):
            charged_s = handoff_s or 0.0
            self._push(now + self.profile.request_overhead_s + charged_s, DECODE_JOIN, rid)

    def _record_first_token(self, rid: str, now: float, handoff_s: float | None) -> bool:
        """The prefill of `rid` ended at `now`: record its TTFT (with the per-request overhead
        and the hand-off charged) and tell the Conductor, as the live router does. False when
        it ends here."""
        outcome = self.tally.outcomes[rid]
        first_s = now + self.profile.request_overhead_s + (handoff_s or 0.0)
        outcome.ttft_s = first_s - outcome.arrival_s
        self.conductor.on_event(events.PrefillDone(rid, now))
        self.conductor.on_event(events.FirstToken(rid, first_s, outcome.ttft_s, handoff_s))
        record = self._records[rid]
        if record.num_output_tokens <= 1:
            self.conductor.on_event(events.Finished(rid, now, record.num_output_tokens))
            return False
        return True

    def _bypass(self, rid: str, now: float) -> None:
        self.tally.bypassed += 1
        decode = self.decode[self._decode_of[rid]]
        self._finish(decode, decode.advance(now))
        prompt = self._records[rid].num_prompt_tokens
        self.tally.total_blocks += len(self._records[rid].hash_ids)
        work_s = self.cost.prefill_time(prompt, 0)
        decode.stall(work_s)
        self.conductor.observe(PrefillSample(prompt, 0, work_s))
        self._first_token(rid, decode.clock_s, None)

    def _decode_join(self, rid: str, now: float) -> None:
        record = self._records[rid]
        decode = self.decode[self._decode_of[rid]]
        self._finish(decode, decode.advance(now))
        joined_s = decode.join(rid, record.num_prompt_tokens + 1, record.num_output_tokens - 1)
        self.conductor.on_event(events.DecodeJoined(rid, joined_s))
        self._report_decode(decode)
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
            self.tally.outcomes[item.request_id].tbt_s = item.tbt_s
            output_tokens = self._records[item.request_id].num_output_tokens
            self.conductor.on_event(events.Finished(item.request_id, item.finish_s, output_tokens))
        if done:
            self._report_decode(decode)

    def _report_decode(self, decode: SimDecode | SimEngine) -> None:
        """The decode instance's running batch, as a live decode worker reports it."""
        self.conductor.observe(DecodeLoad(decode.name, decode.batch_size, decode.kv_tokens))

    def _replicate(self, decision: Decision, now: float) -> None:
        """Start the decision's hot-prefix copies; the source's blocks stay leased until each
        lands, one transfer time later."""
        for copy in decision.replications:
            source = self.prefill[copy.source[0]]
            depth = source.prefix_depth(copy.keys)
            source.lease(copy.keys, depth)
            when_s = now + self.profile.transfer_time(copy.num_tokens)
            self._push(when_s, REPLICATE_DONE, copy, depth)

    def _replicate_done(self, copy: Replication, leased: int, now: float) -> None:
        self.prefill[copy.source[0]].release(copy.keys, leased)
        self.prefill[copy.target].store(copy.keys[:leased])
        self.conductor.on_event(events.Replicated(copy, now))

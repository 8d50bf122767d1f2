"""The step-level simulation: every instance is a `SimEngine` run one engine step at a time,
as the live workers run (chunked prefill, several prompts per step, bypassed prefills beside
the decode batch). One event per step, so it suits replays of live-sized runs; the
request-level `Simulation` it extends suits whole traces on large clusters.
"""

from __future__ import annotations

from halfmoon.router import events
from halfmoon.router.config import RouterConfig
from halfmoon.router.profile import Profile
from halfmoon.router.reports import DecodeStepSample, PrefillStepSample
from halfmoon.router.sim.prefill_instance import PrefillJob, SimPrefill
from halfmoon.router.sim.simulation import ENGINE_EVENTS, SimInstances, Simulation
from halfmoon.router.sim.step_engine import SimEngine, StepJob, StepResult

STEP_END, READY = ENGINE_EVENTS, ENGINE_EVENTS + 1


class StepSimulation(Simulation):
    """`Simulation` with engines stepped like `LLMEngine` (`max_batched_tokens` per step,
    chunks of the profile's `chunk_tokens`) on every prefill and decode instance."""

    def __init__(
        self, config: RouterConfig, instances: SimInstances, router_profile: Profile | None = None
    ) -> None:
        super().__init__(config, instances, router_profile)
        cost = instances.profile.cost

        def engine(name: str) -> SimEngine:
            return SimEngine(name, cost, instances.max_batched_tokens, instances.max_num_seqs)

        self.engines = {name: engine(name) for name in [*self.prefill, *self.decode]}
        self.decode = {name: self.engines[name] for name in self.decode}
        self._jobs: dict[str, PrefillJob] = {}

    def _start_prefill(self, instance: SimPrefill, now: float) -> None:
        # The engine admits every queued prompt at once; its steps share the token budget.
        engine = self.engines[instance.name]
        while instance.queue:
            job = instance.queue.popleft()
            transfer_s = self._take_prefix(instance, job)
            self._jobs[job.request_id] = job
            engine.add_prefill(
                StepJob(job.request_id, job.num_prompt_tokens, job.cached_tokens, now + transfer_s)
            )
        self._kick(engine, now)

    def _bypass(self, rid: str, now: float) -> None:
        self.tally.bypassed += 1
        record = self._records[rid]
        self.tally.total_blocks += len(record.hash_ids)
        engine = self.engines[self._decode_of[rid]]
        steps = max(record.num_output_tokens - 1, 0)
        engine.add_prefill(StepJob(rid, record.num_prompt_tokens, 0, now, steps))
        self._kick(engine, now)

    def _decode_join(self, rid: str, now: float) -> None:
        record = self._records[rid]
        engine = self.engines[self._decode_of[rid]]
        engine.join(rid, record.num_prompt_tokens + 1, record.num_output_tokens - 1, now)
        self.conductor.on_event(events.DecodeJoined(rid, now))
        self._report_decode(engine)
        self._kick(engine, now)

    def _kick(self, engine: SimEngine, now: float) -> None:
        """Start the engine's next step if it is idle and has work ready."""
        if engine.step is not None:
            return
        plan = engine.start_step(now)
        if plan is not None:
            self._push(plan.end_s, STEP_END, engine.name)
        elif (ready_s := engine.next_ready_s()) is not None:
            self._push(ready_s, READY, engine.name)

    def _engine_event(self, kind: int, name: str, now: float) -> None:
        engine = self.engines[name]
        if kind == STEP_END:
            self._step_done(engine, engine.finish_step(), now)
        self._kick(engine, now)

    def _step_done(self, engine: SimEngine, result: StepResult, now: float) -> None:
        plan = result.plan
        if plan.chunks and not plan.decode_seqs:
            self.conductor.observe(PrefillStepSample(plan.chunks, plan.seconds))
        elif plan.decode_seqs and not plan.chunks:
            sample = DecodeStepSample(plan.decode_seqs, plan.decode_kv_tokens, plan.seconds)
            self.conductor.observe(sample)
        for job in result.prefilled:
            if engine.name in self.prefill:
                self._prefilled(self.prefill[engine.name], job, now)
            else:
                self._bypass_prefilled(engine, job, now)
        if result.finished or result.prefilled:
            self._finish(engine, result.finished)
            if engine.name in self.decode:
                self._report_decode(engine)

    def _prefilled(self, instance: SimPrefill, job: StepJob, now: float) -> None:
        prefill_job = self._jobs.pop(job.request_id)
        instance.store(prefill_job.keys)
        self._first_token(job.request_id, now, self._handoff_s(job.num_prompt_tokens))

    def _bypass_prefilled(self, engine: SimEngine, job: StepJob, now: float) -> None:
        # A bypassed prompt goes on decoding in the same engine, with no hand-off.
        rid = job.request_id
        if self._record_first_token(rid, now, None):
            engine.join(rid, job.num_prompt_tokens + 1, job.decode_steps, now)
            self.conductor.on_event(events.DecodeJoined(rid, now))


def make_simulation(
    config: RouterConfig, instances: SimInstances, router_profile: Profile | None = None
) -> Simulation:
    """A `StepSimulation` when the profile's engine prefills in chunks (as live workers do),
    else the request-level `Simulation`, which suits whole traces on large clusters."""
    if instances.profile.cost.chunk_tokens:
        return StepSimulation(config, instances, router_profile)
    return Simulation(config, instances, router_profile)

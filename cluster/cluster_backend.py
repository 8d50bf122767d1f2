"""The cluster's `Backend`: each request goes through the Conductor to a prefill and a decode
worker, and the decode worker's token stream is relayed back to the client."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from halfmoon.cluster.backend import (
    GenerateInput,
    ModelInfo,
    NoWorkerError,
    RejectedError,
    TokenDelta,
    Usage,
    delta_from_output,
)
from halfmoon.engine.errors import InvalidRequestError, OutOfPagesError, RequestNotFoundError
from halfmoon.engine.llm_engine import RequestOutput
from halfmoon.engine.tokenizer import tokenize_prompt
from halfmoon.engine.worker_info import WorkerInfo
from halfmoon.kvstore.keys import block_keys
from halfmoon.router.conductor import Conductor
from halfmoon.router.decision import Decision
from halfmoon.router.replication import Replication
from halfmoon.router.request import RouteRequest

log = logging.getLogger(__name__)
MAX_WAIT_FOR_ROOM_S = 120.0
ROOM_POLL_S = 0.05
# Prompts longer than this are tokenized in a thread, so a huge one never stalls the event
# loop that serves every other request (tokenizers release the GIL as they go).
INLINE_TOKENIZE_CHARS = 2048
TOKENIZE_THREADS = 4


@dataclass(slots=True)
class Worker:
    name: str
    kind: str
    handle: ray.actor.ActorHandle
    store_name: str | None = None
    draining: bool = False


@dataclass(slots=True)
class RequestTrace:
    """Timestamps of one request as the router saw them (monotonic seconds)."""

    arrived_s: float
    num_prompt_tokens: int = 0
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prefill_started_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_cached_tokens: int = 0
    num_loaded_tokens: int = 0
    num_output_tokens: int = 0
    predicted_ttft_s: float | None = None
    prefill_compute_s: float | None = None  # the prefill worker's first to last step
    # The prefill's first token and its logprobs, streamed before the decode worker's output.
    early_token: tuple | None = None
    outcome: str = "error"
    reason: str = ""


class ClusterBackend:
    """Routes with the Conductor (disaggregated) or least-loaded (colocated) and relays tokens."""

    def __init__(
        self,
        tokenizer,
        info: WorkerInfo,
        conductor: Conductor,
        mode: str,
        observer=None,
        model_name: str | None = None,
        max_queued_per_worker: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.model_name = model_name or info.model
        self.conductor = conductor
        self.mode = mode
        self.observer = observer
        self.workers: dict[str, Worker] = {}
        self.inflight: dict[str, Worker] = {}
        self.traces: dict[str, RequestTrace] = {}
        self.stores: dict[str, ray.actor.ActorHandle] = {}
        self.max_wait_for_room_s = MAX_WAIT_FOR_ROOM_S
        self.max_queued_per_worker = max_queued_per_worker
        self.copies: set[asyncio.Task] = set()
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self._thread_tokenizers = threading.local()

    def add_worker(self, worker: Worker) -> None:
        self.workers[worker.name] = worker
        if worker.kind == "prefill":
            self.conductor.add_prefill(worker.name)
        else:
            self.conductor.add_decode(worker.name, self.info.num_pages * self.info.block_size)

    def remove_worker(self, name: str) -> None:
        self.workers.pop(name, None)
        self.conductor.remove_instance(name)

    def set_draining(self, name: str, draining: bool) -> None:
        """A draining worker gets no new requests; the ones it has finish."""
        worker = self.workers[name]
        worker.draining = draining
        if draining:
            self.conductor.remove_instance(name)
        else:
            self.add_worker(worker)

    async def generate(self, request: GenerateInput) -> AsyncIterator[TokenDelta]:
        rid = request.request_id
        trace = self.traces[rid] = RequestTrace(time.monotonic())
        finished = False
        try:
            self._check_queue(rid)
            token_ids = await self._tokenize(request)
            trace.num_prompt_tokens = len(token_ids)
            stream = await self._start(request, token_ids, trace)
            early = trace.early_token
            if early is not None:  # the prefill's token goes out now, not after the hand-off
                trace.num_output_tokens = 1
                trace.first_token_s = trace.last_token_s = time.monotonic()
                self._observe_first_token(rid, trace)
                yield TokenDelta([early[0]], "", logprobs=[early[1]] if early[1] else [])
            async for ref in stream:
                out: RequestOutput = await ref
                new_ids = out.new_token_ids
                if early is not None and new_ids[:1] == [early[0]]:
                    new_ids, early = new_ids[1:], None  # streamed already
                trace.num_output_tokens += len(new_ids)
                finished = out.finished
                if trace.first_token_s is None and new_ids:
                    trace.first_token_s = time.monotonic()
                    self._observe_first_token(rid, trace)
                trace.last_token_s = time.monotonic()
                delta = self._delta(out, trace)
                delta.token_ids = new_ids
                yield delta
            trace.outcome = "finished" if finished else "error"
        except RayActorError as error:
            raise NoWorkerError(f"a worker serving request {rid} died: {error}") from error
        except (GeneratorExit, asyncio.CancelledError):
            trace.outcome = "cancelled"
            raise
        except InvalidRequestError:
            trace.outcome = "invalid"
            raise
        except RejectedError as error:
            trace.outcome, trace.reason = "rejected", _reason_kind(str(error))
            raise
        finally:
            if not finished:
                await self._abort_everywhere(rid, trace)
            self.conductor.on_finish(rid, time.monotonic(), trace.num_output_tokens)
            if self.observer is not None:
                self.observer(trace)
            self.traces.pop(rid, None)

    def _observe_first_token(self, rid: str, trace: RequestTrace) -> None:
        ttft_s = trace.first_token_s - trace.arrived_s
        self.conductor.observe_ttft(rid, ttft_s)
        if trace.prefill_compute_s is not None:  # disaggregated: what it paid beyond compute
            overhead_s = self.conductor.profile.request_overhead_s
            self.conductor.observe_handoff(ttft_s - trace.prefill_compute_s - overhead_s)

    def _check_queue(self, rid: str) -> None:
        """Reject at arrival once the requests waiting for a first token reach the bound."""
        if self.max_queued_per_worker is None:
            return
        kind = "prefill" if self.mode == "disaggregated" else "decode"
        num_workers = max(len(self._alive(kind)), 1)
        bound = self.max_queued_per_worker * num_workers
        waiting = sum(1 for trace in self.traces.values() if trace.first_token_s is None) - 1
        if waiting >= bound:
            raise RejectedError(
                f"request {rid} rejected: {waiting} requests already wait for a first token "
                f"(bound {self.max_queued_per_worker} per {kind} worker x {num_workers}, "
                "router.max_queued_per_worker); retry later or add workers"
            )

    async def _tokenize(self, request: GenerateInput) -> list[int]:
        if _prompt_chars(request.prompt) <= INLINE_TOKENIZE_CHARS:
            token_ids = tokenize_prompt(self.tokenizer, request.prompt, self.info.vocab_size)
        else:
            loop = asyncio.get_running_loop()
            token_ids = await loop.run_in_executor(
                self.tokenize_pool, self._tokenize_in_thread, request.prompt
            )
        if len(token_ids) >= self.info.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"<{len(token_ids)} tokens>",
                f"must be shorter than the context length of {self.info.max_model_len} tokens",
            )
        return token_ids

    def _tokenize_in_thread(self, prompt) -> list[int]:
        # Each thread its own copy: a fast tokenizer shared across threads can fail with
        # "Already borrowed" when one call changes its truncation settings.
        tokenizer = getattr(self._thread_tokenizers, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._thread_tokenizers.tokenizer = deepcopy(self.tokenizer)
        return tokenize_prompt(tokenizer, prompt, self.info.vocab_size)

    async def _start(self, request: GenerateInput, token_ids: list[int], trace: RequestTrace):
        rid, params = request.request_id, request.params
        if self.mode == "colocated":
            worker = self._least_loaded("decode")
            trace.decode_instance = worker.name
            trace.prefill_started_s = time.monotonic()
            return worker.handle.generate_colocated.options(num_returns="streaming").remote(
                rid, token_ids, params
            )
        keys = block_keys(self.info.root_key, token_ids, self.info.block_size)
        route = RouteRequest(
            rid, keys, len(token_ids), params.max_tokens, trace.arrived_s,
            ttft_slo_s=request.ttft_slo_s, tbt_slo_s=request.tbt_slo_s,
        )  # fmt: skip
        decision = await self._route_when_room(route, trace)
        trace.predicted_ttft_s = decision.predicted_ttft_s
        if decision.rejected:
            if not self._alive("prefill") or not self._alive("decode"):
                raise NoWorkerError(f"no worker can take request {rid}: {decision.reason}")
            raise RejectedError(f"request {rid} rejected: {decision.reason}")
        self._replicate(decision)
        decode = self.workers[decision.decode_instance]
        trace.decode_instance = decode.name
        if decision.bypass:
            return decode.handle.generate_colocated.options(num_returns="streaming").remote(
                rid, token_ids, params
            )
        prefill = self.workers[decision.prefill_instance]
        trace.prefill_instance = prefill.name
        try:
            await decode.handle.reserve.remote(rid, token_ids, params, prefill.store_name)
        except OutOfPagesError as error:
            raise NoWorkerError(f"decode worker {decode.name} has no room: {error}") from error
        self.inflight[rid] = prefill
        trace.prefill_started_s = time.monotonic()
        self.conductor.on_prefill_start(rid, trace.prefill_started_s)
        result = await prefill.handle.prefill.remote(rid, token_ids, params)
        del self.inflight[rid]
        now = time.monotonic()
        self.conductor.on_prefill_done(rid, now)
        cached = result.num_local_cached_tokens + result.num_loaded_tokens
        # The cost model is refined from the workers' engine steps (RouterActor polls them).
        trace.prefill_compute_s = result.finished_at - result.started_at
        trace.num_cached_tokens, trace.num_loaded_tokens = cached, result.num_loaded_tokens
        trace.early_token = (result.first_token_id, result.logprobs)
        self.conductor.on_decode_join(rid, now)
        return decode.handle.generate.options(num_returns="streaming").remote(
            rid, result.first_token_id
        )

    def _replicate(self, decision: Decision) -> None:
        """Start the decision's hot-prefix copies beside the request, never in its way."""
        for copy in decision.replications:
            task = asyncio.get_running_loop().create_task(self._copy(copy))
            self.copies.add(task)
            task.add_done_callback(self.copies.discard)

    async def _copy(self, copy: Replication) -> None:
        source = copy.source[0]
        holder = self.workers.get(source)
        store_name = holder.store_name if holder is not None else source
        try:
            target = self.workers.get(copy.target)
            if target is not None:
                await target.handle.warm.remote(list(copy.keys), store_name)
        except Exception:  # noqa: BLE001 - a failed copy costs hits, never a request
            log.exception("copying %d hot blocks to %s failed", len(copy.keys), copy.target)
        finally:
            self.conductor.on_replicated(copy)

    async def _route_when_room(self, route: RouteRequest, trace: RequestTrace):
        """Route; while no decode worker has room for the KV, wait for some (up to
        `max_wait_for_room_s`) instead of failing: that is queueing, not an SLO rejection."""
        deadline = trace.arrived_s + self.max_wait_for_room_s
        while True:
            decision = self.conductor.route(route, time.monotonic())
            no_room = decision.rejected and decision.decode_instance is None
            if not no_room or not self._alive("prefill") or time.monotonic() > deadline:
                return decision
            await asyncio.sleep(ROOM_POLL_S)

    def _delta(self, out: RequestOutput, trace: RequestTrace) -> TokenDelta:
        if out.finished and trace.prefill_instance is None:  # prefilled where it decoded
            trace.num_cached_tokens = out.num_cached_tokens
        usage = Usage(trace.num_prompt_tokens, trace.num_output_tokens, trace.num_cached_tokens)
        return delta_from_output(out, usage)

    async def _abort_everywhere(self, rid: str, trace: RequestTrace) -> None:
        for name in (trace.prefill_instance, trace.decode_instance):
            worker = self.workers.get(name) if name else None
            if worker is None:
                continue
            try:
                await worker.handle.abort.remote(rid)
            except RayActorError:
                log.warning("could not abort %s on %s: the worker is gone", rid, name)
        self.inflight.pop(rid, None)

    async def abort(self, request_id: str) -> bool:
        trace = self.traces.get(request_id)
        if trace is None:
            return False
        await self._abort_everywhere(request_id, trace)
        return True

    async def explain(self, request_id: str) -> str:
        try:
            return self.conductor.explain(request_id)
        except KeyError as error:
            raise RequestNotFoundError(request_id) from error

    async def model_info(self) -> ModelInfo:
        info = self.info
        return ModelInfo(
            self.model_name, info.architecture, info.vocab_size, info.max_model_len, info.block_size
        )

    async def server_info(self) -> dict:
        loads = {}
        for worker in self.workers.values():
            try:
                load = await worker.handle.load.remote()
                loads[worker.name] = {
                    "kind": worker.kind,
                    "draining": worker.draining,
                    "running": load.num_running,
                    "waiting": load.num_waiting,
                    "pages_used_ratio": round(load.pages_used_ratio, 4),
                }
            except RayActorError:
                loads[worker.name] = {"kind": worker.kind, "dead": True}
        stores = {}
        for name, store in self.stores.items():
            try:
                stats = await store.stats.remote()
                stores[name] = {
                    tier: dataclasses.asdict(getattr(stats, tier)) for tier in ("host", "redis")
                }
            except RayActorError:
                stores[name] = {"dead": True}
        error = dataclasses.asdict(self.conductor.prediction_error())
        return {
            "mode": self.mode,
            "model": self.model_name,
            "model_path": self.info.model,
            "workers": loads,
            "stores": stores,
            "policy": self.conductor.config.policy,
            "in_flight": len(self.traces),
            "ttft_prediction_error": error,
        }

    def _alive(self, kind: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.kind == kind and not w.draining]

    def _least_loaded(self, kind: str) -> Worker:
        workers = self._alive(kind)
        if not workers:
            raise NoWorkerError(f"no {kind} worker is alive; check `halfmoon status`")
        busy = {w.name: 0 for w in workers}
        for trace in self.traces.values():
            if trace.decode_instance in busy:
                busy[trace.decode_instance] += 1
        return min(workers, key=lambda w: busy[w.name])


def _prompt_chars(prompt) -> int:
    """About how much tokenizing a prompt costs: characters of text, or list entries."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(
        len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else 1
        for m in prompt
    )


def _reason_kind(message: str) -> str:
    """A short label for a rejection (the metric's `reason`), from the Conductor's message."""
    lowered = message.lower()
    for kind in ("ttft", "tbt"):
        if kind in lowered:
            return kind
    return "capacity"

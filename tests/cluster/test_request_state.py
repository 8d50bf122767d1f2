"""The router side's one record per request: its phase follows the request's life, and its
state changes are the only writers of its trace (telemetry, never read back as control)."""

from __future__ import annotations

import time

from halfmoon.cluster.serving.request import Request
from halfmoon.cluster.serving.trace import RequestTrace
from halfmoon.cluster.serving.workers import Worker
from halfmoon.engine.outputs import RequestOutput
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.prefill_worker.task import PrefillResult
from halfmoon.router.decision import Decision

PARAMS = SamplingParams(max_tokens=4)


def _request() -> Request:
    request = Request("r", PARAMS, RequestTrace(time.monotonic()))
    request.prompt([5, 6, 7])
    return request


def _worker(name: str, kind: str) -> Worker:
    return Worker(name, kind, None, None, f"store-of-{name}")


def _result(first_tokens) -> PrefillResult:
    now = time.time()
    return PrefillResult("r", first_tokens, 3, 0, 0, None, now, now, now, now, now)


def _output(token_ids, finished=False, reason=None) -> RequestOutput:
    return RequestOutput("r", token_ids, "", finished, reason, 3, 0)


def test_a_disaggregated_request_goes_through_every_phase_once():
    request = _request()
    phases = [request.phase]
    request.routed(Decision("r", "conductor"))
    phases.append(request.phase)
    request.sent(_worker("prefill-0", "prefill"), _worker("decode-0", "decode"))
    phases.append(request.phase)
    request.prefilled(_result([(9, None)]), time.monotonic())
    phases.append(request.phase)
    assert request.emitted([9], time.monotonic()) is True
    request.relayed(_output([10]), [10], time.monotonic())
    phases.append(request.phase)
    request.released()
    phases.append(request.phase)
    assert phases == ["queued", "routed", "prefilling", "handed_off", "decoding", "done"]
    assert request.first_tokens == [(9, None)] and request.output_ids == [9, 10]
    assert request.trace.prefill_instance == "prefill-0" and not request.prefills_where_it_decodes


def test_a_retry_keeps_the_first_tokens_out_and_a_migration_drops_them():
    request = _request()
    request.sent(_worker("prefill-0", "prefill"), _worker("decode-0", "decode"))
    request.prefilled(_result([(9, None)]), time.monotonic())
    request.retry()
    assert request.phase == "retrying" and request.trace.prefill_instance is None
    request.prefilled(_result([(8, None)]), time.monotonic())
    assert request.first_tokens == [(9, None)]  # the next decode worker continues from it
    request.emitted([9], time.monotonic())
    request.migrate()
    assert request.phase == "migrating" and request.first_tokens is None
    assert request.token_ids == [5, 6, 7, 9] and request.num_migrations == 1


def test_colocated_the_worker_that_decodes_prefills_and_its_cache_use_is_its_own():
    request = _request()
    request.sent(None, _worker("decode-0", "decode"))
    request.started(time.monotonic())
    assert request.prefills_where_it_decodes
    out = RequestOutput("r", [4], "", True, "length", 3, 2)
    assert request.relayed(out, [4], time.monotonic()) is True
    assert request.attempt.ended and request.trace.outcome == "finished"
    assert request.trace.num_cached_tokens == 2
    assert [stage for stage, _ in request.trace.timeline] == [
        "sent to the worker",
        "first token out",
    ]

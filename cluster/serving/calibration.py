"""The per-request overhead outside prefill compute, measured once at start-up by sending short
requests through the whole pipeline; it goes into the Conductor's profile."""

from __future__ import annotations

import random
import statistics
from typing import TYPE_CHECKING

from halfmoon.cluster.serving.backend import GenerateInput
from halfmoon.cluster.serving.trace import RequestTrace
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.router.reports import RequestOverhead

if TYPE_CHECKING:
    from halfmoon.cluster.serving.cluster_backend import ClusterBackend


async def calibrate(backend: ClusterBackend, num_requests: int, num_tokens: int) -> float:
    """Send `num_requests` prompts of `num_tokens` (not client traffic: no metrics); returns
    the median overhead, which the Conductor now prices every request with."""
    rng = random.Random(0)
    overheads = []
    traces: list[RequestTrace] = []
    observer = backend.set_observer(traces.append)
    try:
        for i in range(num_requests):
            prompt = [rng.randrange(6, backend.info.vocab_size) for _ in range(num_tokens)]
            request = GenerateInput(f"calibrate-{i}", prompt, SamplingParams(max_tokens=1))
            async for _ in backend.generate(request):
                pass
            overheads.append(_overhead_s(backend, traces[-1], num_tokens))
    finally:
        backend.set_observer(observer)
    overhead_s = max(0.0, statistics.median(overheads))
    backend.conductor.observe(RequestOverhead(overhead_s))
    return overhead_s


def _overhead_s(backend: ClusterBackend, trace: RequestTrace, num_tokens: int) -> float:
    """What an idle pipeline adds to a request besides its prefill and its hand-off."""
    compute_s = trace.prefill_compute_s
    if compute_s is None:  # prefilled on the decode worker: no split, use the model
        compute_s = backend.conductor.view().prefill_time_s(num_tokens)
    handoff_s = trace.handoff_s or 0.0
    return trace.first_token_s - trace.arrived_s - compute_s - handoff_s

"""What the router records of each ended request: its outcome, tokens, latencies and SLO in the
Prometheus metrics, and its sizes in the recent traffic the pool signals average."""

from __future__ import annotations

from collections import deque

from halfmoon.cluster.serving.trace import RequestTrace

MAX_TRAFFIC_WINDOW_S = 3600.0  # the longest window a policy may ask for


class RequestMetrics:
    """Fed one trace per ended request; answers the traffic of a recent window."""

    def __init__(self, metrics, ttft_slo_s: float | None) -> None:
        self.metrics = metrics
        self.ttft_slo_s = ttft_slo_s
        # (time, in, out, cached) of the requests finished in the longest window, at most 1M.
        self.finished: deque[tuple[float, int, int, int]] = deque(maxlen=1 << 20)

    def observe(self, trace: RequestTrace, now: float) -> None:
        """Record one ended request in the metrics."""
        if trace.outcome == "finished":
            self.finished.append(
                (now, trace.num_prompt_tokens, trace.num_output_tokens, trace.num_cached_tokens)
            )
        self.metrics.record_outcome(trace.outcome, trace.reason)
        self._tokens(trace)
        if trace.prefill_started_s is not None:
            self.metrics.queue_seconds.observe(trace.prefill_started_s - trace.arrived_s)
        if trace.first_token_s is not None:
            self._latency(trace, now)

    def traffic(self, window_s: float, now: float) -> dict[str, float]:
        """Request rate and mean prompt, output and cached tokens of the last `window_s`
        seconds (at most MAX_TRAFFIC_WINDOW_S)."""
        window_s = min(max(window_s, 1e-3), MAX_TRAFFIC_WINDOW_S)
        while self.finished and self.finished[0][0] < now - MAX_TRAFFIC_WINDOW_S:
            self.finished.popleft()
        recent = [f for f in self.finished if f[0] >= now - window_s]
        n = len(recent)
        return {
            "request_rate_per_s": n / window_s,
            "mean_input_tokens": sum(f[1] for f in recent) / n if n else 0.0,
            "mean_output_tokens": sum(f[2] for f in recent) / n if n else 0.0,
            "mean_cached_tokens": sum(f[3] for f in recent) / n if n else 0.0,
        }

    def _tokens(self, trace: RequestTrace) -> None:
        """Its prompt, generated and cached tokens, and where its cached prefix came from."""
        metrics = self.metrics
        metrics.prompt_tokens.inc(trace.num_prompt_tokens)
        metrics.generated_tokens.inc(trace.num_output_tokens)
        metrics.cached_tokens.inc(trace.num_cached_tokens)
        if not trace.num_prompt_tokens:
            return
        local = trace.num_cached_tokens - trace.num_loaded_tokens
        metrics.record_prefix_lookup("device", trace.num_prompt_tokens, local)
        if trace.prefill_instance is not None:
            store_queried = trace.num_prompt_tokens - local
            metrics.record_prefix_lookup("store", store_queried, trace.num_loaded_tokens)

    def _latency(self, trace: RequestTrace, now: float) -> None:
        """Its TTFT (beside the prediction), inter-token gap, end-to-end time and SLO."""
        metrics = self.metrics
        ttft_s = trace.first_token_s - trace.arrived_s
        metrics.ttft_seconds.observe(ttft_s)
        if trace.predicted_ttft_s is not None:
            metrics.record_ttft_prediction(trace.predicted_ttft_s, ttft_s)
        if trace.num_output_tokens > 1:
            gap_s = (trace.last_token_s - trace.first_token_s) / (trace.num_output_tokens - 1)
            metrics.inter_token_seconds.observe(gap_s)
        if trace.outcome == "finished":
            metrics.e2e_seconds.observe(now - trace.arrived_s)
        if self.ttft_slo_s is not None:
            metrics.record_slo("ttft", ttft_s <= self.ttft_slo_s)

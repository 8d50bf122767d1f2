"""What the Conductor learns from measurements: its own copy of the profile, refit online from
measured steps, with the calibrated overhead and the recent hand-offs; the mean output length
of finished requests; and how far its TTFT predictions fell from the observed ones."""

from __future__ import annotations

import dataclasses

from halfmoon.router.config import RouterConfig
from halfmoon.router.cost_model import step_sample
from halfmoon.router.degree import measures_side
from halfmoon.router.events import FirstToken
from halfmoon.router.online_fit import OnlineRefit, RecentMean
from halfmoon.router.prediction_error import PredictionErrorLog
from halfmoon.router.predictor import Predictor
from halfmoon.router.profile import Profile
from halfmoon.router.reports import (
    DecodeStepSample,
    EngineStep,
    PrefillSample,
    PrefillStepSample,
    RequestOverhead,
    Sample,
)

HANDOFF_WINDOW = 256  # recent disaggregated requests whose hand-off time `handoff_s` averages


class Estimates:
    """The profile as it stands, the predictor over it, the mean output length and the TTFT
    prediction errors; fed by samples (`observe`), first tokens and finished requests."""

    def __init__(self, config: RouterConfig, profile: Profile) -> None:
        # The router refits its own copy, so the profile it was given stays as loaded.
        cost = dataclasses.replace(profile.cost)
        self.profile = dataclasses.replace(profile, cost=cost)
        self.predictor = Predictor(self.profile, config.block_size, config.fetch_margin_s)
        self.errors = PredictionErrorLog()
        self._refit = OnlineRefit(cost)
        self._default_output_tokens = config.default_output_tokens
        self._output_tokens_sum = 0
        self._output_tokens_count = 0
        self._handoffs = RecentMean(HANDOFF_WINDOW)

    @property
    def mean_output_tokens(self) -> int:
        """Mean output length of finished requests (the configured default before any)."""
        if self._output_tokens_count == 0:
            return self._default_output_tokens
        return max(self._output_tokens_sum // self._output_tokens_count, 1)

    def finished(self, output_tokens: int) -> None:
        """A request finished after `output_tokens`."""
        self._output_tokens_sum += output_tokens
        self._output_tokens_count += 1

    def first_token(self, event: FirstToken, predicted_ttft_s: float | None) -> None:
        """A request's first token: its TTFT next to the prediction (None: not routed here or
        released), and (disaggregated) its hand-off, which the profile's `handoff_s` follows as
        the mean of the recent ones (the queue before it is predicted apart)."""
        if predicted_ttft_s is not None:
            self.errors.record(predicted_ttft_s, event.ttft_s)
        if event.handoff_s is not None:
            self.profile.handoff_s = max(self._handoffs.add(max(event.handoff_s, 0.0)), 0.0)

    def observe(self, sample: Sample) -> None:
        """A measured timing for the refit, or the calibrated per-request overhead."""
        match sample:
            case PrefillSample(num_prompt_tokens, cached_tokens, seconds):
                self._refit.observe_prefill(
                    num_prompt_tokens - cached_tokens, cached_tokens, seconds
                )
            case PrefillStepSample(chunks, seconds):
                self._refit.observe_prefill_step(chunks, seconds)
            case DecodeStepSample(batch_size, kv_tokens, seconds):
                self._refit.observe_decode_step(batch_size, kv_tokens, seconds)
            case EngineStep():
                self._observe_step(sample)
            case RequestOverhead(seconds):
                self.profile.request_overhead_s = max(seconds, 0.0)
            case _:
                raise TypeError(f"not a Conductor report: {sample!r}; see router/reports.py")

    def _observe_step(self, report: EngineStep) -> None:
        """Pure prefill and pure decode steps refine the cost model; mixed steps (a bypassed
        prefill beside decodes) and steps of a worker at another degree than the profile's
        side of that step are skipped."""
        sample = step_sample(report.step)
        if sample is None or not measures_side(
            self.profile, sample[0], report.tensor_parallel_size
        ):
            return
        kind, shape, step_s = sample
        if kind == "prefill":
            self._refit.observe_prefill_step(shape, step_s)
        else:
            self._refit.observe_decode_step(*shape, step_s)

"""Short-prompt bypass: prefill a mostly cached or short prompt on the decode instance itself."""

from __future__ import annotations

from halfmoon.router.decision import Candidate
from halfmoon.router.placement import Placement, PlacementContext


def bypass_placement(
    ctx: PlacementContext, placement: Placement, max_tokens: int, max_stall_s: float
) -> Placement | None:
    """A placement on a decode instance that beats `placement`'s TTFT, or None.

    Qualifies when at most `max_tokens` are uncached there and the decode step that carries
    the prefill stays under `max_stall_s`.
    """
    prompt = ctx.request.num_prompt_tokens
    deepest = max((ctx.hits.local_blocks.get(v.instance, 0) for v in ctx.decode), default=0)
    if prompt - ctx.predictor.cached_tokens(deepest, prompt) > max_tokens:
        return None
    best: Placement | None = None
    for view in ctx.decode:
        plan = ctx.predictor.local_plan(ctx.hits.local_blocks.get(view.instance, 0), prompt)
        if prompt - plan.cached_tokens > max_tokens:
            continue
        step_s = ctx.tbt(view, ctx.now)
        if step_s + plan.work_s > max_stall_s:
            continue
        queue_s = max(view.bypass_until_s - ctx.now, 0.0) + step_s
        candidate = Placement(view.instance, queue_s, plan, view, step_s, [], bypass=True)
        # A bypassed prompt skips the hand-off to decode that the disaggregated path pays.
        disaggregated_s = placement.ttft_s + ctx.predictor.profile.handoff_s
        if candidate.ttft_s < disaggregated_s and (best is None or candidate.ttft_s < best.ttft_s):
            best = candidate
    if best is None:
        return None
    note = f"bypass: prefill on decode, stall {best.ttft_s:.4f}s"
    best.candidates = [
        *placement.candidates,
        Candidate(best.decode.instance, "bypass", best.ttft_s, note),
    ]
    return best

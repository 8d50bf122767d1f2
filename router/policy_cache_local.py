"""Cache-aware placement that counts only prefix hits in each instance's own cache."""

from __future__ import annotations

from halfmoon.router.decision import Candidate
from halfmoon.router.placement import Placement, PlacementContext
from halfmoon.router.policies_basic import decode_load


class CacheAwareLocalPolicy:
    """Minimum predicted TTFT (queue + prefill of what the instance does not hold locally)."""

    name = "cache_aware_local"

    def __init__(self, seed: int) -> None:
        pass

    def place(self, ctx: PlacementContext) -> Placement:
        """Score every prefill instance by local-hit TTFT; least loaded decode."""
        now, local, prompt = ctx.now, ctx.hits.local_blocks, ctx.request.num_prompt_tokens
        plans = {}
        candidates = []
        best = None
        for view in ctx.prefill:
            depth, near = local.get(view.instance, 0), ctx.hits.near_blocks.get(view.instance, 0)
            plan = plans.get((depth, near))
            if plan is None:
                plan = plans[(depth, near)] = ctx.predictor.local_plan(depth, prompt, near)
            queue_s = view.delay_s(now, plan.work_s)
            ttft_s = queue_s + plan.work_s
            candidates.append(Candidate(view.instance, "prefill", ttft_s, f"{depth} local blocks"))
            if best is None or ttft_s < best[0]:
                best = (ttft_s, view.instance, queue_s, plan)
        decode = min(ctx.decode, key=decode_load)
        tbt_s = ctx.tbt(decode, now + best[0])
        candidates.append(Candidate(decode.instance, "decode", tbt_s, "least loaded"))
        return Placement(best[1], best[2], best[3], decode, tbt_s, candidates)

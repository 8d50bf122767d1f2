"""The Conductor policy: global cache-aware TTFT prediction and TBT-aware decode choice."""

from __future__ import annotations

from halfmoon.router.decision import Candidate
from halfmoon.router.placement import Placement, PlacementContext
from halfmoon.router.predictor import PrefillPlan


class ConductorPolicy:
    """Minimum predicted TTFT over instances, fetching remote prefixes when that pays;
    minimum predicted TBT over decode instances."""

    name = "conductor"

    def __init__(self, seed: int) -> None:
        pass

    def place(self, ctx: PlacementContext) -> Placement:
        """Score every prefill instance with its best plan, then every decode instance."""
        now, hits, prompt = ctx.now, ctx.hits, ctx.request.num_prompt_tokens
        local, best_plan = hits.local_blocks, ctx.predictor.best_plan
        # Most instances share a (local depth, remote copy) pair, so plans are memoized.
        plans: dict[tuple, tuple[PrefillPlan, str]] = {}
        candidates = []
        best_ttft, best = float("inf"), None
        for view in ctx.prefill:
            instance = view.instance
            depth, near = local.get(instance, 0), hits.near_blocks.get(instance, 0)
            remote = hits.remote_for(instance)
            memo = plans.get((depth, near, remote))
            if memo is None:
                plan = best_plan(depth, remote, prompt, near)
                note = f"{depth} local blocks" + (f" ({near} in its node's store)" if near else "")
                if plan.fetch_from is not None:
                    note += f", fetch {plan.fetch_tokens} tokens from {plan.fetch_from}"
                memo = plans[(depth, near, remote)] = (plan, note)
            queue_s = view.delay_s(now, memo[0].work_s)
            ttft_s = queue_s + memo[0].work_s
            candidates.append(Candidate(instance, "prefill", ttft_s, memo[1]))
            if ttft_s < best_ttft:
                best_ttft, best = ttft_s, (instance, queue_s, memo[0])
        done_s = now + best_ttft
        decode, tbt_s = None, float("inf")
        tbt = ctx.tbt
        for view in ctx.decode:
            predicted = tbt(view, done_s)
            candidates.append(Candidate(view.instance, "decode", predicted, "TBT after admission"))
            if predicted < tbt_s:
                decode, tbt_s = view, predicted
        return Placement(best[0], best[1], best[2], decode, tbt_s, candidates)

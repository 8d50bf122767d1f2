"""What a cluster backend tells about itself and its requests (read-only): the model, the
server's state, the Conductor's profile, and a recent request's timeline, decision and
summary. `ClusterBackend` is built on it."""

from __future__ import annotations

import contextlib

from halfmoon.cluster.serving.backend import ModelInfo
from halfmoon.cluster.serving.registry import RequestRegistry
from halfmoon.cluster.serving.workers import WorkerPool
from halfmoon.cluster.worker.info import WorkerInfo
from halfmoon.engine.errors import RequestNotFoundError
from halfmoon.router.conductor import Conductor
from halfmoon.router.profile import Profile

KEPT = "in flight or among the recently finished ones"  # what the registry keeps


class BackendViews:
    """The read-only calls of `ClusterBackend`, over its registry, pool and Conductor."""

    info: WorkerInfo
    model_name: str
    conductor: Conductor
    pool: WorkerPool
    requests: RequestRegistry

    def timeline(self, request_id: str) -> list[tuple[str, float]]:
        """(stage, seconds since arrival) of a request in flight or recently finished."""
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(request_id, KEPT)
        return sorted(req.trace.timeline, key=lambda item: item[1])

    def summaries(self, request_ids: list[str]) -> list[dict]:
        """`RequestTrace.summary` of each request still kept (in flight or among the last
        finished); unknown ids are left out."""
        found = ((rid, self.requests.get(rid)) for rid in request_ids)
        return [req.trace.summary(rid) for rid, req in found if req is not None]

    async def explain(self, request_id: str) -> str:
        """The Conductor's decision (disaggregated) and the request's timeline, if still kept."""
        parts = []
        with contextlib.suppress(KeyError):
            parts.append(self.conductor.explain(request_id))
        req = self.requests.get(request_id)
        if req is not None:
            parts.append(req.trace.explain_timeline())
        if not parts:
            raise RequestNotFoundError(request_id, KEPT)
        return "\n".join(parts)

    def profile(self) -> Profile:
        """The Conductor's profile as it stands (measured, calibrated, refit online)."""
        return self.conductor.view().profile

    async def model_info(self) -> ModelInfo:
        info = self.info
        return ModelInfo(
            self.model_name, info.architecture, info.vocab_size, info.max_model_len, info.block_size
        )

    async def server_info(self) -> dict:
        snapshot = self.conductor.snapshot()
        return {
            "mode": self.pool.mode,
            "model": self.model_name,
            "model_path": self.info.model,
            "workers": await self.pool.loads_info(),
            "stores": await self.pool.stores_info(),
            "policy": snapshot["policy"],
            "in_flight": self.requests.num_in_flight(),
            "health": dict(zip(("ok", "reason"), await self.health(), strict=True)),
            "ttft_prediction_error": snapshot["ttft_prediction_error"],
            # What a simulator needs to mirror this cluster (`halfmoon bench live-capacity`):
            # the router's settings and its profile as it stands (measured, refit online).
            "router": snapshot["router"],
            "profile": snapshot["profile"],
        }

    async def health(self) -> tuple[bool, str]:
        return self.pool.health()

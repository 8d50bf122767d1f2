"""The router's one map of requests by id: those in flight and the last few finished."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from halfmoon.cluster.serving.backend import DuplicateRequestError, RejectedError
from halfmoon.cluster.serving.request import Request

RECENT_FINISHED = 1024  # finished requests whose timeline `explain` can still show


class RequestRegistry:
    """Requests by id in arrival order; a finished one stays until RECENT_FINISHED newer
    ones have finished."""

    def __init__(self, keep_finished: int = RECENT_FINISHED) -> None:
        self.keep_finished = keep_finished
        self._by_id: OrderedDict[str, Request] = OrderedDict()
        self._num_finished = 0

    def add(self, request: Request) -> None:
        """Register a new request; refused while one with its id is in flight."""
        rid = request.request_id
        old = self._by_id.get(rid)
        if old is not None and not old.finished:
            raise DuplicateRequestError(
                f"request_id={rid!r} is already in flight; pick another id, or send none "
                "to get a server-assigned one"
            )
        if old is not None:
            del self._by_id[rid]
            self._num_finished -= 1
        self._by_id[rid] = request

    def get(self, request_id: str) -> Request | None:
        """The request in flight or among the last finished."""
        return self._by_id.get(request_id)

    def in_flight(self) -> Iterator[Request]:
        return (r for r in self._by_id.values() if not r.finished)

    def num_in_flight(self) -> int:
        return len(self._by_id) - self._num_finished

    def finish(self, request: Request) -> None:
        """The request was released: keep it for `explain` among the last finished."""
        request.finished = True
        self._num_finished += 1
        self._by_id.move_to_end(request.request_id)
        while self._num_finished > self.keep_finished:
            rid, oldest = next(iter(self._by_id.items()))
            if oldest.finished:
                del self._by_id[rid]
                self._num_finished -= 1
            else:  # in flight: it moves back again once it finishes
                self._by_id.move_to_end(rid)

    def on_worker(self, name: str) -> int:
        """Requests in flight that worker `name` has a part in."""
        return sum(1 for r in self.in_flight() if name in (w.name for w in r.attempt.workers()))


def check_queue(
    registry: RequestRegistry, rid: str, per_worker: int, kind: str, num_workers: int
) -> None:
    """Reject `rid` at arrival when `per_worker` requests per `kind` worker already wait for
    their first token (`router.max_queued_per_worker`: Mooncake's early rejection at the door)."""
    waiting = sum(1 for r in registry.in_flight() if not r.output_ids) - 1
    if waiting >= per_worker * num_workers:
        raise RejectedError(
            f"request {rid} rejected: {waiting} requests already wait for a first token "
            f"(bound {per_worker} per {kind} worker x {num_workers}, "
            "router.max_queued_per_worker); retry later or add workers"
        )

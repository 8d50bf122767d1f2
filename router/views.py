"""The router's picture of each instance, fed by worker reports (live) or simulated instances."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillView:
    """A prefill instance's outstanding work: every request sent there until it reports its
    prefill finished, as the time the instance would be done with all of it.

    The engine works through its requests first come, first served (chunked prefill shares
    each step's token budget, earliest first), so a request sent now waits for all the work
    sent before it. Each request keeps its place in that line (the seconds of work sent up to
    and including it); when it finishes, the work sent after it is still to do, from then
    (reconciliation: a misprediction never carries over)."""

    instance: str
    num_queued: int = 0  # requests sent here whose prefill has not finished
    queued_tokens: int = 0  # their uncached prompt tokens
    busy_until_s: float = 0.0
    node: str | None = None  # the store node whose host tier is local to it (None: none)
    sent_s: float = 0.0  # seconds of work ever sent here: each request's place ends on it
    # (place, seconds) of requests dropped unfinished, while later ones are still in line.
    dropped: list[tuple[float, float]] = field(default_factory=list)

    def wait_s(self, now: float) -> float:
        """Predicted seconds before a request sent now would start prefilling."""
        left = self.busy_until_s - now
        return left if left > 0.0 else 0.0

    def enqueue(self, work_s: float, num_tokens: int, now: float = 0.0) -> float:
        """Count a request the router just sent here; returns its place in line."""
        self.num_queued += 1
        self.queued_tokens += num_tokens
        self.busy_until_s = max(self.busy_until_s, now) + work_s
        self.sent_s += work_s
        return self.sent_s

    def finish(self, place_s: float, num_tokens: int, now: float) -> None:
        """The request at `place_s` finished at `now`: the work sent after it is still to
        do, from now."""
        self._forget(num_tokens)
        behind = self.sent_s - place_s - sum(w for p, w in self.dropped if p > place_s)
        self.dropped = [(p, w) for p, w in self.dropped if p > place_s]
        self.busy_until_s = now + (behind if behind > 0.0 else 0.0)

    def drop(self, place_s: float, work_s: float, num_tokens: int, now: float) -> None:
        """The request at `place_s` left unfinished (cancelled, or retried elsewhere)."""
        self._forget(num_tokens)
        self.busy_until_s = max(self.busy_until_s - work_s, now)
        if self.num_queued:
            self.dropped.append((place_s, work_s))

    def reconcile(self, num_requests: int, left_s: float, now: float) -> None:
        """The worker's own count of the requests it holds and the seconds of prompt it has
        still to compute: taken as the truth when it holds every request sent here (none on
        its way)."""
        if num_requests == self.num_queued:
            self.busy_until_s = now + (left_s if num_requests else 0.0)

    def _forget(self, num_tokens: int) -> None:
        self.num_queued = max(self.num_queued - 1, 0)
        self.queued_tokens = max(self.queued_tokens - num_tokens, 0)
        if not self.num_queued:
            self.dropped.clear()


@dataclass(slots=True, eq=False)
class Admitted:
    """A request the router placed on a decode instance: its KV, join time and expected length
    (kept in the Conductor's book with the request; the view holds the same object)."""

    num_tokens: int
    join_s: float
    output_tokens: int
    joined: bool = False


@dataclass(slots=True)
class DecodeView:
    """A decode instance's running batch, KV tokens, free KV capacity and admitted requests."""

    instance: str
    capacity_tokens: int
    batch_size: int = 0
    kv_tokens: int = 0
    reserved_tokens: int = 0
    bypass_until_s: float = 0.0
    num_pending: int = 0
    pending_tokens: int = 0
    admitted: set[Admitted] = field(default_factory=set)

    @property
    def free_kv_tokens(self) -> int:
        """KV capacity (in tokens of pages) not yet reserved by a placed request."""
        return self.capacity_tokens - self.reserved_tokens

    def admit(self, entry: Admitted, reserve_tokens: int) -> None:
        """Reserve pages for a request whose prefill is about to start elsewhere."""
        self.admitted.add(entry)
        self.reserved_tokens += reserve_tokens
        self.num_pending += 1
        self.pending_tokens += entry.num_tokens

    def join(self, entry: Admitted, now: float) -> None:
        """The request's KV landed and it joined the running batch at `now`."""
        if entry not in self.admitted or entry.joined:
            return
        entry.joined = True
        entry.join_s = now
        self.num_pending -= 1
        self.pending_tokens -= entry.num_tokens

    def leave(self, entry: Admitted, reserve_tokens: int) -> None:
        """The request finished or was cancelled; give back its pages."""
        if entry not in self.admitted:
            return
        self.admitted.discard(entry)
        self.reserved_tokens -= reserve_tokens
        if not entry.joined:
            self.num_pending -= 1
            self.pending_tokens -= entry.num_tokens

    def report(self, batch_size: int, kv_tokens: int) -> None:
        """The worker's own count of its running batch and the KV it holds."""
        self.batch_size = batch_size
        self.kv_tokens = kv_tokens

    def load_at(self, when_s: float, now: float, step_s: float) -> tuple[int, int]:
        """Predicted (batch size, KV tokens) at `when_s`: requests joined by then and not yet
        finished, each staying its expected output length at `step_s` per token."""
        batch = kv = 0
        for entry in self.admitted:
            if entry.join_s > when_s:
                continue
            leave_s = entry.join_s + entry.output_tokens * step_s
            # A running request already past its expected length is still running.
            if leave_s > when_s or (entry.joined and leave_s <= now):
                batch += 1
                kv += entry.num_tokens
        return batch, kv

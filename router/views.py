"""The router's picture of each instance, fed by worker reports (live) or simulated instances."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillView:
    """A prefill instance's queue: requests waiting, their predicted seconds and tokens."""

    instance: str
    num_queued: int = 0
    queued_work_s: float = 0.0
    queued_tokens: int = 0
    busy_until_s: float = 0.0

    def wait_s(self, now: float) -> float:
        """Predicted seconds before a request sent now would start prefilling."""
        running = self.busy_until_s - now
        return self.queued_work_s + (running if running > 0.0 else 0.0)

    def enqueue(self, work_s: float, num_tokens: int) -> None:
        """Count a request the router just sent here."""
        self.num_queued += 1
        self.queued_work_s += work_s
        self.queued_tokens += num_tokens

    def start(self, work_s: float, num_tokens: int, now: float) -> None:
        """A request of `work_s` left the queue and began prefilling at `now`."""
        self.drop(work_s, num_tokens)
        self.busy_until_s = now + work_s

    def drop(self, work_s: float, num_tokens: int) -> None:
        """A queued request left (began, was cancelled, or was retried elsewhere)."""
        self.num_queued = max(self.num_queued - 1, 0)
        self.queued_work_s = max(self.queued_work_s - work_s, 0.0)
        self.queued_tokens = max(self.queued_tokens - num_tokens, 0)

    def finish(self, now: float) -> None:
        """The running prefill completed at `now`."""
        self.busy_until_s = now


@dataclass(slots=True)
class Admitted:
    """A request the router placed on a decode instance: its KV, join time and expected length."""

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
    admitted: dict[str, Admitted] = field(default_factory=dict)

    @property
    def free_kv_tokens(self) -> int:
        """KV capacity (in tokens of pages) not yet reserved by a placed request."""
        return self.capacity_tokens - self.reserved_tokens

    def admit(self, request_id: str, entry: Admitted, reserve_tokens: int) -> None:
        """Reserve pages for a request whose prefill is about to start elsewhere."""
        self.admitted[request_id] = entry
        self.reserved_tokens += reserve_tokens
        self.num_pending += 1
        self.pending_tokens += entry.num_tokens

    def join(self, request_id: str, now: float) -> None:
        """The request's KV landed and it joined the running batch at `now`."""
        entry = self.admitted.get(request_id)
        if entry is None or entry.joined:
            return
        entry.joined = True
        entry.join_s = now
        self.num_pending -= 1
        self.pending_tokens -= entry.num_tokens

    def leave(self, request_id: str, reserve_tokens: int) -> None:
        """The request finished or was cancelled; give back its pages."""
        entry = self.admitted.pop(request_id, None)
        if entry is None:
            return
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
        for entry in self.admitted.values():
            if entry.join_s > when_s:
                continue
            leave_s = entry.join_s + entry.output_tokens * step_s
            # A running request already past its expected length is still running.
            if leave_s > when_s or (entry.joined and leave_s <= now):
                batch += 1
                kv += entry.num_tokens
        return batch, kv

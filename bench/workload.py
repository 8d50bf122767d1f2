"""Workloads for `bench serve` and `bench replay`: prompts as token ids, and their arrival times."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from halfmoon.router.sim.trace import TraceRecord, read_trace

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces (their README)
ARRIVALS = ("poisson", "constant", "trace")


class WorkloadError(ValueError):
    """A workload option that cannot produce requests; the message names the fix."""


@dataclass(slots=True)
class BenchRequest:
    """One request to send: its prompt, its output length and when to send it."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0


def prompt_vocabulary(tokenizer) -> list[int]:
    """Ids that decode to text which encodes back to the same one id, special tokens excluded,
    so a prompt of these ids sent as text keeps its length (exactly, for a byte tokenizer).
    Added tokens (chat roles and the like) are special too."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    ids = [token_id for token_id in range(len(tokenizer)) if token_id not in special]
    texts = tokenizer.batch_decode([[token_id] for token_id in ids])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    vocabulary = [
        token_id for token_id, back in zip(ids, encoded, strict=True) if back == [token_id]
    ]
    if not vocabulary:
        raise WorkloadError("the tokenizer has no id whose text round-trips; pass --tokenizer")
    return vocabulary


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocabulary: Sequence[int],
    seed: int,
    output_range_ratio: float | None = None,
) -> list[BenchRequest]:
    """Lengths uniform in [len * (1 - ratio), len * (1 + ratio)], token ids uniform, seeded;
    output lengths by `output_range_ratio` when given (else by `range_ratio` too)."""
    if output_range_ratio is None:
        output_range_ratio = range_ratio
    for flag, ratio in (("", range_ratio), ("-output", output_range_ratio)):
        if not 0.0 <= ratio < 1.0:
            raise WorkloadError(f"--random{flag}-range-ratio {ratio} must be in [0, 1)")
    rng = random.Random(seed)

    def length(mean: int, ratio: float) -> int:
        low = max(1, math.floor(mean * (1 - ratio)))
        return rng.randint(low, max(low, math.ceil(mean * (1 + ratio))))

    requests = []
    for _ in range(num_prompts):
        num_input = length(input_len, range_ratio)
        num_output = length(output_len, output_range_ratio)
        prompt = [rng.choice(vocabulary) for _ in range(num_input)]
        requests.append(BenchRequest(prompt, num_output))
    return requests


def scale_records(
    records: list[TraceRecord], block_tokens: int, time_scale: float
) -> list[TraceRecord]:
    """Trace blocks of 512 tokens become blocks of `block_tokens`; arrivals are divided by
    `time_scale` (the records arrive already in seconds)."""
    factor = block_tokens / TRACE_BLOCK_TOKENS
    start = records[0].arrival_s
    return [
        TraceRecord(
            r.line_number,
            (r.arrival_s - start) / time_scale,
            max(1, min(len(r.hash_ids) * block_tokens, round(r.num_prompt_tokens * factor))),
            max(1, round(r.num_output_tokens * factor)),
            r.hash_ids,
        )
        for r in records
    ]


def prompt_tokens(record: TraceRecord, block_tokens: int, vocabulary: Sequence[int]) -> list[int]:
    """Every hash id becomes a fixed block of token ids drawn from a generator seeded by it,
    so requests that share leading hash ids share a token prefix."""
    tokens: list[int] = []
    for hash_id in record.hash_ids:
        # Not Random(hash_id): the router calibrates with Random(0)'s ids, hash id 0's block.
        rng = random.Random(f"trace block {hash_id}")
        tokens += [rng.choice(vocabulary) for _ in range(block_tokens)]
    return tokens[: record.num_prompt_tokens]


def trace_requests(
    path: str, num_prompts: int, block_tokens: int, time_scale: float, vocabulary: Sequence[int]
) -> list[BenchRequest]:
    """The first `num_prompts` requests of a Mooncake trace, scaled, at their trace times."""
    records, _ = read_trace(path)
    if not records:
        raise WorkloadError(f"trace {path} has no valid request")
    records = scale_records(records[:num_prompts], block_tokens, time_scale)
    return [
        BenchRequest(prompt_tokens(r, block_tokens, vocabulary), r.num_output_tokens, r.arrival_s)
        for r in records
    ]


def arrival_times(
    num_prompts: int, arrival: str, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """Send times in seconds from the start: all at once for an infinite rate, evenly spaced
    (constant), or gamma-distributed gaps of mean 1/rate (poisson; burstiness 1 is Poisson,
    below 1 burstier, above 1 more regular), the first request at 0."""
    if request_rate <= 0 or burstiness <= 0:
        raise WorkloadError(
            f"--request-rate {request_rate} and --burstiness {burstiness} must be > 0"
        )
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    if arrival == "constant":
        return [i / request_rate for i in range(num_prompts)]
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_prompts):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return times


def rescale_to_rate(requests: list[BenchRequest], request_rate: float) -> None:
    """Stretch trace arrivals uniformly so their mean rate is `request_rate` (bursts kept)."""
    if math.isinf(request_rate):
        for request in requests:
            request.arrival_s = 0.0
        return
    span = requests[-1].arrival_s - requests[0].arrival_s
    if len(requests) < 2 or span <= 0:
        return
    factor = (len(requests) - 1) / request_rate / span
    for request in requests:
        request.arrival_s *= factor

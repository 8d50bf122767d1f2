"""A short start-up profile of an engine: timed prefills and decode steps, for the cost model."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.sampling_params import SamplingParams

PREFILL_LENGTHS = (16, 64, 128, 256, 512)
DECODE_BATCHES = (1, 4, 8)
DECODE_CONTEXTS = (64, 256)


@dataclass(slots=True)
class ProfileSamples:
    """(new_tokens, cached_tokens, seconds) prefills and (batch, kv_tokens, seconds) steps."""

    prefill: list[tuple[int, int, float]] = field(default_factory=list)
    decode: list[tuple[int, int, float]] = field(default_factory=list)


def profile_engine(engine: LLMEngine, seed: int = 0) -> ProfileSamples:
    """Time prefills of several lengths (cold and on a cached prefix) and decode steps of
    several batch sizes and contexts. Leaves the engine idle; its prefix cache keeps them."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    limit = engine.max_model_len - 2
    samples = ProfileSamples()
    for length in (n for n in PREFILL_LENGTHS if n <= limit):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        samples.prefill.append((length, 0, _time_prefill(engine, prompt)))
        extended = prompt + [rng.randrange(vocab) for _ in range(min(length, limit - length))]
        if len(extended) > len(prompt):
            cached = engine.config.block_size * (length // engine.config.block_size)
            samples.prefill.append(
                (len(extended) - cached, cached, _time_prefill(engine, extended))
            )
    for context in (c for c in DECODE_CONTEXTS if c + 8 <= limit):
        for batch in DECODE_BATCHES:
            samples.decode.append(
                (batch, batch * context, _time_decode(engine, rng, batch, context))
            )
    return samples


def _time_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


def _time_decode(engine: LLMEngine, rng: random.Random, batch: int, context: int) -> float:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(context)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
        engine.step()
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    return sorted(steps)[len(steps) // 2]

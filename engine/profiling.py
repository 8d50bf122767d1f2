"""A short start-up profile of an engine: timed prefills and decode steps, for the cost model."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.sampling_params import SamplingParams

# Short and odd lengths too: with small chunks every step would otherwise have the same size
# and the n^2 term could not be told from the n term.
PREFILL_LENGTHS = (5, 11, 16, 23, 40, 64, 128, 200, 256, 512)
DECODE_BATCHES = (1, 4, 8)
DECODE_CONTEXTS = (64, 256)


@dataclass(slots=True)
class ProfileSamples:
    """(new_tokens, tokens_before, seconds) prefill steps and (batch, kv_tokens, seconds)
    decode steps. A chunked engine (`chunk_tokens` > 0) prefills a prompt in several steps,
    each its own sample, so the fit is per step."""

    prefill: list[tuple[int, int, float]] = field(default_factory=list)
    decode: list[tuple[int, int, float]] = field(default_factory=list)
    chunk_tokens: int = 0


def profile_engine(
    engine: LLMEngine, seed: int = 0, prefill: bool = True, decode: bool = True
) -> ProfileSamples:
    """Time prefills of several lengths (cold and on a cached prefix) and decode steps of
    several batch sizes and contexts (`prefill` / `decode`: which of the two; a prefill worker
    needs only the first, a decode worker only the second). Leaves the engine idle; its prefix
    cache keeps them."""
    rng = random.Random(seed)
    limit = engine.max_model_len - 2
    samples = ProfileSamples(chunk_tokens=engine.config.prefill_chunk_size or 0)
    if prefill:
        samples.prefill = _prefill_samples(engine, rng, limit)
    if decode:
        samples.decode = _decode_samples(engine, rng, limit)
    engine.step_log.clear()  # these steps ran alone; the router's live refit should not see them
    return samples


def _prefill_samples(engine: LLMEngine, rng: random.Random, limit: int) -> list:
    """Each of PREFILL_LENGTHS cold, then extended on its own cached prefix."""
    vocab = engine.model_config.vocab_size
    samples = []
    for length in (n for n in PREFILL_LENGTHS if n <= limit):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        samples += _time_prefill(engine, prompt)
        extended = prompt + [rng.randrange(vocab) for _ in range(min(length, limit - length))]
        if len(extended) > len(prompt):
            samples += _time_prefill(engine, extended)
    return samples


def _decode_samples(engine: LLMEngine, rng: random.Random, limit: int) -> list:
    """(batch, KV tokens, seconds a step) for each of DECODE_BATCHES at each context."""
    return [
        (batch, batch * context, _time_decode(engine, rng, batch, context))
        for context in _decode_contexts(limit - 8)
        for batch in DECODE_BATCHES
    ]


def _decode_contexts(limit: int) -> list[int]:
    """Two or more distinct contexts within `limit`, so the fit can tell batch from KV size."""
    contexts = sorted({max(1, min(c, limit)) for c in DECODE_CONTEXTS})
    return contexts if len(contexts) > 1 else [max(1, contexts[0] // 2), contexts[0]]


def _time_prefill(engine: LLMEngine, prompt: list[int]) -> list[tuple[int, int, float]]:
    """(new tokens, tokens before, seconds) of each step that prefilled `prompt`."""
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    engine.step_log.clear()
    while engine.has_unfinished_requests():
        engine.step()
    return [
        (*step.prefill_chunks[0], step.seconds)
        for step in engine.step_log
        if len(step.prefill_chunks) == 1 and not step.decode_seqs
    ]


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

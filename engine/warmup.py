"""Start-up warm-up: run every kernel specialisation serving will use before the first request.

Triton compiles a kernel the first time it meets a new specialisation (a power-of-two tile
of sequences, a new split count, an integer argument that becomes 1 or a multiple of 16),
which stalled the first requests by hundreds of milliseconds. Block tables are padded to a
multiple of 16 pages, so what varies is the number of sequences in a step and the context
length; the warm-up covers both ranges, then leaves the engine idle and its counters at zero.

A count is specialised twice over: by its power-of-two tile and by whether it is a multiple of
16. 17 prefill runs in a step (tile 32, odd) is another kernel than 32 (tile 32, a multiple of
16), so every tile from 16 up is warmed with both. tests/engine/test_warmup_coverage.py records
the specialisations a varied workload meets (with Triton's own rules) and checks that the
warm-up met them all.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator

from halfmoon.engine.grammar import warm_mask_kernel
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.kernels import ops, reference
from halfmoon.kernels.decode_splits import MIN_SPLIT_TOKENS  # contexts double from here

log = logging.getLogger(__name__)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
# The sampler's other path (temperature, top-k/top-p sort, min-p, a seeded generator,
# logprobs), which the first sampled request would otherwise pay for while serving.
SAMPLED = SamplingParams(
    max_tokens=3,
    temperature=0.8,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    seed=0,
    logprobs=2,
    ignore_eos=True,
)


def warm_up_cuda(engine: LLMEngine, graphs: bool) -> None:
    """Compile every kernel specialisation now (xgrammar's mask kernel too), then capture the
    decode graphs (decode engines only, unless `enforce_eager`), so no request waits for a
    compiler; the step loop's thread runs `warm_up_step_thread` when it starts."""
    warm_up(engine)
    max_rows = engine.config.max_num_seqs
    warm_mask_kernel(engine.device, engine.facts.vocab_size, max_rows)
    # The torch references sync with the host (`.tolist()`), which a graph cannot capture.
    if graphs and ops.backend_for(engine.kv_cache.layers[0][0]) is reference:
        log.info("HALFMOON_KERNELS=torch: decode steps run eagerly (no CUDA graphs)")
        graphs = False
    if graphs and not engine.config.enforce_eager:
        engine.use_decode_buffers(capture=True)
    engine.on_step_thread.append(warm_up_step_thread)


def warm_up(engine: LLMEngine, seed: int = 0) -> float:
    """Prefill and decode batches of 1, 2, 4... sequences and contexts of 256, 512... tokens up
    to the engine's limits, and one sampled request; returns the seconds it took. Hooks are
    off meanwhile."""
    started = time.perf_counter()
    with _hooks_off(engine):
        rng = random.Random(seed)
        limit = min(engine.max_model_len - 4, engine.num_pages * engine.config.block_size // 2)
        for num_seqs in _counts(engine.config.max_num_seqs):
            _run(engine, rng, num_seqs, min(engine.config.block_size + 3, limit), waves=2)
        # Decode splits: a prompt of `context` tokens decodes with one split more than
        # context / SPLIT_TOKENS (its next token opens a page), one 4 tokens shorter with that many.
        for context in _doubling(MIN_SPLIT_TOKENS, limit):
            _run(engine, rng, 1, context - 4)
            _run(engine, rng, 1, context)
        _run(engine, rng, 2, min(engine.config.block_size + 3, limit), params=SAMPLED)
        # The KV API's page gather and scatter (prefill snapshots, decode-side writes), which
        # compiled at a worker's first transfer: page 0 of layer 0, read and written back as is.
        if engine.config.tensor_parallel_size == 1:  # at T > 1 on CUDA it refuses (kv_shards.py)
            kv_cache = engine.kv_cache
            kv_cache.write_layer(0, [0], kv_cache.read_layer(0, [0]).wait())
            kv_cache.wait_writes()
    _forget(engine)
    seconds = time.perf_counter() - started
    log.info("warm-up: kernels compiled for every batch and context size in %.1f s", seconds)
    return seconds


def warm_up_step_thread(engine: LLMEngine) -> None:
    """A greedy and a seeded sampled request on the thread that will run every step: its own
    first cuBLAS calls (a handle and workspace per thread) and the decode graphs' first
    replays happen here, not in the first request served."""
    with _hooks_off(engine):
        rng = random.Random(1)
        context = min(engine.config.block_size + 3, engine.max_model_len - 4)
        _run(engine, rng, 1, context)
        _run(engine, rng, 2, context, params=SAMPLED)
    _forget(engine)


@contextlib.contextmanager
def _hooks_off(engine: LLMEngine) -> Iterator[None]:
    """No KV hooks and no page events meanwhile: warm-up requests publish nothing, and the
    router's prefix index does not learn of their random prompts' blocks."""
    hooks, engine.hooks, engine.scheduler.hooks = engine.hooks, None, None
    events = engine.pool.events
    engine.pool.events = None if events is None else []
    try:
        yield
    finally:
        engine.hooks = engine.scheduler.hooks = hooks
        if events is not None:  # its blocks' events go; evictions of earlier blocks stay news
            stored = {key for kind, key in engine.pool.events if kind == "stored"}
            events += [(k, key) for k, key in engine.pool.events if key not in stored]
        engine.pool.events = events


def _doubling(start: int, stop: int) -> list[int]:
    """start, 2*start, 4*start... below `stop`, then `stop` itself."""
    sizes, size = [], start
    while size < stop:
        sizes.append(size)
        size *= 2
    return sizes + [stop] if stop >= start else sizes


def _counts(most: int) -> list[int]:
    """1, 2, 4... up to `most`, and from 16 on one past each (9, 17, 33...): every tile of
    counts, with a multiple of 16 and without."""
    sizes = _doubling(1, most)
    return sorted(set(sizes) | {size + 1 for size in sizes if 8 <= size < most})


def _run(
    engine: LLMEngine,
    rng: random.Random,
    num_seqs: int,
    context: int,
    waves: int = 1,
    params: SamplingParams = GREEDY,
) -> None:
    """`num_seqs` random prompts of `context` tokens, `waves` times over. A second wave finds
    the first's full blocks cached: its runs prefill over a prefix in one step, through the
    paged kernel, whose specialisation depends on the number of runs."""
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(num_seqs)]
    for _ in range(waves):
        for prompt in prompts:
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()


def _forget(engine: LLMEngine) -> None:
    """Counters and timings back to zero: the warm-up is not traffic."""
    engine.meter.reset()
    engine.scheduler.num_cached_prompt_tokens = engine.scheduler.num_preemptions = 0

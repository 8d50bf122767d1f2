"""No Triton kernel compiles after start-up: the warm-up meets every specialisation serving does.

Triton compiles a kernel again for each new specialisation of its arguments: constexpr values,
and for the others their type, whether an integer is 1 or a multiple of 16, and whether a
pointer is 16-byte aligned. Triton's own function for that (`native_specialize_impl`) runs
without a GPU, so on CPU this test records the key of every kernel launch, without running the
kernels (their outputs do not matter, only their arguments), for a GPU-sized engine: first
through the warm-up and the decode graphs' capture (what a CUDA engine runs before it is
ready), then through a varied workload. Every key the workload meets must have been met first.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.warmup import _counts, warm_up

triton = pytest.importorskip("triton")

# The GPU serving engine's shape (deploy/configs/gpu-cluster.yaml), on a tiny model whose 8k
# context (`tiny_8k_model_dir`) reaches the decode kernel's most splits (32).
ENGINE_ARGS = dict(
    block_size=16,
    num_pages=8192,
    max_num_batched_tokens=4096,
    prefill_chunk_size=2048,
    max_num_seqs=64,
    device="cpu",  # the kernels are recorded, not run: any device gives the same keys
    dtype="float32",
    enforce_eager=True,
)


class LaunchKeys:
    """Records each Triton kernel launch's specialisation key instead of running it."""

    def __init__(self, monkeypatch) -> None:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        from halfmoon.kernels import triton_cache, triton_decode, triton_norm, triton_prefill

        self.keys: set[tuple] = set()
        self._specialize = lambda value, on: native_specialize_impl(
            BaseBackend, value, False, on, on
        )
        kernels = [
            triton_cache._store_kv_kernel,
            triton_cache._scatter_pages_kernel,
            triton_decode._decode_split_kernel,
            triton_decode._decode_reduce_kernel,
            triton_norm._rms_norm_kernel,
            triton_norm._rotary_kernel,
            triton_prefill._prefill_kernel,
        ]
        for kernel in kernels:
            monkeypatch.setattr(kernel, "run", self._recorder(kernel))

    def _recorder(self, kernel):
        params = list(inspect.signature(kernel.fn).parameters.values())
        fixed = getattr(kernel, "do_not_specialize", None)
        if fixed is None:  # the interpreter keeps the decorator's arguments
            fixed = getattr(kernel, "kwargs", {}).get("do_not_specialize")
        fixed = set(fixed or ())

        def run(*args, grid, warmup, **kwargs):
            bound = dict(zip((p.name for p in params), args, strict=False)) | kwargs
            parts = []
            for index, param in enumerate(params):
                value = bound.get(param.name, param.default)
                if "constexpr" in str(param.annotation):
                    parts.append((param.name, value))
                else:
                    on = param.name not in fixed and index not in fixed
                    parts.append((param.name, self._specialize(value, on)))
            launch = tuple(sorted((k, v) for k, v in kwargs.items() if k.startswith("num_")))
            self.keys.add((kernel.fn.__name__, tuple(parts), launch))

        return run

    def take(self) -> set[tuple]:
        keys, self.keys = self.keys, set()
        return keys


def _ready_engine(model_dir, keys: LaunchKeys):
    """What a CUDA engine runs before it serves: the warm-up, then the graphs' capture (each
    batch and context bucket's forward once; `capture=False` runs it without a graph)."""
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    engine = llm.engine
    warm_up(engine)
    engine.use_decode_buffers(capture=False)  # max_num_seqs = 64
    graphs = engine.decode_graphs
    for size in graphs.buckets:
        for width in graphs.widths:
            graphs._forward(size, width)
    return llm


def _serve_varied(llm, rng: random.Random) -> None:
    vocab = llm.engine.facts.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # Every count of sequences in a step, each prompt sent twice: the second time all of them
    # prefill over a cached prefix in one step (the paged kernel, specialised by the count).
    for num_seqs in range(1, 65):
        lengths = [rng.randrange(18, 60) for _ in range(num_seqs)]
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        llm.generate(prompts, params)
        llm.generate(prompts, params)
    # Contexts across the whole range beside decoding sequences: a long prompt's later chunk
    # shares steps with their decodes (eager steps, whose decode splits follow the context).
    for context in range(100, 8180, 331):
        short = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
        long = [rng.randrange(vocab) for _ in range(context)]
        llm.generate([*short, long], SamplingParams(max_tokens=6, temperature=0.0))


def test_counts_warm_every_tile_with_and_without_a_multiple_of_16():
    assert _counts(5) == [1, 2, 4, 5]
    assert _counts(64) == [1, 2, 4, 8, 9, 16, 17, 32, 33, 64]
    assert _counts(40) == [1, 2, 4, 8, 9, 16, 17, 32, 33, 40]


def test_serving_meets_no_specialisation_the_warm_up_did_not(tiny_8k_model_dir, monkeypatch):
    monkeypatch.setenv("HALFMOON_KERNELS", "triton")
    keys = LaunchKeys(monkeypatch)
    llm = _ready_engine(tiny_8k_model_dir, keys)
    ready = keys.take()
    _serve_varied(llm, random.Random(0))
    served = keys.take()
    assert served, "the workload launched Triton kernels"
    missing = sorted(served - ready, key=repr)
    assert not missing, f"{len(missing)} specialisations compile after ready: {missing[:3]}"


def test_the_recorder_tells_specialisations_apart(monkeypatch):
    from halfmoon.kernels import triton_prefill

    keys = LaunchKeys(monkeypatch)
    run = triton_prefill._prefill_kernel.run
    args = [torch.zeros(4)] * 7 + [1.0] + [16] * 11  # pointers, scale, strides and sizes
    for num_runs in (16, 32, 17):
        args[14] = num_runs  # num_seqs
        run(*args, grid=(1,), warmup=False, BLOCK_S=triton.next_power_of_2(num_runs))
    assert len(keys.take()) == 3  # 16 vs 32: the tile; 17 vs 32: the multiple of 16

"""`halfmoon bench engine`'s default comparison: our engine (and, with --eager on CUDA, ours
without graphs) against transformers' `generate` over static batches and its continuous
batching, on the same requests; and the share of requests whose greedy tokens transformers'
static batches repeat exactly."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from halfmoon.bench.engine import Workload, run_ours, sync_device


def compare_with_transformers(model_dir: Path, work: Workload, dtype: torch.dtype, args) -> dict:
    """Ours (and, with --eager on CUDA, ours without graphs), then transformers' two ways."""
    log, device, batch = sys.stderr, args.device, args.batch_size
    kv = args.kv_cache_dtype
    ours = run_ours(model_dir, work, batch, device, dtype=dtype, kv_cache_dtype=kv)
    ours_s = ours.wall_s
    print(f"ours: {ours_s:.1f}s", file=log)
    eager_s = None
    if args.eager and device == "cuda":
        eager = run_ours(model_dir, work, batch, device, eager=True, dtype=dtype, kv_cache_dtype=kv)
        eager_s = eager.wall_s
        print(f"ours, eager: {eager_s:.1f}s", file=log)
    static_s, static_tokens = run_hf_static(model_dir, work, batch, device, dtype)
    print(f"hf static: {static_s:.1f}s", file=log)
    cb_s = None
    if not args.skip_hf_cb:
        cb_s = run_hf_continuous(model_dir, work, batch, device, dtype)
    print(f"hf continuous batching: {'skipped' if cb_s is None else f'{cb_s:.1f}s'}", file=log)
    tokens = work.num_output_tokens
    return {
        "ours_tok_s": tokens / ours_s,
        "ours_eager_tok_s": tokens / eager_s if eager_s else None,
        "hf_static_tok_s": tokens / static_s,
        "hf_cb_tok_s": tokens / cb_s if cb_s else None,
        "ratio_vs_hf_static": static_s / ours_s,
        "ratio_vs_hf_cb": cb_s / ours_s if cb_s else None,
        "overhead_ratio": ours_s / ours.forward_s,
        "hf_static_same_tokens": same_share(ours.token_ids, static_tokens),
    }


def same_share(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of requests whose tokens are the same on both sides."""
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def _hf_model(model_dir: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def run_hf_static(
    model_dir: Path, work: Workload, batch_size: int, device: str, dtype: torch.dtype
) -> tuple[float, list[list[int]]]:
    """Wall seconds for `generate` over static, left-padded batches of `batch_size` requests,
    and each request's first `output_lens` generated tokens."""
    model = _hf_model(model_dir, device, dtype)
    tokens: list[list[int]] = []
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[start : start + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
            )
            lens = work.output_lens[start : start + batch_size]
            out = model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=max(lens), pad_token_id=2
            )
            tokens += [row[width : width + n].tolist() for row, n in zip(out, lens, strict=True)]
    sync_device(device)
    return time.perf_counter() - started, tokens


def run_hf_continuous(
    model_dir: Path, work: Workload, batch_size: int, device: str, dtype: torch.dtype
) -> float | None:
    """Wall seconds for transformers' own continuous batching after an untimed request (its
    first allocates the KV cache, as ours does at load), or None where it is missing."""
    model = _hf_model(model_dir, device, dtype)
    if not hasattr(model, "init_continuous_batching"):
        return None
    manager = _continuous_batching(model, work)
    manager.start()
    try:
        _finish(manager, [manager.add_request([6] * 8, request_id="warm-up", max_new_tokens=2)])
        started = time.perf_counter()
        _finish(
            manager,
            [
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
                for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True))
            ],
        )
        return time.perf_counter() - started
    finally:
        manager.stop(block=True)


def _continuous_batching(model, work: Workload):
    """transformers' manager with batches of 2048 tokens, as ours, and a KV cache that holds the
    whole workload at once (by default it takes 90 % of the free memory, tens of seconds to
    zero on CPU); before transformers 5 both were the generation config's attributes."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(work.output_lens), pad_token_id=2)
    tokens = sum(map(len, work.prompts)) + work.num_output_tokens
    sizes = dict(max_batch_tokens=2048, num_blocks=math.ceil(tokens / 128) + len(work.prompts))
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        for name, value in sizes.items():
            setattr(config, name, value)
        return model.init_continuous_batching(generation_config=config)
    return model.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(**sizes)
    )


def _finish(manager, request_ids: list[str]) -> None:
    """Wait until each of `request_ids` has finished."""
    pending = set(request_ids)
    while pending:
        result = manager.get_result(timeout=600)
        if result is not None and result.is_finished():
            pending.discard(result.request_id)

"""`halfmoon bench engine`'s default comparison: our engine (and, with --eager on CUDA, ours
without graphs) against transformers' `generate` over static batches and its continuous
batching, on the same requests."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from halfmoon.bench.engine import Workload, run_ours, sync_device


def compare_with_transformers(model_dir: Path, work: Workload, dtype: torch.dtype, args) -> dict:
    """Ours (and, with --eager on CUDA, ours without graphs), then transformers' two ways."""
    log, device, batch = sys.stderr, args.device, args.batch_size
    kv = args.kv_cache_dtype
    ours_s, forward_s = run_ours(model_dir, work, batch, device, dtype=dtype, kv_cache_dtype=kv)
    print(f"ours: {ours_s:.1f}s", file=log)
    eager_s = None
    if args.eager and device == "cuda":
        eager_s, _ = run_ours(
            model_dir, work, batch, device, eager=True, dtype=dtype, kv_cache_dtype=kv
        )
        print(f"ours, eager: {eager_s:.1f}s", file=log)
    static_s = run_hf_static(model_dir, work, batch, device, dtype)
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
        "overhead_ratio": ours_s / forward_s,
    }


def _hf_model(model_dir: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def run_hf_static(
    model_dir: Path, work: Workload, batch_size: int, device: str, dtype: torch.dtype
) -> float:
    """Wall seconds for `generate` over static, left-padded batches of `batch_size` requests."""
    model = _hf_model(model_dir, device, dtype)
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[start : start + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
            )
            new = max(work.output_lens[start : start + batch_size])
            model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=2
            )
    sync_device(device)
    return time.perf_counter() - started


def run_hf_continuous(
    model_dir: Path, work: Workload, batch_size: int, device: str, dtype: torch.dtype
) -> float | None:
    """Wall seconds for transformers' own continuous batching, or None where it is missing."""
    model = _hf_model(model_dir, device, dtype)
    if not hasattr(model, "init_continuous_batching"):
        return None
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(work.output_lens), pad_token_id=2)
    config.max_batch_tokens = 2048
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    started = time.perf_counter()
    try:
        ids = [
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
            for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True))
        ]
        pending = set(ids)
        while pending:
            result = manager.get_result(timeout=600)
            if result is not None and result.is_finished():
                pending.discard(result.request_id)
    finally:
        wall = time.perf_counter() - started
        manager.stop(block=True)
    return wall

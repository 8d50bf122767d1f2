"""Every Triton kernel of halfmoon compiled for a CUDA GPU (sm_90, an H200's) on this machine,
without one: Triton's own compiler and ptxas, down to a cubin. Run as a script (without
TRITON_INTERPRET, under which `@triton.jit` gives functions that cannot compile) by
test_triton_compiles.py (arguments SHARD COUNT: every COUNT-th case); prints one JSON line
per case: its name, its error or null, and its seconds."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from halfmoon.kernels import triton_cache, triton_decode, triton_moe, triton_norm, triton_prefill
from halfmoon.kernels.triton_paged import dot_precision

TARGET = GPUTarget("cuda", 90, 32)

# Scalars of each kernel that are floats (the rest are int32).
FLOATS = {"scale_log2", "eps", "qmax"}
TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Storage of each KV format's codes (0: the model's dtype).
KV_STORAGE = {1: "u8", 2: "u8", 3: "u8"}


def compile_for_gpu(kernel, pointers: dict[str, str], constexprs: dict, default: str):
    """`kernel` compiled for `TARGET`: pointers named in `pointers` of that element type, the
    other `*_ptr` arguments of `default`; `constexprs` by name."""
    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, default)
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    fixed = {(names.index(name),): value for name, value in constexprs.items()}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=fixed), target=TARGET
    )
    assert compiled.asm["cubin"], kernel.__name__
    return compiled


def _kv(kv_format: int, dtype: torch.dtype) -> str:
    return KV_STORAGE.get(kv_format, TYPE[dtype])


CASES = [(0, torch.bfloat16), (1, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16)]
CASES += [(0, torch.float32)]


def attention_and_the_kv_write(kv_format, dtype):
    model, kv = TYPE[dtype], _kv(kv_format, dtype)
    caches = {"k_cache_ptr": kv, "v_cache_ptr": kv}
    ints = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32", "cu_seqlens_ptr": "i32"}
    ints |= {"prefix_lens_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32"}
    common = dict(BLOCK_D=128, BLOCK_N=64, DOT_PRECISION=dot_precision(dtype), KV_FORMAT=kv_format)
    # Both the one-split and the split decode for the model's own cache, the split one else.
    for single in (True, False) if kv_format == 0 else (False,):
        decode = dict(common, BLOCK_G=16, SINGLE_SPLIT=single)
        compile_for_gpu(triton_decode._decode_split_kernel, caches | ints, decode, model)
    prefill = dict(common, BLOCK_S=8, BLOCK_M=64)
    compile_for_gpu(triton_prefill._prefill_kernel, caches | ints, prefill, model)
    store = dict(BLOCK_H=8, BLOCK_D=128, KV_FORMAT=kv_format)
    pointers = caches | {"slot_ptr": "i64"}
    compile_for_gpu(triton_cache._store_kv_kernel, pointers, store, model)


def reduction_scatter_norms_and_rotary():
    splits = dict(BLOCK_SPLITS=16, BLOCK_D=128)
    ints = {"seq_lens_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32"}
    compile_for_gpu(triton_decode._decode_reduce_kernel, ints, splits, "bf16")
    compile_for_gpu(
        triton_cache._scatter_pages_kernel, {"page_ids_ptr": "i64"}, {"BLOCK": 1024}, "u8"
    )
    for residual in (True, False):
        norm = dict(HAS_RESIDUAL=residual, BLOCK=1024)
        compile_for_gpu(triton_norm._rms_norm_kernel, {}, norm, "bf16")
    rotary = dict(BLOCK_QH=32, BLOCK_KH=8, BLOCK_HALF=64)
    pointers = {"positions_ptr": "i64", "cache_ptr": "fp32"}
    compile_for_gpu(triton_norm._rotary_kernel, pointers, rotary, "bf16")


def fused_moe_gemms(dtype):
    model = TYPE[dtype]
    ints = {"pair_ids_ptr": "i32", "block_experts_ptr": "i32", "weights_ptr": "fp32"}
    for gated in (True, False):
        constexprs = dict(PAIRS_PER_A_ROW=2 if gated else 1, GATED=gated, BLOCK_M=16)
        constexprs |= dict(BLOCK_N=64, BLOCK_K=64, DOT_PRECISION=dot_precision(dtype))
        out = model if gated else "fp32"
        compile_for_gpu(triton_moe._expert_gemm_kernel, ints | {"out_ptr": out}, constexprs, model)


def cases() -> dict:
    """Name -> a call compiling one group of kernels, ordered so that every other one makes two
    halves of about equal time (fp32 attention, with full-precision dots, takes ~19 s here; each
    bf16 KV format's 5-6 s; the rest ~3 s)."""
    attention = {f"attention-kv{f}-{TYPE[d]}": (attention_and_the_kv_write, f, d) for f, d in CASES}
    others = {"reduction-scatter-norms-rotary": (reduction_scatter_norms_and_rotary,)}
    for dtype in (torch.bfloat16, torch.float32):
        others[f"fused-moe-{TYPE[dtype]}"] = (fused_moe_gemms, dtype)
    first = {"attention-kv0-fp32": attention.pop("attention-kv0-fp32")}
    pairs = zip([*first, *others], attention, strict=False)
    order = [name for pair in pairs for name in pair]
    return {name: (first | attention | others)[name] for name in order}


def main(argv: list[str]) -> int:
    """`SHARD COUNT`: every COUNT-th case from the SHARD-th (0 1: all), so that COUNT processes
    can share the cases."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    shard, count = (int(a) for a in argv) if argv else (0, 1)
    for name, (run, *args) in list(cases().items())[shard::count]:
        began = time.perf_counter()
        try:
            run(*args)
            error = None
        except Exception as failure:  # noqa: BLE001 - reported, case by case
            error = f"{type(failure).__name__}: {str(failure)[-2000:]}"
        seconds = round(time.perf_counter() - began, 1)
        print(json.dumps({"case": name, "error": error, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The CPU decode attention of `cpu_attention.cpp`: pages read in place, K and V once each.

Issue 31 measured the torch reference (a page gather, then SDPA over it) at about half of a
bf16 decode step; this kernel reads each cached token once for all query heads of its KV head.
It is built on first use with the system's g++ (`-O3 -march=native -fopenmp`, about 2 s),
cached under `$HALFMOON_CACHE/kernels` by a hash of its source, flags and CPU, and loaded with
ctypes; without a compiler (or if the build fails, with a warning) the torch reference
serves (`available()` says which).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()


def available() -> bool:
    """Whether the kernel is built (or can be) and loads on this machine."""
    return _library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel serves these tensors: CPU, one dtype it knows, contiguous caches."""
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and k_cache.dtype == query.dtype
        and k_cache.is_contiguous()
        and available()
    )


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale: float):
    """`reference.paged_decode_attention`'s contract: one query per sequence ([S, q_heads, D])
    over its first `seq_lens[s]` (>= 1) cached tokens, read in place."""
    num_seqs, q_heads, head_dim = query.shape
    num_pages, block_size, kv_heads, _ = k_cache.shape
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    _library().paged_decode_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.contiguous().data_ptr(),
        tables.data_ptr(), lens.data_ptr(), num_seqs, q_heads, kv_heads, head_dim,
        block_size, tables.shape[1], scale, DTYPES[query.dtype], torch.get_num_threads(),
        out.data_ptr(),
    )  # fmt: skip
    return out


@cache
def _library() -> ctypes.CDLL | None:
    with _lock:
        path = _build()
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    function = library.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr] * 5 + [i64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ptr]
    function.restype = None
    return library


def _build() -> Path | None:
    """The shared library for this source, flags and CPU, compiled once per machine."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags())
    target = _cache_dir() / f"cpu_attention-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True
        )
        if result.returncode != 0:
            warnings.warn(
                f"building {SOURCE.name} failed, CPU decode attention takes the torch "
                f"reference:\n{result.stderr[-2000:]}",
                stacklevel=2,
            )
            return None
        os.replace(built, target)  # atomic: another process may build the same file at once
    return target


def _cache_dir() -> Path:
    """`$HALFMOON_CACHE/kernels`, by default `~/.cache/halfmoon/kernels` (beside the models)."""
    root = os.environ.get("HALFMOON_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "halfmoon"
    )
    return Path(root) / "kernels"


def _cpu_flags() -> bytes:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    return next((line for line in text.splitlines() if line.startswith("flags")), "").encode()

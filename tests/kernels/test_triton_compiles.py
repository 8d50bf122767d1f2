"""Every Triton kernel compiles for a CUDA GPU here, without one (triton_compile_cases.py, in a
process of its own: the suite runs Triton's interpreter). The interpreter that runs the kernels
on CPU in the other tests accepts code the compiler refuses: an early `return` under a
constexpr `if` whose paths return different types (the cache's dtype, fp32) failed every
attention kernel over an unquantized cache on Triton 3.6 (the GPU image's) and 3.9, which only a
GPU would have said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("triton_compile_cases.py")


def _has_cuda_backend() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(
    not _has_cuda_backend(), reason="this Triton has no CUDA backend to compile with"
)
@pytest.mark.timeout(300)
def test_every_triton_kernel_compiles_for_sm_90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, not found in a cache
    run = subprocess.run(
        [sys.executable, str(CASES)], env=env, capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 8, run.stdout
    failed = {r["case"]: r["error"] for r in results if r["error"]}
    assert not failed, failed

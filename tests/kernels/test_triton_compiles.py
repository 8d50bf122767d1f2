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
    # Two processes share the cases: a cluster test beside this one leaves a core idle often.
    shards = [
        subprocess.Popen(
            [sys.executable, str(CASES), str(shard), "2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for shard in range(2)
    ]
    outputs = [shard.communicate(timeout=280) for shard in shards]
    for shard, (_, stderr) in zip(shards, outputs, strict=True):
        assert shard.returncode == 0, stderr[-3000:]
    lines = [line for stdout, _ in outputs for line in stdout.splitlines()]
    results = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(results) == 8, lines
    failed = {r["case"]: r["error"] for r in results if r["error"]}
    assert not failed, failed

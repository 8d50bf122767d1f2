"""Run at start-up by every process of the vLLM peer (its driver, engine core and workers: the
peer's PYTHONPATH names this folder) where `HALFMOON_CPU_ISA` makes our kernels run what a CPU
without AVX-512 runs: vLLM then loads its own AVX2 build (`vllm._C_AVX2`), which it picks where
torch reports no AVX-512 (vllm/platforms/cpu.py, `import_kernels`)."""

import os

if os.environ.get("HALFMOON_CPU_ISA", "").strip().lower() in ("avx2", "generic"):
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False

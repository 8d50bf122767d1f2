"""The compiled CPU kernels read every tensor through its pointer, so each one must be in host
memory: the dispatch checks every tensor a kernel takes, not the first alone, and the kernels
allocate their outputs where their inputs are, not on the default device (a CUDA buffer written
by host code under `with torch.device("cuda")` crashed the first GPU visit). The `meta` device
stands in for a GPU's here: not host memory, on every machine."""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels import cpu_elementwise, cpu_gemm, ops, reference

META = torch.device("meta")


def test_the_dispatch_takes_the_compiled_kernels_only_when_every_tensor_is_on_the_cpu():
    cpu, elsewhere = torch.zeros(2), torch.zeros(2, device=META)
    assert ops._native_cpu(cpu, cpu, None)
    assert not ops._native_cpu(cpu, elsewhere)
    if cpu_elementwise.available():
        assert ops._per_token(cpu, cpu) is cpu_elementwise
    assert ops._per_token(cpu, elsewhere) is reference  # a CPU first tensor: the reference


def test_a_kv_write_with_its_slots_off_the_cpu_is_not_handed_to_the_compiled_write():
    key = torch.randn(3, 2, 8)
    cache = torch.zeros(4, 4, 2, 8)
    slots = torch.tensor([0, 5, 9], device=META)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the reference's error, no crash
        cpu_elementwise.store_kv(key, key, cache, cache.clone(), slots)
    with pytest.raises((RuntimeError, NotImplementedError)):
        ops.store_kv(key, key, cache, cache.clone(), slots)


@pytest.mark.skipif(not cpu_elementwise.available(), reason="the CPU kernels do not build here")
def test_swiglu_allocates_where_its_input_is_under_another_default_device():
    x = torch.randn(5, 16)
    with META:
        out = cpu_elementwise.silu_and_mul(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, reference.silu_and_mul(x))


def test_the_gemm_allocates_on_the_cpu_under_another_default_device():
    weight = torch.randn(32, 64)
    if not (cpu_gemm.available(torch.float32) and cpu_gemm.packable(weight)):
        pytest.skip("no cpu_gemm kernel for fp32 on this machine")
    packed = cpu_gemm.pack(weight)
    x = torch.randn(3, 64)
    with META:
        out = cpu_gemm.linear(x, packed)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-4, atol=1e-4)

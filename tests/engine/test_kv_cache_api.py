"""The engine's KV API: workers read and write layers of pages and take page events through it."""

from __future__ import annotations

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.kvstore.layout import LayerKV


def test_a_layer_written_into_pages_reads_back_exactly_in_page_order(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), num_pages=16).engine
    kv_cache = engine.kv_cache
    shape = (3, *kv_cache.page_shape[1:])
    k = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    kv_cache.write_layer(2, [7, 1, 4], LayerKV(k, -k))  # another dtype: converted on write
    read = kv_cache.read_layer(2, [4, 7]).wait()
    assert read.k.dtype == kv_cache.dtype == engine.dtype
    assert torch.equal(read.k, k[[2, 0]].to(kv_cache.dtype))
    assert torch.equal(read.v, -k[[2, 0]].to(kv_cache.dtype))
    assert torch.count_nonzero(kv_cache.layers[1][0]) == 0  # other layers untouched


def test_on_cpu_a_write_has_landed_when_it_returns(tiny_model_dir):
    kv_cache = LLM(str(tiny_model_dir), num_pages=8).engine.kv_cache
    shape = (1, *kv_cache.page_shape[1:])
    written = kv_cache.write_layer(
        0, [5], LayerKV(torch.ones(shape), torch.ones(shape)), ordered=False
    )
    assert written.done()
    written.wait()
    kv_cache.wait_writes()
    assert torch.all(kv_cache.layers[0][0][5] == 1)


def test_page_events_are_kept_only_once_asked_for_and_taken_once(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=16)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(["a" * 40], params)
    assert llm.engine.take_page_events() == []
    llm.engine.record_page_events()
    llm.generate(["b" * 40], params)
    events = llm.engine.take_page_events()
    assert [kind for kind, _ in events] == ["stored", "stored"]  # two full 16-token blocks
    assert llm.engine.take_page_events() == []


@pytest.mark.gpu
def test_on_cuda_reads_land_in_pinned_host_memory_off_the_compute_stream(tiny_model_dir):
    kv_cache = LLM(str(tiny_model_dir), num_pages=16, device="cuda").engine.kv_cache
    assert kv_cache.device.type == "cuda"
    shape = (2, *kv_cache.page_shape[1:])
    k = torch.randn(shape)  # from host memory, converted and placed by the cache
    kv_cache.write_layer(0, [3, 9], LayerKV(k, 2 * k))
    snapshot = kv_cache.read_layer(0, [9, 3])
    assert snapshot.copied is not None
    read = snapshot.wait()
    assert read.k.device.type == "cpu" and read.k.is_pinned()
    assert torch.equal(read.k, k[[1, 0]].to(kv_cache.dtype))
    assert torch.equal(read.v, (2 * k)[[1, 0]].to(kv_cache.dtype))


@pytest.mark.gpu
def test_on_cuda_an_unordered_write_lands_on_the_side_stream_and_says_when(tiny_model_dir):
    kv_cache = LLM(str(tiny_model_dir), num_pages=16, device="cuda").engine.kv_cache
    shape = (3, *kv_cache.page_shape[1:])
    k = torch.randn(shape)  # pageable host memory: staged through pinned memory
    written = kv_cache.write_layer(1, [2, 8, 5], LayerKV(k, -k), ordered=False)
    assert written.copied is not None
    written.wait()
    assert written.done()
    read = kv_cache.read_layer(1, [5, 2]).wait()
    assert torch.equal(read.k, k[[2, 0]].to(kv_cache.dtype))
    assert torch.equal(read.v, -k[[2, 0]].to(kv_cache.dtype))
    # An ordered write: work queued on the compute stream after it sees the new values.
    kv_cache.write_layer(1, [2], LayerKV(torch.zeros(shape[1:]).unsqueeze(0), k[:1]))
    assert torch.count_nonzero(kv_cache.layers[1][0][2]) == 0
    kv_cache.wait_writes()

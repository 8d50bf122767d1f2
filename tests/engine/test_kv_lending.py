"""The device tier's engine side: a prefill engine's pages held while lent, its KV cache opened by
another engine (shared memory on CPU, CUDA IPC on a GPU) and copied from page to page."""

from __future__ import annotations

import multiprocessing
import queue as queues
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.page_pool import PagePool
from halfmoon.engine.sequence import Sequence
from halfmoon.kvstore.layout import LayerKV


def _seq(num_tokens: int) -> Sequence:
    return Sequence("r", list(range(num_tokens)), num_tokens, SamplingParams(max_tokens=1), 0.0)


def test_held_pages_outlive_their_sequence_until_the_unhold_is_drained():
    pool = PagePool(4, 2, b"root")
    seq = _seq(4)
    pool.grow(seq, 4)
    pages = list(seq.block_table)
    pool.hold(pages)
    assert pool.num_held_pages == 2
    pool.release(seq)
    assert pool.num_free_pages == 2  # still held: not free, not evictable
    pool.unhold_later(pages)  # from any thread; takes effect at the drain
    assert pool.num_free_pages == 2
    pool.drain_unholds()
    assert pool.num_free_pages == 4 and pool.num_held_pages == 0
    with pytest.raises(ValueError, match="not in use"):
        pool.hold([0])


def test_a_shared_cache_serves_requests_and_is_opened_and_copied_from(tiny_model_dir):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    lender = LLM(str(tiny_model_dir), num_pages=16, share_kv=True)
    plain = LLM(str(tiny_model_dir), num_pages=16)
    prompt = "the pages are lent " * 3
    assert lender.generate([prompt], params)[0].text == plain.generate([prompt], params)[0].text
    lender_kv, plain_kv = lender.engine.kv_cache, plain.engine.kv_cache
    assert plain_kv.export() is None  # not allocated shared

    export = lender_kv.export()
    assert export.path is not None and export.page_shape[0] == 16
    peer = plain_kv.open_peer(export)
    assert peer.num_pages == 16
    shape = (2, *lender_kv.page_shape[1:])
    k = torch.randn(shape)
    lender_kv.write_layer(1, [5, 9], LayerKV(k, -k))
    plain_kv.copy_pages(1, peer, [9, 5], [2, 3]).wait()  # lands on return on CPU
    got = plain_kv.read_layer(1, [3, 2]).wait()
    assert torch.equal(got.k, k.to(got.k.dtype)) and torch.equal(got.v, -k.to(got.v.dtype))


def test_a_cache_of_another_shape_or_dtype_is_refused_with_the_reason(tiny_model_dir):
    lender = LLM(str(tiny_model_dir), num_pages=8, dtype="bfloat16", share_kv=True).engine.kv_cache
    other = LLM(str(tiny_model_dir), num_pages=8, dtype="bfloat16", block_size=32).engine.kv_cache
    with pytest.raises(ValueError, match="another model or block size"):
        other.open_peer(lender.export())
    wide = LLM(str(tiny_model_dir), num_pages=8, dtype="float32").engine.kv_cache
    with pytest.raises(ValueError, match="its KV is torch.bfloat16"):
        wide.open_peer(lender.export())


def test_another_process_maps_the_shared_cache(tiny_model_dir):
    lender = LLM(str(tiny_model_dir), num_pages=8, share_kv=True).engine.kv_cache
    shape = (1, *lender.page_shape[1:])
    lender.write_layer(0, [6], LayerKV(torch.full(shape, 3.0), torch.full(shape, 4.0)))
    export = lender.export()
    script = textwrap.dedent(
        f"""
        import math, torch
        shape = ({export.num_layers}, 2, *{tuple(export.page_shape)})
        pages = torch.from_file({export.path!r}, shared=True, size=math.prod(shape),
                                dtype={export.dtype}).view(shape)
        print(float(pages[0, 0, 6].mean()), float(pages[0, 1, 6].mean()))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3.0", "4.0"]


def _result_or_death(child, queue, timeout_s: float = 300.0):
    """The child's result, or a failure as soon as it dies without one (not after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            if not child.is_alive():
                pytest.fail(f"the child process died (exit {child.exitcode}) before answering")
    pytest.fail(f"the child process gave no result in {timeout_s:g} s")


def test_a_child_that_dies_without_answering_fails_the_test_at_once():
    context = multiprocessing.get_context("fork")
    child = context.Process(target=sys.exit, args=(3,))
    child.start()
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="exit 3"):
        _result_or_death(child, context.Queue())
    assert time.monotonic() - started < 10


def test_a_closed_peer_cache_is_dropped_after_the_writes_land(tiny_model_dir):
    lender = LLM(str(tiny_model_dir), num_pages=8, share_kv=True).engine.kv_cache
    borrower = LLM(str(tiny_model_dir), num_pages=8).engine.kv_cache
    peer = borrower.open_peer(lender.export())
    borrower.copy_pages(0, peer, [1], [2])
    borrower.close_peer(peer)
    assert peer.layers == []


def _open_in_child(model_dir: str, export, pages: list[int], queue) -> None:
    borrower = LLM(model_dir, num_pages=8, device="cuda").engine.kv_cache
    peer = borrower.open_peer(export)
    borrower.copy_pages(0, peer, pages, [1, 2]).wait()
    got = borrower.read_layer(0, [1, 2]).wait()
    queue.put((got.k.float().sum().item(), got.v.float().sum().item()))


@pytest.mark.gpu
def test_on_cuda_another_process_copies_lent_pages_through_ipc(tiny_model_dir):
    lender = LLM(str(tiny_model_dir), num_pages=8, device="cuda", share_kv=True).engine.kv_cache
    shape = (2, *lender.page_shape[1:])
    k = torch.randn(shape)
    lender.write_layer(0, [4, 6], LayerKV(k, 2 * k))
    torch.cuda.synchronize()
    export = lender.export()
    assert export.device_uuid and len(export.handles) == lender.num_layers
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(
        target=_open_in_child, args=(str(tiny_model_dir), export, [4, 6], queue)
    )
    child.start()
    k_sum, v_sum = _result_or_death(child, queue)
    child.join(60)
    expected = k.to(lender.dtype).float().sum().item()
    assert k_sum == pytest.approx(expected, rel=1e-3, abs=1e-2)
    assert v_sum == pytest.approx(2 * expected, rel=1e-3, abs=1e-2)


def _lend_in_child(model_dir: str, queue, stop) -> None:
    lender = LLM(model_dir, num_pages=8, device="cuda", share_kv=True).engine.kv_cache
    shape = (1, *lender.page_shape[1:])
    lender.write_layer(0, [5], LayerKV(torch.full(shape, 3.0), torch.full(shape, 4.0)))
    torch.cuda.synchronize()
    queue.put(lender.export())
    stop.wait(300)  # killed before this ends


@pytest.mark.gpu
def test_a_lender_that_dies_with_its_pages_mapped_leaves_the_borrower_working(tiny_model_dir):
    context = multiprocessing.get_context("spawn")
    queue, stop = context.Queue(), context.Event()
    child = context.Process(target=_lend_in_child, args=(str(tiny_model_dir), queue, stop))
    child.start()
    export = _result_or_death(child, queue)
    borrower = LLM(str(tiny_model_dir), num_pages=8, device="cuda").engine.kv_cache
    peer = borrower.open_peer(export)
    borrower.copy_pages(0, peer, [5], [2]).wait()
    child.kill()  # the prefill worker dies with its pages mapped here
    child.join(60)
    borrower.close_peer(peer)  # what the decode worker does when its connection ends
    assert not peer.layers
    got = borrower.read_layer(0, [2]).wait()
    torch.cuda.synchronize()  # no sticky error: the borrower's context still works
    assert got.k.float().mean().item() == 3.0 and got.v.float().mean().item() == 4.0

"""The transfer engine's parts on their own (kvstore/transfer/engine.py, staging.py): the notice
format refuses what is not ours, grants are runs of the staging region that come back merged
(at once when clean, after the quarantine otherwise), and a grant's places are where the
layer-major region has each layer's K and V. Real engines, in this process."""

from __future__ import annotations

import time

import pytest
import torch

from halfmoon.kernels.kv_quant import quantize, row_width
from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.layout import KvLayout
from halfmoon.kvstore.transfer.engine import (
    FirstToken,
    Landed,
    first_token_message,
    landed_message,
    merged_spans,
    open_endpoint,
    parse_notice,
)
from halfmoon.kvstore.transfer.staging import StagingArea

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
LAYOUT = KvLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)
TOKEN = "0123456789abcdef"


@pytest.fixture(scope="module")
def endpoints():
    settings = TransferSettings(engine="mooncake", host="127.0.0.1")
    (receiver, path), (writer, _) = open_endpoint(settings), open_endpoint(settings)
    assert receiver is not None and writer is not None, path
    yield receiver, writer
    receiver.close()
    writer.close()


def test_notices_parse_and_anything_else_is_refused():
    assert parse_notice("k", landed_message(TOKEN, 3, 1)) == Landed("k", TOKEN, 3, 1)
    assert parse_notice("k", first_token_message(TOKEN, 42)) == FirstToken("k", TOKEN, 42)
    for bad in ["", "x:1:2", f"{TOKEN}:1", f"{TOKEN}:-1:2", f"{TOKEN}:t:99999999999", "a" * 99]:
        assert parse_notice("k", bad) is None, bad
    assert parse_notice("", landed_message(TOKEN, 0, 0)) is None
    assert parse_notice("k" * 513, landed_message(TOKEN, 0, 0)) is None


def test_grants_are_runs_given_back_merged_or_after_the_quarantine(endpoints):
    staging = StagingArea(LAYOUT, 8 * LAYOUT.block_bytes, endpoints[0], quarantine_s=0.2)
    a, b = staging.grant(3), staging.grant(3)
    assert (a.first_slot, b.first_slot) == (0, 3) and a.token != b.token
    assert staging.grant(3) is None and staging.counters()["num_staging_full"] == 1
    staging.release(a, clean=True)
    staging.release(b, clean=False)  # its writer may still write: held back
    assert staging.counters()["staging_slots_free"] == 5
    time.sleep(0.25)
    assert staging.grant(8).first_slot == 0  # thawed and merged into one run
    staging.close()


def test_a_grants_places_are_its_blocks_k_and_v_of_each_layer(endpoints):
    receiver, writer = endpoints
    staging = StagingArea(LAYOUT, 4 * LAYOUT.block_bytes, receiver)
    grant = staging.grant(2)
    shape = (2, *LAYOUT.page_shape)
    for layer in range(LAYOUT.num_layers):
        k, v = torch.randn(shape).half(), torch.randn(shape).half()
        k_at, v_at = grant.places(layer, 0)
        writer.write(
            grant.session, [(k.data_ptr(), k_at, k.nbytes), (v.data_ptr(), v_at, v.nbytes)]
        )
        landed = staging.layer(grant, layer, 0, 2)
        assert torch.equal(landed.k, k) and torch.equal(landed.v, v)
    staging.close()


def test_8_bit_kv_lands_with_its_scales_as_it_was_written(endpoints):
    """KV in 8 bits (kernels/kv_quant.py) crosses on the engine as what it is: rows of fp8
    values and their fp16 scales, in the layout's storage dtype, byte for byte."""
    receiver, writer = endpoints
    fp8 = torch.float8_e4m3fn
    layout = KvLayout(2, 16, 2, row_width(8, fp8), fp8)
    assert layout.block_bytes == LAYOUT.block_bytes * 10 // 16  # rows of 10 bytes, fp16's 16
    staging = StagingArea(layout, 4 * layout.block_bytes, receiver)
    grant = staging.grant(2)
    for layer in range(layout.num_layers):
        k, v = (quantize(torch.randn(2, 16, 2, 8), fp8) for _ in range(2))
        k_at, v_at = grant.places(layer, 0)
        writer.write(
            grant.session, [(k.data_ptr(), k_at, k.nbytes), (v.data_ptr(), v_at, v.nbytes)]
        )
        landed = staging.layer(grant, layer, 0, 2)
        assert landed.k.dtype == fp8 and landed.k.shape == k.shape
        assert torch.equal(landed.k.view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(landed.v.view(torch.uint8), v.view(torch.uint8))
    staging.close()


def test_the_local_ranges_an_rdma_move_registers_are_merged_where_they_touch():
    assert merged_spans([(0, 4), (4, 8), (20, 24), (2, 6)]) == [(0, 8), (20, 24)]

"""The store's errors cross process boundaries (Ray) whole: their fields and message survive."""

from __future__ import annotations

import pickle

import pytest

from halfmoon.kvstore.errors import CorruptRecord, LayerTimeout, StoreFull


@pytest.mark.parametrize(
    "error",
    [
        StoreFull(3, 1, 2),
        LayerTimeout(layer=1, missing_blocks=2, num_blocks=3, timeout_s=0.5),
        CorruptRecord("checksum mismatch"),
    ],
    ids=["positional", "keywords", "plain"],
)
def test_an_unpickled_error_keeps_its_fields_and_message(error):
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), vars(copy), str(copy)) == (type(error), vars(error), str(error))


def test_store_full_says_what_would_free_room():
    assert str(StoreFull(3, 1, 2)) == (
        "host tier needs 3 free blocks but only 1 can be evicted (2 are leased); release leases "
        "or raise host_capacity_bytes"
    )

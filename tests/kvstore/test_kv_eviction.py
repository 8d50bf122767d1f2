from __future__ import annotations

import pytest

from halfmoon.kvstore.eviction import LruEviction


def lru_of(*keys: str) -> LruEviction:
    lru = LruEviction()
    for key in keys:
        lru.add(key)
    return lru


def test_victims_are_least_recent_first() -> None:
    lru = lru_of("a", "b", "c")
    lru.add("a")
    assert [lru.pop_victim(), lru.pop_victim()] == ["b", "c"]
    assert len(lru) == 1


def test_pop_victim_skips_leased_keys_until_last_release() -> None:
    lru = lru_of("a", "b")
    lru.lease("a")
    lru.lease("a")
    assert lru.pop_victim() == "b"
    assert lru.pop_victim() is None
    lru.release("a")
    assert lru.pop_victim() is None
    lru.release("a")
    assert lru.pop_victim() == "a"
    assert len(lru) == 0


def test_released_key_becomes_most_recent() -> None:
    lru = lru_of("a", "b", "c")
    lru.lease("a")
    lru.release("a")
    assert [lru.pop_victim() for _ in range(3)] == ["b", "c", "a"]


def test_leased_key_is_counted_and_contained() -> None:
    lru = lru_of("a")
    lru.lease("a")
    assert "a" in lru and len(lru) == 1 and lru.num_leased == 1


def test_leasing_an_untracked_key_is_an_error() -> None:
    with pytest.raises(KeyError, match="untracked"):
        LruEviction().lease("x")

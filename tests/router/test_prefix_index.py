from __future__ import annotations

import random

import pytest

from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.router.prefix_index import PrefixIndex

INSTANCES = ["p0", "p1", "d0"]
TIERS = ["device", "host", "redis"]


def brute_force(held: dict[tuple[str, str], set[int]], keys: list[int]) -> dict:
    answer = {}
    for location, blocks in held.items():
        depth = 0
        while depth < len(keys) and keys[depth] in blocks:
            depth += 1
        if depth:
            answer[location] = depth
    return answer


@pytest.mark.parametrize("seed", range(5))
def test_longest_prefix_matches_brute_force_on_random_traces(seed: int) -> None:
    rng = random.Random(seed)
    index, held = PrefixIndex(), {}
    for _ in range(400):
        location = (rng.choice(INSTANCES), rng.choice(TIERS))
        keys = [rng.randrange(40) for _ in range(rng.randrange(1, 8))]
        kind = rng.choice(["stored", "stored", "evicted"])
        index.apply(BlockEvent(kind, *location, keys))
        blocks = held.setdefault(location, set())
        blocks.update(keys) if kind == "stored" else blocks.difference_update(keys)
        query = [rng.randrange(40) for _ in range(rng.randrange(0, 12))]
        assert index.longest_prefix(query) == brute_force(held, query)
        for loc in held:
            assert index.num_blocks(*loc) == len(held[loc])


def test_drop_instance_forgets_every_tier_of_it() -> None:
    index = PrefixIndex()
    index.stored("p0", "host", [1, 2])
    index.stored("p1", "host", [1])
    index.drop_instance("p0")
    assert index.longest_prefix([1, 2]) == {("p1", "host"): 1}


def test_block_event_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="'moved'"):
        BlockEvent("moved", "p0", "host", [1])  # type: ignore[arg-type]

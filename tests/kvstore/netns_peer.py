"""One side of test_transfer_netns.py, run inside a network namespace of its own:
`python netns_peer.py receive HOST` registers a staging region on HOST and prints its grant as a
JSON line, then waits for every landed notice and prints whether the bytes are what the writer
sent; `python netns_peer.py write HOST GRANT_JSON` writes each layer of one unit into the grant
from HOST, with the landed notice on its last write (kvstore/transfer/engine.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch

from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.layout import KvLayout
from halfmoon.kvstore.transfer.engine import landed_message, open_endpoint, parse_notice
from halfmoon.kvstore.transfer.staging import Grant, StagingArea

LAYOUT = KvLayout(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64)
NUM_BLOCKS = 8
KEY = "netns-receive"


def layer_kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the writer sends for `layer`: a pattern the receiver can check."""
    shape = (NUM_BLOCKS, *LAYOUT.page_shape)
    generator = torch.Generator().manual_seed(layer)
    k, v = (torch.randn(shape, generator=generator).to(LAYOUT.dtype) for _ in "kv")
    return k, v


def receive(host: str) -> None:
    endpoint, path = open_endpoint(TransferSettings(engine="mooncake", host=host))
    assert endpoint is not None, path
    staging = StagingArea(LAYOUT, 8 << 20, endpoint)
    grant = staging.grant(NUM_BLOCKS)
    print(json.dumps(dataclasses.asdict(grant)), flush=True)
    landed: set[int] = set()
    deadline = time.monotonic() + 60
    while len(landed) < LAYOUT.num_layers and time.monotonic() < deadline:
        for name, message in endpoint.notifies():
            notice = parse_notice(name, message)
            if notice is not None and name == KEY and notice.token == grant.token:
                landed.add(notice.layer)
        time.sleep(0.001)
    intact = all(
        torch.equal(staging.layer(grant, layer, 0, NUM_BLOCKS).k, layer_kv(layer)[0])
        and torch.equal(staging.layer(grant, layer, 0, NUM_BLOCKS).v, layer_kv(layer)[1])
        for layer in sorted(landed)
    )
    print(json.dumps({"landed": sorted(landed), "intact": intact}), flush=True)
    staging.close()


def write(host: str, grant_json: str) -> None:
    endpoint, path = open_endpoint(TransferSettings(engine="mooncake", host=host))
    assert endpoint is not None, path
    grant = Grant(**json.loads(grant_json))
    for layer in range(LAYOUT.num_layers):
        k, v = layer_kv(layer)
        k_at, v_at = grant.places(layer, 0)
        pieces = [(k.data_ptr(), k_at, k.nbytes), (v.data_ptr(), v_at, v.nbytes)]
        endpoint.write(grant.session, pieces, notify=(KEY, landed_message(grant.token, 0, layer)))
    print(json.dumps(endpoint.counters()), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "receive":
        receive(sys.argv[2])
    else:
        write(sys.argv[2], sys.argv[3])
